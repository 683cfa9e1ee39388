"""Host-device syncs per step: torch's CUDA sync-debug warnings counted per log window, not shown.

There is no GPU on this machine, so the CUDA side is simulated: ``enable_sync_debug_mode`` (which
calls ``torch.cuda.set_sync_debug_mode("warn")`` on a CUDA device) is replaced by one that only
says yes, and the model emits, from Python, the warning torch's C++ emits at each synchronizing
operation (a ``UserWarning`` starting "called a synchronizing CUDA operation", raised through
``PyErr_WarnEx``, i.e. subject to the warning filters). Everything else is the real doctor in a
real training loop. benchmarks/gpu/steps.py (``doctor_memory_report``) records the real count on
a GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from corelooper_doctor import syncs
from doctor_fixtures import _only_named_plugins  # noqa: F401  (autouse)
from doctor_toys import Classifier, make_loop, samples

TORCH_WARNING = (
    "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:150.)"
)


def torch_sync_warning() -> None:
    """What torch does at each sync in "warn" mode (simulated: no GPU here)."""
    warnings.warn(TORCH_WARNING, UserWarning, stacklevel=1)


class Syncing(Classifier):
    """Each training forward syncs ``per_forward`` times (as ``.item()`` on a CUDA tensor would);
    it also warns once about something else, which must still reach the user."""

    def __init__(self, per_forward: int):
        super().__init__(torch.nn.ReLU())
        self.per_forward = per_forward

    def forward(self, x):
        if self.training:
            for _ in range(self.per_forward):
                torch_sync_warning()
            warnings.warn("a warning of the model's own", UserWarning, stacklevel=1)
        return super().forward(x)


@pytest.fixture
def simulated_cuda(monkeypatch):
    """The sync debug mode of a CUDA device, on the CPU (no GPU on this machine)."""
    state = {"on": False}
    monkeypatch.setattr(syncs, "enable_sync_debug_mode", lambda device: state.update(on=True) or True)
    monkeypatch.setattr(syncs, "disable_sync_debug_mode", lambda: state.update(on=False))
    return state


def test_counter_counts_every_sync_shows_none_and_passes_other_warnings(recwarn):
    counter = syncs.SyncCounter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a rank != 0 quiets everything (corelooper.builtin.console)
        counter.install()
        for _ in range(5):
            torch_sync_warning()  # one line, five times: no "once per location"
        counter.uninstall()
    assert counter.take() == 5 and counter.total == 5 and counter.take() == 0
    counter.install()
    try:
        torch_sync_warning()
        warnings.warn("something else", UserWarning, stacklevel=1)
    finally:
        counter.uninstall()
    assert counter.total == 6
    assert [str(w.message) for w in recwarn] == ["something else"]


def test_uninstall_restores_the_warning_machinery():
    before_show, before_filters = warnings.showwarning, list(warnings.filters)
    counter = syncs.SyncCounter()
    counter.install()
    assert warnings.showwarning is not before_show
    counter.uninstall()
    assert warnings.showwarning is before_show and warnings.filters == before_filters


def test_host_syncs_per_step_are_logged_per_window(tmp_path, capfd, recwarn, simulated_cuda):
    # 2 micro-batches x 3 syncs per forward = 6 syncs per optimizer step
    loop = make_loop(
        tmp_path,
        Syncing(per_forward=3),
        samples(),
        max_steps=8,
        logging_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    loop.train()
    logs = [h for h in loop.state.log_history if "loss" in h]
    assert [h["doctor/host_syncs_per_step"] for h in logs] == [6.0, 6.0]
    err = capfd.readouterr().err
    assert "synchronizing" not in err  # counted, never printed
    shown = {str(w.message) for w in recwarn}  # (pytest records what would be printed)
    assert shown == {"a warning of the model's own"}  # the user's own warnings still show
    assert "doctor: time split of 4 steps (after the first window)" in err
    assert "6.00 host-device syncs per step" in err  # the end-of-training line
    assert simulated_cuda["on"] is False  # the debug mode is turned off at the end
    assert not any(f[1] is not None and "synchronizing" in f[1].pattern for f in warnings.filters)


@pytest.mark.filterwarnings("ignore::UserWarning")  # the model's warnings: shown, as nothing counts
def test_no_sync_count_on_the_cpu(tmp_path, capfd):
    """No device on the CPU: nothing to count, and no 0 pretending there was."""
    loop = make_loop(tmp_path, Syncing(per_forward=1), samples(), max_steps=4)
    loop.train()
    logs = [h for h in loop.state.log_history if "loss" in h]
    assert logs and not any("doctor/host_syncs_per_step" in h for h in logs)
    assert "host-device syncs" not in capfd.readouterr().err


def test_the_end_line_keeps_the_syncs_after_the_last_log_apart():
    """The H200 run of 2026-12-04: 3 syncs per step in every window, then the end-of-run save's
    148 (one per tensor copied to the host); the end line said 15.33 per step."""
    from corelooper_doctor.actions import sync_summary

    line = sync_summary(in_windows=36, logged_steps=12, after=148)
    assert line == (
        "3.00 host-device syncs per step (and 148 after the last logged step: the end-of-run save "
        "and teardown)"
    )
    assert sync_summary(48, 8, 0) == "6.00 host-device syncs per step"
