"""Preference pairs from real text on the machine (Python's stdlib sources, as the causal-LM example).

Each pair: a prompt (the first part of a source line), ``chosen`` = the line's true continuation,
``rejected`` = the continuation of another line (seeded). A model that learns the code prefers the
true continuation: a real preference signal with no download and no annotator.
"""

from __future__ import annotations

import random

import torch
from corelooper_lm.collators import DataCollatorForCausalLM

from examples.causal_lm.data import PAD_ID, split_files, tokenizer


def pairs(
    split: str,
    packages=("json", "email"),
    vocab_size: int = 1024,
    eval_every: int = 8,
    max_pairs: int = 2000,
    seed: int = 0,
) -> list[dict]:
    packages = tuple(packages)
    train, held = split_files(packages, eval_every)
    lines = [ln.strip() for text in (train if split == "train" else held) for ln in text.splitlines()]
    lines = [ln for ln in lines if 30 <= len(ln) <= 100 and not ln.startswith("#") and " " in ln[10:]]
    rng = random.Random(seed)
    rng.shuffle(lines)
    lines = lines[: max_pairs + 1]
    tok = tokenizer(packages, vocab_size, eval_every)
    out = []
    for i, line in enumerate(lines[:-1]):
        cut = line.index(" ", len(line) // 2 - 5) if " " in line[len(line) // 2 - 5 :] else len(line) // 2
        other = lines[(i + 1 + rng.randrange(len(lines) - 1)) % len(lines)]
        other_cut = len(other) // 2
        prompt, chosen, rejected = line[:cut], line[cut:], other[other_cut:]
        if chosen == rejected:
            continue
        out.append(
            {
                "prompt_ids": tok.encode(prompt).ids,
                "chosen_ids": tok.encode(chosen).ids,
                "rejected_ids": tok.encode(rejected).ids,
            }
        )
    return out


def train_set(**kw) -> list[dict]:
    return pairs("train", **kw)


def eval_set(max_pairs: int = 256, **kw) -> list[dict]:
    return pairs("eval", max_pairs=max_pairs, **{k: v for k, v in kw.items() if k != "max_pairs"})


class DPOCollator:
    """B pairs -> one batch of 2B rows: B chosen then B rejected, prompts masked with -100."""

    def __init__(self, pad_token_id: int = PAD_ID):
        self.pad = DataCollatorForCausalLM(pad_token_id=pad_token_id)

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        rows = [
            {"prompt_ids": s["prompt_ids"], "completion_ids": s[key]}
            for key in ("chosen_ids", "rejected_ids")
            for s in samples
        ]
        return self.pad(rows)


collate = DPOCollator()
