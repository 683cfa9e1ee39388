"""Slow steps: the share of each window's wall time per phase, the input-bound warning, MFU peaks."""

from __future__ import annotations

import time

import pytest
import torch
from corelooper_doctor.peaks import known_peak
from corelooper_doctor.timing import PHASES
from corelooper_testing import TensorSamples
from doctor_fixtures import _only_named_plugins  # noqa: F401  (autouse)
from doctor_toys import Classifier, SlowSamples, make_loop, samples


def _seconds(loop, batch: int = 8, hooks: bool = False):
    """Seconds per phase in each logged window (share x the window's wall time, from its steps
    and samples/s), with the window's steps under "steps"."""
    phases = [p for p in PHASES if hooks or p != "hooks"]
    out, prev = [], 0
    for h in (h for h in loop.state.log_history if "loss" in h):
        assert ("doctor/time_share_hooks" in h) == hooks  # no share is logged that is not measured
        assert sum(h[f"doctor/time_share_{p}"] for p in phases) == pytest.approx(1.0, abs=0.03)
        steps, prev = h["step"] - prev, h["step"]
        wall = steps * batch / h["samples_per_second"]
        out.append({"steps": steps, **{p: h[f"doctor/time_share_{p}"] * wall for p in phases}})
    return out


INPUT_BOUND = "waiting for data (the run is input-bound): raise train.dataloader_num_workers"


@pytest.mark.parametrize("logging_steps", [1, 4])
def test_an_input_bound_run_is_called_so(tmp_path, capsys, logging_steps):
    data = samples()
    slow = SlowSamples(data.x, data.y, delay=0.02)  # 8 samples x 20 ms of loading per step
    loop = make_loop(tmp_path, Classifier(torch.nn.ReLU()), slow, max_steps=12, logging_steps=logging_steps)
    loop.train()
    for window in _seconds(loop):
        assert window["data"] >= 0.95 * window["steps"] * 8 * 0.02  # the loading time is counted as data
        assert window["data"] > window["forward"] + window["backward"] + window["optimizer"]
    err = capsys.readouterr().err
    # judged once 8 steps (and 1 s) after the first window are in: with logs every step too
    assert err.count(INPUT_BOUND) == 1
    assert "% of the wall time of the last 8 steps was spent waiting for data" in err


class StallAtSecondEpoch(TensorSamples):
    """The first fetch of the second epoch takes 0.5 s (as a loader re-opening its files or
    starting its workers for a new epoch); every other sample is instant."""

    def __init__(self, x, y):
        super().__init__(x, y)
        self.calls = 0

    def __getitem__(self, i: int) -> dict:
        self.calls += 1
        if self.calls == len(self) + 1:
            time.sleep(0.5)
        return super().__getitem__(i)


def test_a_short_last_window_is_not_called_input_bound(tmp_path, capsys):
    data = samples()  # 64 samples, batch 8: 8 steps per epoch; step 9 opens the second epoch
    loop = make_loop(
        tmp_path,
        Classifier(torch.nn.ReLU()),
        StallAtSecondEpoch(data.x, data.y),
        max_steps=9,
        logging_steps=4,
    )
    loop.train()
    windows = _seconds(loop)
    assert [w["steps"] for w in windows] == [4, 4, 1]
    assert windows[-1]["data"] >= 0.95 * 0.5  # the last window (1 step) did wait: it is logged...
    assert loop.state.log_history[2]["doctor/time_share_data"] > 0.3
    err = capsys.readouterr().err
    assert INPUT_BOUND not in err  # ...but one step's fetch says nothing about the run's input


def test_time_in_plugin_hooks_is_its_own_share(tmp_path, capsys):
    class Slow:
        name = "slow"

        def on_optimizer_step(self):
            time.sleep(0.2)

    loop = make_loop(
        tmp_path, Classifier(torch.nn.ReLU()), samples(), {"time_hooks": True}, plugins=[Slow()], max_steps=6
    )
    loop.train()
    for window in _seconds(loop, hooks=True)[1:]:  # the first holds the first AdamW step (imports dynamo)
        assert window["hooks"] >= 0.95 * 2 * 0.2  # two steps' sleeps, carved out of the optimizer
        assert window["optimizer"] < window["hooks"]
    assert "input-bound" not in capsys.readouterr().err


def test_known_gpu_peaks():
    assert known_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert known_peak("NVIDIA H100 PCIe") == 756e12
    assert known_peak("NVIDIA H200") == 989e12
    assert known_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert known_peak("NVIDIA L40S") == 362e12
    assert known_peak("NVIDIA L4") == 121e12
    assert known_peak("NVIDIA A10G") == 70e12
    assert known_peak("Some Future Accelerator") is None


def test_a_plugin_that_raises_is_still_named_with_the_doctor_timing_hooks(tmp_path):
    from corelooper.errors import PluginError

    class Broken:
        name = "broken"

        def on_step_end(self, state):
            if state.global_step == 2:
                raise ValueError("boom")

    loop = make_loop(
        tmp_path, Classifier(torch.nn.ReLU()), samples(), {"time_hooks": True}, plugins=[Broken()]
    )
    with pytest.raises(PluginError, match="Plugin 'broken' raised in hook 'on_step_end' at global_step 2"):
        loop.train()
