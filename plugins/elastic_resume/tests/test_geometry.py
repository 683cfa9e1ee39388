"""The elastic plugin's arithmetic: the geometry that keeps a checkpoint's global batch on another
number of processes (corelooper_elastic_resume.geometry). End-to-end resumes: test_elastic_resume_runs.py
and test_elastic_streaming.py here (real torchrun processes, with corelooper-streaming)."""

from __future__ import annotations

from types import SimpleNamespace

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

    args = SimpleNamespace(dataloader_drop_last=False, max_steps=0, num_train_epochs=2)
    with pytest.warns(UserWarning) as got:
        _warn_if_epoch_end_differs(60, Geometry(2, 4, 1), Geometry(1, 4, 2), args)
    (message,) = [str(w.message) for w in got]
    assert "Resuming on 1 processes (saved on 2)" in message
    assert "(60 samples) is not a whole number of global batches of 8" in message
    assert (
        "an epoch has 8 micro-batches of 8 samples (the last one of 4, padded) on 2 processes, "
        "15 micro-batches of 4 samples on 1." in message
    )
    assert "The plan is unchanged (8 steps per epoch)" in message and "last, short step" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_if_epoch_end_differs(64, Geometry(2, 4, 1), Geometry(1, 4, 2), args)


def test_a_change_of_plan_names_the_steps_before_and_after_and_why():
    """3 -> 2 processes, drop_last: 100 samples make 16 micro-batches of 6 (8 steps of 2) on 3
    processes and 25 of 4 (9 steps of 3) on 2: the 7-epoch plan goes from 56 to 63 steps."""
    from corelooper_elastic_resume.geometry import _warn_if_epoch_end_differs, steps_per_epoch

    saved, new = Geometry(3, 2, 2), Geometry(2, 2, 3)
    assert saved.global_batch == new.global_batch == 12
    assert (steps_per_epoch(100, saved, True), steps_per_epoch(100, new, True)) == (8, 9)
    args = SimpleNamespace(dataloader_drop_last=True, max_steps=0, num_train_epochs=7)
    with pytest.warns(UserWarning) as got:
        _warn_if_epoch_end_differs(100, saved, new, args)
    (message,) = [str(w.message) for w in got]
    assert message.startswith(
        "Resuming on 2 processes changes the plan: 56 -> 63 steps, 8 -> 9 steps per epoch."
    )
    assert "The global batch is kept (12 samples per step)" in message
    assert (
        "an epoch has 16 micro-batches of 6 samples (the short one dropped) on 3 processes, "
        "25 micro-batches of 4 samples on 2:" in message
    )
    assert "resume on 3 processes or set train.max_steps = 56." in message
