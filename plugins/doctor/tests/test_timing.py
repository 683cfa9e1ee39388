"""Slow steps: the share of each window's wall time per phase, the input-bound warning, MFU peaks."""

from __future__ import annotations

import time

import pytest
import torch
from corelooper_doctor.peaks import known_peak
from corelooper_doctor.timing import PHASES
from doctor_fixtures import _only_named_plugins  # noqa: F401  (autouse)
from doctor_toys import Classifier, SlowSamples, make_loop, samples


def _seconds(loop, samples_per_window: int):
    """Seconds per phase in each logged window (share x the window's wall time)."""
    logs = [h for h in loop.state.log_history if "loss" in h]
    out = []
    for h in logs:
        assert sum(h[f"time_share_{p}"] for p in PHASES) == pytest.approx(1.0, abs=0.03)
        wall = samples_per_window / h["samples_per_second"]
        out.append({p: h[f"time_share_{p}"] * wall for p in PHASES})
    return out


def test_an_input_bound_run_is_called_so(tmp_path, capsys):
    data = samples()
    slow = SlowSamples(data.x, data.y, delay=0.05)  # 8 samples x 50 ms of loading per step
    loop = make_loop(tmp_path, Classifier(torch.nn.ReLU()), slow, max_steps=4)
    loop.train()
    for window in _seconds(loop, 16):
        assert window["data"] >= 0.95 * 2 * 8 * 0.05  # the loading time is counted as data
        assert window["data"] > window["forward"] + window["backward"] + window["optimizer"]
    err = capsys.readouterr().err
    assert err.count("waiting for data (the run is input-bound): raise train.dataloader_num_workers, "
                     "pre-tokenize, or pack sequences") == 1


def test_time_in_plugin_hooks_is_its_own_share(tmp_path, capsys):
    class Slow:
        name = "slow"

        def on_optimizer_step(self):
            time.sleep(0.2)

    loop = make_loop(tmp_path, Classifier(torch.nn.ReLU()), samples(), {"time_hooks": True}, plugins=[Slow()],
                     max_steps=6)
    loop.train()
    for window in _seconds(loop, 16)[1:]:  # the first holds the first AdamW step (imports dynamo)
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

    loop = make_loop(tmp_path, Classifier(torch.nn.ReLU()), samples(), {"time_hooks": True}, plugins=[Broken()])
    with pytest.raises(PluginError, match="Plugin 'broken' raised in hook 'on_step_end' at global_step 2"):
        loop.train()
