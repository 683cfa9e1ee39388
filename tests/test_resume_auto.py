"""``resume_from_checkpoint = "auto"`` (fresh start, then resume after a requeue) and the extra
stop signals of ``CORELOOPER_STOP_SIGNALS`` (Slurm's SIGUSR1 warning), in-process with real
signals."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from corelooper.checkpoints.checkpoint import list_checkpoints
from corelooper.errors import ConfigError


class SignalAt:
    name = "signal_at"

    def __init__(self, at_step: int, signum: int):
        self.at_step, self.signum = at_step, signum

    def on_step_end(self, state):
        if state.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


def _weights(loop) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loop.model.state_dict().items()}


def test_auto_starts_fresh_then_resumes_after_a_usr1_stop(run_loop, tmp_path, monkeypatch):
    monkeypatch.setenv("CORELOOPER_STOP_SIGNALS", "SIGUSR1")
    first = run_loop([SignalAt(3, signal.SIGUSR1)], resume="auto", save_strategy="steps", save_steps=100)
    assert first.state.preempted and first.state.global_step == 3
    assert 128 + first.state.stop_signal == 128 + signal.SIGUSR1  # the CLI exits 138: stopped by SIGUSR1
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-3"]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handlers restored after train()

    resumed = run_loop(resume="auto", save_strategy="steps", save_steps=100)
    assert resumed.state.global_step == 8 and not resumed.state.preempted
    whole = run_loop(resume="auto", output_dir=tmp_path / "whole", save_strategy="steps", save_steps=100)
    assert all(
        torch.equal(a, b) for a, b in zip(_weights(resumed).values(), _weights(whole).values(), strict=True)
    )


def test_without_the_variable_only_sigterm_and_sigint_stop(monkeypatch):
    from corelooper.builtin.preemption import stop_signals

    monkeypatch.delenv("CORELOOPER_STOP_SIGNALS", raising=False)
    assert stop_signals() == (signal.SIGTERM, signal.SIGINT)
    monkeypatch.setenv("CORELOOPER_STOP_SIGNALS", "usr2, SIGUSR1")
    assert stop_signals() == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGUSR1)


def test_a_bad_signal_name_is_a_config_error(run_loop, monkeypatch):
    monkeypatch.setenv("CORELOOPER_STOP_SIGNALS", "SIGUSR1,SIGNOPE")
    with pytest.raises(ConfigError, match="'SIGNOPE' is not a signal.*SIGUSR1 or SIGUSR2"):
        run_loop()
