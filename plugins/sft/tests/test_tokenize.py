"""Tokenization and masks: the oracle is TRL's SFTTrainer data pipeline on the same rows."""

from __future__ import annotations

import copy

import pytest
from corelooper_sft import DEFAULTS
from corelooper_sft.pipeline import prepare
from corelooper_sft.tokenize import RowTokenizer
from sft_fixtures import CHATS, NO_MARKERS, WITH_MARKERS, _datasets_cache, make_tokenizer, model_dir  # noqa: F401 (fixtures)

from corelooper.errors import DataError

PROMPT_COMPLETION = [
    {"prompt": "What is 2 + 2?", "completion": " 4."},
    {"prompt": "Translate: good morning", "completion": " 早上好。"},
]
CONV_PROMPT_COMPLETION = [
    {
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "completion": [{"role": "assistant", "content": "4."}],
    },
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}],
        "completion": [{"role": "assistant", "content": "你好！"}],
    },
]
TEXT = [{"text": "Packing puts short samples into one row."}, {"text": "你好，世界"}]


def cfg(**kw):
    return {**DEFAULTS, **kw}


def trl_rows(rows, model_dir, tmp_path, **sft):
    """What TRL's SFTTrainer trains on: its prepared train_dataset's input_ids and labels."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        bf16=False,
        max_length=None,
        gradient_checkpointing=False,
        dataset_num_proc=None,
        **sft,
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=Dataset.from_list(copy.deepcopy(rows)),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    ds = trainer.train_dataset
    return [(list(r["input_ids"]), list(r["labels"])) for r in ds]


def ours(rows, model_dir, **kw):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = prepare([dict(r) for r in rows], tok, cfg(max_length=0, **kw), "test")
    return [(list(r["input_ids"]), list(r["labels"])) for r in (out[i] for i in range(len(out)))]


@pytest.mark.parametrize(
    ("rows", "kw"),
    [
        (CHATS, {}),
        (CHATS, {"assistant_only_loss": True}),
        (PROMPT_COMPLETION, {}),
        (PROMPT_COMPLETION, {"completion_only_loss": False}),
        (CONV_PROMPT_COMPLETION, {}),
        (CONV_PROMPT_COMPLETION, {"assistant_only_loss": True}),
        (TEXT, {}),
    ],
    ids=[
        "chat",
        "chat-assistant-only",
        "prompt-completion",
        "pc-full-loss",
        "conv-pc",
        "conv-pc-assistant",
        "text",
    ],
)
def test_same_tokens_and_labels_as_trl(rows, kw, model_dir, tmp_path):
    mine = ours(rows, model_dir, **kw)
    theirs = trl_rows(
        [{k: v for k, v in r.items() if k != "difficulty_score"} for r in rows], model_dir, tmp_path, **kw
    )
    assert mine == theirs
    assert any(x == -100 for _, labels in mine for x in labels) == bool(
        kw.get("assistant_only_loss") or ("prompt" in rows[0] and kw.get("completion_only_loss") is not False)
    )


def test_prefix_rendering_gives_the_generation_marker_masks():
    marked = RowTokenizer(make_tokenizer(WITH_MARKERS), cfg(assistant_only_loss=True), "t")
    plain = RowTokenizer(make_tokenizer(NO_MARKERS), cfg(assistant_only_loss=True), "t")
    assert marked.markers and not plain.markers
    for i, row in enumerate(CHATS):
        a, b = marked(dict(row), i), plain(dict(row), i)
        assert a["input_ids"] == b["input_ids"]
        assert a["labels"] == b["labels"]  # exactly the assistant tokens, found without markers
        assert sum(x != -100 for x in a["labels"]) > 0


def test_prefix_masks_train_assistant_text_only():
    tok = make_tokenizer(NO_MARKERS)
    out = RowTokenizer(tok, cfg(assistant_only_loss=True), "t")(dict(CHATS[1]), 1)
    trained = tok.decode([t for t, lab in zip(out["input_ids"], out["labels"], strict=True) if lab != -100])
    assert trained == "你好！<|im_end|>Short samples share one row.<|im_end|>"
    assert out["difficulty_score"] == 2.5  # extra numeric columns travel with the row


def test_all_zero_mask_names_the_sample():
    rows = [dict(CHATS[0]), {"messages": [{"role": "user", "content": "no answer here"}]}]
    with pytest.raises(DataError, match=r"data\.train, sample 1: no token is trained"):
        prepare(rows, make_tokenizer(), cfg(assistant_only_loss=True), "data.train")


def test_unknown_format_lists_the_columns_found():
    with pytest.raises(DataError, match=r"columns found \(answer, question\)"):
        prepare([{"question": "q", "answer": "a"}], make_tokenizer(), cfg(), "data.train")


def test_already_tokenized_rows_keep_their_labels():
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}]
    out = prepare(rows, make_tokenizer(), cfg(), "t")
    assert out[0]["input_ids"] == [5, 6, 7, 8] and out[0]["labels"] == [-100, -100, 7, 8]


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_overlong_samples_are_truncated_or_dropped_counted_and_reported_once(policy, caplog):
    rows = [{"text": "short"}, {"text": "a much longer text that goes past the limit " * 3}] * 3
    with caplog.at_level("WARNING", logger="corelooper.sft"):
        out = prepare(rows, make_tokenizer(), cfg(max_length=12, overlong=policy), "data.train")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "3 of 6 samples are longer than max_length=12" in lines[0]
    assert (out.stats.truncated, out.stats.dropped) == ((3, 0) if policy == "truncate" else (0, 3))
    assert len(out) == (6 if policy == "truncate" else 3)
    assert max(len(out[i]["input_ids"]) for i in range(len(out))) <= 12


def test_empty_data_set_is_an_error():
    with pytest.raises(DataError, match="empty"):
        prepare([], make_tokenizer(), cfg(), "data.train")


def test_tools_column_reaches_the_chat_template():
    template = (
        "{%- if tools %}{{ 'TOOLS:' + (tools | map(attribute='name') | join(',')) + '\\n' }}{% endif -%}"
        + NO_MARKERS
    )
    tok = make_tokenizer(template)
    row = {**CHATS[0], "tools": [{"name": "search"}, {"name": "calc"}]}
    out = RowTokenizer(tok, cfg(assistant_only_loss=True), "t")(row, 0)
    assert tok.decode(out["input_ids"]).startswith("TOOLS:search,calc\n<|im_start|>user")
    trained = tok.decode([t for t, lab in zip(out["input_ids"], out["labels"], strict=True) if lab != -100])
    assert trained == "Paris.<|im_end|>"
