"""Prompts with reference answers from Python's stdlib sources: the first half of a source line
is the prompt, its true second half the answer a completion is rewarded against."""

from __future__ import annotations

import random

from examples.causal_lm.data import split_files, tokenizer


def prompts(
    packages=("json", "email"),
    vocab_size: int = 1024,
    eval_every: int = 8,
    max_prompts: int = 512,
    seed: int = 0,
    **_,
) -> list[dict]:
    packages = tuple(packages)
    train, _ = split_files(packages, eval_every)
    lines = [ln.strip() for text in train for ln in text.splitlines()]
    lines = [ln for ln in lines if 30 <= len(ln) <= 80 and not ln.startswith("#")]
    random.Random(seed).shuffle(lines)
    tok = tokenizer(packages, vocab_size, eval_every)
    out = []
    for line in lines[:max_prompts]:
        cut = len(line) // 2
        out.append({"prompt_ids": tok.encode(line[:cut]).ids, "answer": line[cut:]})
    return out
