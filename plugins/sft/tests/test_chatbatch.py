"""The batched chat path (chatbatch.py) gives exactly transformers' ``apply_chat_template`` ids and
assistant mask, on templates with and without ``{% generation %}``, multi-turn, with system
prompts (given or added by the template), and through ``[sft] max_length`` truncation; rows it
cannot take go to transformers' own path with the same result."""

from __future__ import annotations

import random

import numpy as np
import pytest
from corelooper_sft import DEFAULTS, chatbatch
from corelooper_sft.pipeline import prepare
from corelooper_sft.tokenize import RowTokenizer
from sft_fixtures import CHATS, NO_MARKERS, WITH_MARKERS, _datasets_cache, make_tokenizer  # noqa: F401

# a default system prompt when none is given, bos_token from the special tokens, trimmed content,
# whitespace control inside the markers, the end-of-turn token inside the generation span
SYSTEM_DEFAULT = (
    "{{ bos_token }}{%- if messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' -%}{%- generation -%}{{ m['content'] | trim }}{{ '<|im_end|>' }}"
    "{%- endgeneration -%}{{ '\\n' }}{%- else -%}{{ m['content'] | trim + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
)
# the span starts inside a line: the role header and the reply share characters of one line
INLINE = (
    "{%- for m in messages -%}{{ m['role'] + ':' }}{%- if m['role'] == 'assistant' -%}"
    "{% generation %}{{ ' ' + m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else -%}{{ ' ' + m['content'] + '\\n' }}{%- endif -%}{%- endfor -%}"
)
LONG = (
    [{"role": "system", "content": "Answer in one line."}]
    + [
        {
            "role": "user" if k % 2 == 0 else "assistant",
            "content": f"turn {k}: " + "packing puts samples in one row " * (k % 3 + 1),
        }
        for k in range(9)
    ]
    + [{"role": "assistant", "content": "你好！ 早上好。 def add(a, b): return a + b"}]
)
CONVERSATIONS = [c["messages"] for c in CHATS] + [
    LONG,
    LONG[1:],
    [{"role": "user", "content": " x "}, {"role": "assistant", "content": " "}],
]


def hf(tok, conversations, masked):
    out = tok.apply_chat_template(
        conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=masked
    )
    return out["input_ids"], out["assistant_masks"] if masked else None


@pytest.mark.parametrize("template", [WITH_MARKERS, SYSTEM_DEFAULT, INLINE, NO_MARKERS])
@pytest.mark.parametrize("masked", [True, False])
def test_same_ids_and_mask_as_apply_chat_template(template, masked):
    tok = make_tokenizer(template)
    convs = [chatbatch.plain(c) for c in CONVERSATIONS]
    enc = chatbatch.encode(convs, tok, tok.chat_template, masked)
    ids, masks = [x.tolist() for x in enc.split(enc.ids)], None if enc.mask is None else enc.split(enc.mask)
    want_ids, want_masks = hf(tok, CONVERSATIONS, masked)
    assert ids == want_ids
    if masked:
        assert [m.astype(int).tolist() for m in masks] == want_masks
        if template != NO_MARKERS:  # the comparison is not between two empty masks
            assert all(sum(m) > 0 for m in want_masks)
    else:
        assert masks is None


def _loop(offsets, spans):
    """transformers 5's loop in apply_chat_template, verbatim in substance."""
    mask, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def test_mask_on_arrays_equals_the_loop_on_edge_cases():
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randrange(0, 12)
        starts = sorted(rng.randrange(0, 40) for _ in range(n))
        offsets = [(s, s + rng.choice([0, 0, 1, 2, 5])) for s in starts]  # empty tokens, shared starts
        if rng.random() < 0.2 and n > 1:  # out of order (byte fallback pieces, odd normalizers)
            rng.shuffle(offsets)
        cuts = sorted(rng.randrange(0, 45) for _ in range(2 * rng.randrange(0, 4)))
        spans = list(zip(cuts[::2], cuts[1::2], strict=True))  # empty spans too
        if rng.random() < 0.1 and len(spans) > 1:
            spans.reverse()  # ends out of order: the loop itself is used
        got = chatbatch.assistant_mask(offsets, spans).astype(int).tolist()
        assert got == _loop(offsets, spans), (offsets, spans)


def test_the_batch_mask_equals_the_loop_row_by_row():
    rng = random.Random(1)
    for _ in range(500):
        rows, spans, texts = [], [], []
        for _ in range(rng.randrange(1, 6)):
            size = rng.randrange(0, 30)
            starts = sorted(rng.randrange(0, size + 1) for _ in range(rng.randrange(0, 10)))
            rows.append([(s, min(size, s + rng.choice([0, 1, 3]))) for s in starts])
            cuts = sorted(rng.randrange(0, size + 1) for _ in range(2 * rng.randrange(0, 3)))
            spans.append(list(zip(cuts[::2], cuts[1::2], strict=True)))
            texts.append(size)
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        flat = np.array([x for r in rows for pair in r for x in pair], dtype=np.int64).reshape(-1, 2)
        got = chatbatch.batch_mask(flat, lengths, spans, texts).astype(int).tolist()
        assert got == [x for r, s in zip(rows, spans, strict=True) for x in _loop(r, s)], (rows, spans, texts)


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("template", [WITH_MARKERS, SYSTEM_DEFAULT])
def test_prepared_rows_equal_the_row_path_through_truncation(mode, template):
    tok = make_tokenizer(template)
    data = [{"messages": c} for c in CONVERSATIONS[:-1]] * 2
    cfg = {**DEFAULTS, "assistant_only_loss": True, "max_length": 40, "truncation_mode": mode}
    prepared = prepare(data, tok, cfg, "t", use_cache=False)
    assert prepared.stats.truncated > 0
    row = RowTokenizer(tok, cfg, "t")
    want = []
    for i, r in enumerate(data):
        one = row(dict(r), i)
        cut = slice(-40, None) if mode == "keep_end" else slice(None, 40)
        ids, labels = one["input_ids"][cut], one["labels"][cut]
        if any(x != -100 for x in labels[1:]):
            want.append((ids, labels))
    assert [(prepared[i]["input_ids"], prepared[i]["labels"]) for i in range(len(prepared))] == want


def test_rows_it_cannot_take_go_to_transformers_path():
    tok = make_tokenizer(WITH_MARKERS)
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
        {"role": "assistant", "content": "Paris."},
    ]
    assert chatbatch.plain(parts) is None  # content parts: transformers normalizes them
    assert chatbatch.plain([{"role": "user", "content": "a", "name": None}]) == [
        {"role": "user", "content": "a"}
    ]
    tok.backend_tokenizer.enable_truncation(8)  # what tok(...) would switch off first
    assert chatbatch.encode([chatbatch.plain(CHATS[0]["messages"])], tok, tok.chat_template, True) is None
    tok.backend_tokenizer.no_truncation()
    cfg = {**DEFAULTS, "assistant_only_loss": True, "max_length": 0}
    # a message with a non-string field: the rows' batch goes through apply_chat_template
    weighted = [{**m, "weight": 2} if m["role"] == "assistant" else m for m in CHATS[1]["messages"]]
    data = [CHATS[0], {"messages": weighted, "difficulty_score": 1.0}, CHATS[2]]
    prepared = prepare(data, tok, cfg, "t", use_cache=False)
    row = RowTokenizer(tok, cfg, "t")
    for i, r in enumerate(data):
        want = row(dict(r), i)
        assert prepared[i]["input_ids"] == want["input_ids"] and prepared[i]["labels"] == want["labels"]
    assert np.array_equal(chatbatch.assistant_mask([], [(0, 3)]), np.zeros(0, dtype=bool))
