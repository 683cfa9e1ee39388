"""Language-model data utilities: padding collator, packing, length grouping, column filtering."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from corelooper_lm.collators import (
    DataCollatorForCausalLM,
    PackedDataset,
    pack_sequences,
)

from corelooper.data.columns import accepted_columns
from corelooper.data.loader import BatchLoader, length_grouped_order, sample_lengths
from corelooper.errors import DataError


def _docs(n=40, seed=0, lo=1, hi=50):
    rng = random.Random(seed)
    return [[rng.randrange(2, 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# -- padding collator ------------------------------------------------------------------------------


def test_collator_pads_right_and_masks_padding_not_eos():
    pad = 0  # pad id equal to a real token id (EOS): masking must follow the attention mask
    batch = DataCollatorForCausalLM(pad_token_id=pad)([{"input_ids": [5, 6, 0]}, {"input_ids": [7]}])
    assert batch["input_ids"].tolist() == [[5, 6, 0], [7, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 0], [7, -100, -100]]


def test_collator_left_padding_multiple_of_and_position_ids():
    c = DataCollatorForCausalLM(
        pad_token_id=9, padding_side="left", pad_to_multiple_of=4, return_position_ids=True
    )
    batch = c([{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": torch.tensor([6, 7])}])
    assert batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][1].tolist() == [9] * 6 + [6, 7]
    assert batch["labels"][1].tolist() == [-100] * 6 + [6, 7]
    assert batch["position_ids"][1].tolist()[-2:] == [0, 1]
    assert batch["position_ids"][0].tolist()[-5:] == [0, 1, 2, 3, 4]


def test_collator_masks_prompt_of_prompt_completion_samples():
    c = DataCollatorForCausalLM(pad_token_id=0)
    batch = c(
        [
            {"prompt_ids": [11, 12, 13], "completion_ids": [21, 22], "weight": 0.5},
            {"input_ids": [31, 32, 33, 34], "prompt_length": 1, "weight": 2.0},
        ]
    )
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22], [31, 32, 33, 34, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 21, 22], [-100, 32, 33, 34, -100]]
    assert batch["weight"].tolist() == [0.5, 2.0]
    assert "prompt_length" not in batch
    unmasked = DataCollatorForCausalLM(pad_token_id=0, mask_prompt=False)(
        [{"prompt_ids": [11], "completion_ids": [21]}]
    )
    assert unmasked["labels"].tolist() == [[11, 21]]


def test_collator_truncates_and_explains_bad_samples():
    c = DataCollatorForCausalLM(pad_token_id=0, max_length=2)
    assert c([{"input_ids": [1, 2, 3]}])["input_ids"].tolist() == [[1, 2]]
    with pytest.raises(DataError, match="needs 'input_ids'"):
        c([{"text": "hello"}])
    with pytest.raises(DataError, match="list or 1-D tensor"):
        c([{"input_ids": "hello"}])


# -- packing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["bfd", "wrap"])
def test_packing_loses_and_duplicates_no_token(strategy):
    docs = _docs(60, seed=1, hi=90)  # some longer than seq_len: they are split
    ds = PackedDataset(docs, seq_len=64, pad_token_id=0, strategy=strategy, eos_token_id=1)
    assert ds.input_ids.shape[1] == 64
    kept = [t for row, m in zip(ds.input_ids, ds.attention_mask, strict=True) for t in row[m.bool()].tolist()]
    expected = [t for d in docs for t in d + [1]]
    assert sorted(kept) == sorted(expected)  # the same multiset of tokens: none lost or duplicated
    if strategy == "wrap":
        assert kept == expected  # and in order
    assert (ds.input_ids[~ds.attention_mask.bool()] == 0).all()
    assert (ds.labels[~ds.attention_mask.bool()] == -100).all()


def test_bfd_keeps_samples_whole_and_fills_bins():
    docs = _docs(80, seed=2, hi=40)
    bins = pack_sequences(docs, seq_len=64, strategy="bfd")
    assert all(sum(map(len, b)) <= 64 for b in bins)
    pieces = sorted(tuple(p) for b in bins for p in b)
    assert pieces == sorted(tuple(d) for d in docs)  # no sample split (all shorter than 64)
    total = sum(map(len, docs))
    assert len(bins) <= -(-total // 64) + 2  # near the lower bound: bins are full
    assert bins == pack_sequences(docs, seq_len=64, strategy="bfd")  # deterministic


def test_bfd_resets_positions_and_masks_sample_boundaries():
    ds = PackedDataset([[5, 6, 7], [8, 9]], seq_len=8, pad_token_id=0, strategy="bfd")
    assert len(ds) == 1
    item = ds[0]
    assert item["input_ids"].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert item["position_ids"].tolist()[:5] == [0, 1, 2, 0, 1]
    assert item["labels"].tolist() == [5, 6, 7, -100, 9, -100, -100, -100]
    assert ds.lengths == [5]


# -- length grouping ----------------------------------------------------------------------------------


def test_length_grouped_order_is_a_seeded_permutation_grouping_lengths():
    lengths = [len(d) for d in _docs(1000, seed=3, hi=200)]
    order = length_grouped_order(lengths, batch_size=8, seed=7, epoch=0)
    assert sorted(order) == list(range(1000))
    assert order == length_grouped_order(lengths, batch_size=8, seed=7, epoch=0)
    assert order != length_grouped_order(lengths, batch_size=8, seed=7, epoch=1)
    assert lengths[order[0]] == max(lengths)  # the longest batch first: an OOM shows at once

    def spread(o):
        return sum(
            max(lengths[i] for i in o[k : k + 8]) - min(lengths[i] for i in o[k : k + 8])
            for k in range(0, 1000, 8)
        )

    random_order = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()
    assert spread(order) < spread(random_order) / 5  # padding within batches shrinks a lot


def test_group_by_length_loader_shards_ranks_and_resumes_exactly():
    docs = _docs(203, seed=4, hi=60)
    data = [{"input_ids": d} for d in docs]
    lengths = sample_lengths(data)
    assert lengths == [len(d) for d in docs]
    collate = DataCollatorForCausalLM(pad_token_id=0)

    def loader(rank=0, replicas=1):
        return BatchLoader(
            data, 4, collate_fn=collate, seed=3, num_replicas=replicas, rank=rank, lengths=lengths
        )

    full = loader()
    full.set_epoch(2)
    batches = list(full)
    assert len(batches) == len(full) == 51
    resumed = loader()
    resumed.set_epoch(2)
    resumed.skip(17)
    rest = list(resumed)
    assert len(rest) == 51 - 17
    for a, b in zip(batches[17:], rest, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
    # Two ranks split each global batch of 8: together they see exactly the one-process samples.
    r0, r1 = loader(0, 2), loader(1, 2)
    seen = [i for a, b in zip(r0.batch_indices(), r1.batch_indices(), strict=True) for i in a + b]
    assert sorted(set(seen)) == list(range(203))
    # Padding is lower than with random batches.
    pad = lambda bs: sum((b["attention_mask"] == 0).sum().item() for b in bs)  # noqa: E731
    plain = BatchLoader(data, 4, collate_fn=collate, seed=3)
    assert pad(batches) < pad(list(plain)) / 3


def test_sample_lengths_prefers_dataset_lengths_and_explains_missing():
    class WithLengths(list):
        lengths = [3, 1]

    assert sample_lengths(WithLengths([{}, {}])) == [3, 1]
    assert sample_lengths([{"length": 9, "x": 1}]) == [9]
    with pytest.raises(DataError, match="group_by_length"):
        sample_lengths([{"x": 1}])


# -- unused columns ---------------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 8)
        self.head = torch.nn.Linear(8, 100)

    def forward(self, input_ids, attention_mask=None):
        return self.head(self.emb(input_ids))


def test_unused_columns_are_dropped_with_one_log_line(caplog, tmp_path):
    from corelooper import Loop

    data = [
        {
            "input_ids": torch.randint(0, 50, (6,)),
            "labels": torch.randint(0, 50, (6,)),
            "difficulty_score": torch.tensor(1.0),
            "source_id": torch.tensor(i),
        }
        for i in range(16)
    ]
    loop = Loop(
        TinyLM(),
        {
            "train": {
                "max_steps": 3,
                "output_dir": str(tmp_path),
                "save_strategy": "no",
                "logging_steps": 1,
                "learning_rate": 1e-2,
            }
        },
        train_dataset=data,
    )
    with caplog.at_level(logging.WARNING, logger="corelooper.data.loader"):
        loop.train()
    lines = [r.getMessage() for r in caplog.records if "remove_unused_columns" in r.getMessage()]
    assert len(lines) == 1, lines  # decided once, not per step
    assert "difficulty_score" in lines[0] and "source_id" in lines[0] and "TinyLM" in lines[0]
    assert loop.state.global_step == 3

    sig = loop.forward_signature
    assert accepted_columns(sig, ["input_ids", "labels"]) is None
    assert accepted_columns(sig, ["input_ids", "labels", "x"]) == ("input_ids", "labels")


def test_remove_unused_columns_false_passes_everything(tmp_path):
    from corelooper import Loop
    from corelooper.errors import TrainingError

    data = [
        {
            "input_ids": torch.randint(0, 50, (6,)),
            "labels": torch.randint(0, 50, (6,)),
            "source_id": torch.tensor(i),
        }
        for i in range(8)
    ]
    loop = Loop(
        TinyLM(),
        {
            "train": {
                "max_steps": 1,
                "output_dir": str(tmp_path),
                "save_strategy": "no",
                "remove_unused_columns": False,
            }
        },
        train_dataset=data,
    )
    with pytest.raises(TrainingError, match="source_id"):
        loop.train()


def test_train_group_by_length_reaches_the_loop_batches(tmp_path):
    from corelooper import Loop

    docs = _docs(96, seed=5, lo=2, hi=64)
    data = [{"input_ids": d} for d in docs]
    from corelooper.step import default_training_step

    class Seen:  # the step's batches, as the loop fetched them
        name = "seen"

        def __init__(self):
            self.batches = []

        def training_step(self, loop, micro_batches):
            self.batches.append(micro_batches[0])
            return default_training_step(loop, micro_batches)

    padding = {}
    for flag in (False, True):
        recorder = Seen()
        seen = recorder.batches
        loop = Loop(
            TinyLM(),
            {
                "train": {
                    "output_dir": str(tmp_path / str(flag)),
                    "max_steps": 12,
                    "save_strategy": "no",
                    "per_device_train_batch_size": 8,
                    "group_by_length": flag,
                }
            },
            train_dataset=data,
            data_collator=DataCollatorForCausalLM(pad_token_id=0),
            plugins=[recorder],
        )
        loop.train()
        assert loop.state.global_step == 12
        padding[flag] = sum(int((b["attention_mask"] == 0).sum()) for b in seen)
    # far less padding with length-grouped batches (HF's mega-batches: here 96 // (4 * 8) = 3 batches each)
    assert padding[True] < padding[False] / 2
