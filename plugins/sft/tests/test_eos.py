"""A chat template that ends turns with no end-of-turn token: one warning naming it and the fixes;
``[sft] append_eos`` appends the EOS, trained, to every sample."""

from __future__ import annotations

import pytest
from corelooper_sft import DEFAULTS
from corelooper_sft.pipeline import prepare
from sft_fixtures import CHATS, NO_MARKERS, WITH_MARKERS, _datasets_cache, make_tokenizer  # noqa: F401 (fixtures)

# "user: ...\nassistant: ...\n": nothing ends a turn, so nothing teaches the model to stop
BARE = (
    "{%- for m in messages -%}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'assistant: ' }}{%- endif -%}"
)


def prepared(template, caplog, **sft):
    rows = [{"messages": c["messages"]} for c in CHATS] * 2
    tok = make_tokenizer(template)
    with caplog.at_level("WARNING", logger="corelooper.sft"):
        out = prepare(rows, tok, {**DEFAULTS, "max_length": 0, **sft}, "data.train (chat.jsonl)")
    return out, tok, [r.getMessage() for r in caplog.records if "end-of-turn" in r.getMessage()]


@pytest.mark.parametrize("assistant_only_loss", [True, False])
def test_a_template_without_an_end_of_turn_token_is_named_in_one_warning(caplog, assistant_only_loss):
    _, _, said = prepared(BARE, caplog, assistant_only_loss=assistant_only_loss)
    assert len(said) == 1, said
    assert said[0].startswith(
        "sft: data.train (chat.jsonl): 6 of the 6 whole samples checked train no end-of-turn token "
        "('<|endoftext|>', '<|im_end|>'), so the model never learns to stop: the chat template of the "
        "tokenizer"
    )
    assert "set sft.append_eos = true" in said[0] and "sft.chat_template_path" in said[0]
    assert "\n" not in said[0]


@pytest.mark.parametrize("template", [WITH_MARKERS, NO_MARKERS])
def test_chatml_templates_that_end_turns_with_im_end_say_nothing(caplog, template):
    _, _, said = prepared(template, caplog, assistant_only_loss=True)
    assert said == []


def test_a_template_file_is_named(caplog, tmp_path):
    rows = [{"messages": c["messages"]} for c in CHATS]
    tok = make_tokenizer(NO_MARKERS)
    with caplog.at_level("WARNING", logger="corelooper.sft"):
        prepare(rows, tok, {**DEFAULTS, "max_length": 0, "chat_template_path": "bare.jinja"}, "d", BARE)
    (said,) = [r.getMessage() for r in caplog.records if "end-of-turn" in r.getMessage()]
    assert "the chat template sft.chat_template_path = 'bare.jinja'" in said


@pytest.mark.parametrize("assistant_only_loss", [True, False])
def test_append_eos_appends_a_trained_eos_to_every_sample(caplog, assistant_only_loss):
    plain, tok, _ = prepared(BARE, caplog, assistant_only_loss=assistant_only_loss)
    caplog.clear()
    ended, _, said = prepared(BARE, caplog, assistant_only_loss=assistant_only_loss, append_eos=True)
    assert said == [] and len(ended) == len(plain) == 6
    eos = tok.eos_token_id
    for i in range(len(plain)):
        a, b = plain[i], ended[i]
        assert b["input_ids"] == a["input_ids"] + [eos] and b["labels"] == a["labels"] + [eos]
    assert ended.stats.trained_tokens == plain.stats.trained_tokens + 6
    assert ended.lengths == [n + 1 for n in plain.lengths]


def test_append_eos_leaves_a_sample_that_already_ends_with_it(caplog):
    rows = [{"input_ids": [5, 6, make_tokenizer().eos_token_id]}, {"input_ids": [5, 6, 7]}]
    tok = make_tokenizer()
    out = prepare(rows, tok, {**DEFAULTS, "append_eos": True}, "t")
    assert [out[i]["input_ids"] for i in range(2)] == [[5, 6, tok.eos_token_id], [5, 6, 7, tok.eos_token_id]]
    assert [out[i]["labels"] for i in range(2)] == [[5, 6, tok.eos_token_id], [5, 6, 7, tok.eos_token_id]]
