"""Packing never leaks attention: the oracle is the real transformers Llama run on each sample alone."""

from __future__ import annotations

import random

import pytest
import torch
from corelooper_lm.packing import (
    Segment,
    SegmentCollator,
    best_fit_decreasing,
    block_causal_mask,
    plan_packing,
)

from corelooper.data.loader import count_loss_items
from corelooper.errors import DataError

transformers = pytest.importorskip("transformers")


def tiny_llama(attn: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(config).eval()


def samples(n=7, seed=0, lo=2, hi=20):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 96) for _ in range(rng.randint(lo, hi))]
        prompt = rng.randint(0, len(ids) - 1)
        out.append(Segment(ids, [-100] * prompt + ids[prompt:], {"difficulty_score": rng.random()}))
    return out


def alone_logits(model, seg):
    with torch.no_grad():
        return model(input_ids=torch.tensor([seg.input_ids])).logits[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_packed_logits_equal_each_sample_alone(attn, use_cache):
    model = tiny_llama(attn)
    segs = samples()
    plan = plan_packing([len(s.input_ids) for s in segs], 32, "bfd")
    assert len(plan) < len(segs) and any(len(row) > 1 for row in plan)  # really packed
    rows = [[segs[i] for i, _, _ in row] for row in plan]
    batch = SegmentCollator(pad_token_id=0, attn_implementation=attn)(rows)
    longest = max(sum(len(s.input_ids) for s in row) for row in rows)
    assert batch["attention_mask"].shape == (len(rows), 1, longest, longest)
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=use_cache,
        ).logits
    worst = 0.0
    for r, row in enumerate(rows):
        pos = 0
        for seg in row:
            k = len(seg.input_ids)
            worst = max(worst, (out[r, pos : pos + k] - alone_logits(model, seg)).abs().max().item())
            pos += k
    assert worst <= 1e-5, worst


def test_without_the_mask_samples_leak_so_the_test_can_fail():
    model = tiny_llama("sdpa")
    segs = samples(2, seed=3, lo=8, hi=12)
    batch = SegmentCollator(pad_token_id=0)([segs])
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    k = len(segs[0].input_ids)
    second = out[0, k : k + len(segs[1].input_ids)]
    assert (second - alone_logits(model, segs[1])).abs().max().item() > 1e-2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_batch_one_row_equals_padded_loss(attn):
    model = tiny_llama(attn)
    segs = samples(6, seed=4)
    free = SegmentCollator(pad_token_id=0, attn_implementation=attn)([segs])  # padding-free: one row
    longest = max(len(s.input_ids) for s in segs)
    padded = {
        "input_ids": torch.zeros((6, longest), dtype=torch.long),
        "labels": torch.full((6, longest), -100),
        "attention_mask": torch.zeros((6, longest), dtype=torch.long),
    }
    for r, s in enumerate(segs):
        k = len(s.input_ids)
        padded["input_ids"][r, :k] = torch.tensor(s.input_ids)
        padded["labels"][r, :k] = torch.tensor(s.labels)
        padded["attention_mask"][r, :k] = 1
    n_free, n_pad = count_loss_items(free, "causal_lm"), count_loss_items(padded, "causal_lm")
    assert int(n_free) == int(n_pad) > 0  # num_items_in_batch counts the same tokens
    with torch.no_grad():
        loss_free = model(**free, num_items_in_batch=n_free).loss
        loss_pad = model(**padded, num_items_in_batch=n_pad).loss
    assert abs(loss_free.item() - loss_pad.item()) <= 1e-5


def test_extras_come_per_token_and_boundaries_are_masked():
    segs = [Segment([5, 6, 7], [5, 6, 7], {"w": 2.0}), Segment([8, 9], [8, 9], {"w": 0.5})]
    batch = SegmentCollator(pad_token_id=0, pad_to_multiple_of=8)([segs])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["w"].tolist() == [[2.0, 2.0, 2.0, 0.5, 0.5, 0.0, 0.0, 0.0]]
    mask = batch["attention_mask"][0, 0]
    assert mask.dtype == torch.bool  # sdpa's kernel takes a boolean mask (True: attend)
    blocked = ~mask
    assert not blocked[3, 3] and blocked[3, 2] and blocked[4, 0] and not blocked[4, 3]
    assert not blocked[6, 5] and blocked[5, 4]  # padding is its own causal segment: no empty row


def test_flash_batches_are_one_row_with_cu_seq_lens():
    segs = [Segment([5, 6, 7], [5, 6, 7], {}), Segment([8, 9], [8, 9], {})]
    batch = SegmentCollator(pad_token_id=0, attn_implementation="flash_attention_2")([[segs[0]], [segs[1]]])
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5] and batch["max_length_q"] == 3


# -- plans -------------------------------------------------------------------------------------------


def naive_bfd(lengths, capacity):
    """The quadratic reference: scan every bin for the fullest one that fits."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins, room = [], []
    for i in order:
        best = (
            min((r, b) for b, r in enumerate(room) if r >= lengths[i])
            if any(r >= lengths[i] for r in room)
            else None
        )
        if best is None:
            bins.append([i])
            room.append(capacity - lengths[i])
        else:
            bins[best[1]].append(i)
            room[best[1]] -= lengths[i]
    return sorted(sorted(capacity - r for r in room))


@pytest.mark.parametrize("seed", range(5))
def test_bfd_fills_bins_as_the_quadratic_reference(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(400)]
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(400))  # each sample exactly once
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    fills = sorted(sum(lengths[i] for i in b) for b in bins)
    assert fills == naive_bfd(lengths, 64)  # same bin fill profile as best-fit decreasing
    assert bins == best_fit_decreasing(lengths, 64)  # deterministic


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_plans_cover_every_token_once(strategy):
    lengths = [5, 70, 12, 33, 1, 64, 40]
    plan = plan_packing(lengths, 32, strategy)
    assert all(sum(e - s for _, s, e in row) <= 32 for row in plan)
    covered = sorted((i, t) for row in plan for i, s, e in row for t in range(s, e))
    if strategy == "bfd":  # over-long samples keep their first 32 tokens
        expected = sorted((i, t) for i, n in enumerate(lengths) for t in range(min(n, 32)))
    else:
        expected = sorted((i, t) for i, n in enumerate(lengths) for t in range(n))
    assert covered == expected
    if strategy == "wrapped":
        flat = [(i, s) for row in plan for i, s, _ in row]
        assert flat == sorted(flat)  # data set order kept
        assert all(sum(e - s for _, s, e in row) == 32 for row in plan[:-1])  # rows full


def test_bad_plans_explain():
    with pytest.raises(DataError, match="bfd, bfd_split, wrapped"):
        plan_packing([3], 8, "first_fit")
    with pytest.raises(DataError, match="> 0"):
        plan_packing([3], 0)


def test_block_mask_dtype_follows_the_model():
    mask = block_causal_mask([[2, 1]], 3, torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask[0, 0, 2, 1] == torch.finfo(torch.bfloat16).min


def test_packed_dataset_bfd_items_do_not_leak_through_default_collate():
    from corelooper_lm.collators import PackedDataset
    from torch.utils.data import default_collate

    model = tiny_llama("eager")
    docs = [s.input_ids for s in samples(6, seed=5)]
    ds = PackedDataset(docs, seq_len=40, pad_token_id=0, strategy="bfd")
    batch = default_collate([ds[i] for i in range(len(ds))])
    assert batch["attention_mask"].shape == (len(ds), 1, 40, 40)
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    worst = 0.0
    for r, lens in enumerate(ds.seq_lengths):
        pos = 0
        for k in lens:
            ids = batch["input_ids"][r, pos : pos + k].tolist()
            alone = alone_logits(model, Segment(ids, ids, {}))
            worst = max(worst, (out[r, pos : pos + k] - alone).abs().max().item())
            pos += k
    assert worst <= 1e-5, worst


def test_flash_kwargs_reach_a_transformers_forward():
    from corelooper.data.columns import accepted_columns, forward_signature

    sig = forward_signature(tiny_llama("sdpa"))
    keys = [
        "input_ids",
        "labels",
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "difficulty_score",
    ]
    assert accepted_columns(sig, keys) == tuple(k for k in keys if k != "difficulty_score")


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_a_packed_batch_counts_its_samples_not_its_rows(attn):
    from corelooper.data.loader import batch_rows

    segs = samples(n=9, lo=3)
    plan = plan_packing([len(s.input_ids) for s in segs], 32, "bfd")
    rows = [[segs[i] for i, _, _ in row] for row in plan]
    assert len(rows) < 9
    assert batch_rows(SegmentCollator(pad_token_id=0, attn_implementation=attn)(rows)) == 9


def test_padded_rows_with_position_ids_are_one_sample_each():
    from corelooper_lm.collators import DataCollatorForCausalLM

    from corelooper.data.loader import batch_rows

    rows = [{"input_ids": [5, 6, 7, 8, 9]}, {"input_ids": [5, 6]}, {"input_ids": [7]}]
    for side in ("left", "right"):
        batch = DataCollatorForCausalLM(pad_token_id=0, padding_side=side, return_position_ids=True)(rows)
        assert (batch["position_ids"] == 0).sum() > 3 or side == "right"  # left padding repeats 0
        assert batch_rows(batch) == 3


def test_train_samples_per_second_counts_packed_samples(tmp_path):
    """9 samples packed into fewer rows, 2 epochs: the run saw 18 samples, not 2 x rows."""
    from corelooper import Loop

    segs = samples(n=9, lo=3)
    plan = plan_packing([len(s.input_ids) for s in segs], 32, "bfd")
    rows = [[segs[i] for i, _, _ in row] for row in plan]
    model = tiny_llama("sdpa").train()
    loop = Loop(
        model,
        {
            "train": {
                "output_dir": str(tmp_path),
                "save_strategy": "no",
                "num_train_epochs": 2,
                "per_device_train_batch_size": len(rows),
                "disable_tqdm": True,
                "remove_unused_columns": False,
            }
        },
        train_dataset=rows,
        data_collator=SegmentCollator(pad_token_id=0, attn_implementation="sdpa"),
    )
    state = loop.train()
    assert state.total_samples_seen == 18
    summary = state.log_history[-1]
    assert summary["train_samples_per_second"] == pytest.approx(18 / summary["train_runtime"], rel=0.05)
