"""The elastic plugin's arithmetic: the geometry that keeps a checkpoint's global batch on another
number of processes (corelooper_elastic_resume.geometry). End-to-end resumes: test_elastic_resume_runs.py
and test_elastic_streaming.py here (real torchrun processes, with corelooper-streaming)."""

from __future__ import annotations

import pytest
from corelooper_elastic_resume.geometry import Geometry, plan

from corelooper.errors import ConfigError


@pytest.mark.parametrize(
    ("saved", "world", "per_device", "expected"),
    [
        (Geometry(2, 4, 1), 1, 4, Geometry(1, 4, 2)),  # fewer processes: more accumulation
        (Geometry(1, 4, 2), 2, 4, Geometry(2, 4, 1)),
        (Geometry(1, 4, 1), 2, 4, Geometry(2, 2, 1)),  # no exact accumulation: smaller micro-batch
        (Geometry(2, 6, 1), 4, 6, Geometry(4, 3, 1)),
        (Geometry(1, 5, 3), 3, 5, Geometry(3, 5, 1)),
        (Geometry(2, 3, 2), 4, 8, Geometry(4, 3, 1)),  # never above what fits the 12-sample batch
    ],
)
def test_plan_keeps_the_global_batch(saved, world, per_device, expected):
    got = plan(saved, world, per_device)
    assert got == expected and got.global_batch == saved.global_batch
    assert got.per_device <= per_device


def test_no_exact_split_is_refused_naming_what_works():
    with pytest.raises(
        ConfigError,
        match=r"global batch is 4 per device x 1 accumulation x 2 processes = 8 "
        r"samples, and 8 is not divisible by 3.*\(1, 2, 4, 8\)",
    ):
        plan(Geometry(2, 4, 1), 3, 4)


def test_a_short_last_step_of_the_epoch_is_named():
    import warnings

    from corelooper_elastic_resume.geometry import _warn_if_epoch_end_differs

    with pytest.warns(UserWarning, match=r"\(60 samples\) is not a whole number of global batches of 8"):
        _warn_if_epoch_end_differs(60, Geometry(2, 4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_if_epoch_end_differs(64, Geometry(2, 4, 1))
