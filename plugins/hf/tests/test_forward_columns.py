"""The drop-in's column filter against HF's own ``RemoveColumnsCollator`` (the oracle): the same
samples reach the collator, and a collator that pops keys leaves the dataset's samples whole."""

from __future__ import annotations

from collections import OrderedDict

import pytest

pytest.importorskip("transformers")
from corelooper_hf.trainer.trainer import ForwardColumns  # noqa: E402
from transformers.trainer_utils import RemoveColumnsCollator  # noqa: E402

COLUMNS = ["input_ids", "labels"]


def popping_collator(features: list) -> list:
    """A collator that takes ``labels`` out of each sample it is given (as some of HF's do)."""
    return [(f.pop("labels", None), f) if isinstance(f, dict) else f for f in features]


def samples() -> list:
    return [
        {"input_ids": [1, 2], "labels": [2, 3]},  # only forward's columns
        {"labels": [5], "difficulty": 0.5, "input_ids": [4]},  # an extra column, keys in any order
        OrderedDict(input_ids=[6], labels=[7]),  # a dict subclass
        {"input_ids": [8]},  # a subset of the columns
        ([9], [10]),  # not a dict: passed as it is
        {},
    ]


def test_the_collator_gets_what_hf_s_filter_gives_and_the_dataset_stays_whole():
    ours, theirs = samples(), samples()
    got = ForwardColumns(popping_collator, COLUMNS)(ours)
    expected = RemoveColumnsCollator(popping_collator, COLUMNS)(theirs)
    assert got == expected
    assert [type(f) for f in got] == [type(f) for f in expected]
    assert [list(f[1]) if isinstance(f, tuple) and isinstance(f[1], dict) else None for f in got] == [
        list(f[1]) if isinstance(f, tuple) and isinstance(f[1], dict) else None for f in expected
    ]  # the same keys in the same order
    assert ours == samples() == theirs  # neither filter lets the collator change the samples
