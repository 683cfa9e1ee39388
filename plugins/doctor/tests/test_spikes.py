"""Loss spikes: detected from the logged loss (no extra sync), or per step with skip_batch."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from corelooper_doctor.spikes import SpikeDetector
from doctor_fixtures import _only_named_plugins  # noqa: F401  (autouse)
from doctor_toys import doctor_of, make_loop, spike_samples
from torch.overrides import TorchFunctionMode

from corelooper.data.loader import epoch_permutation

N, STEPS = 128, 16
SPIKE_STEP = 11
# the sample the loader puts in step 11 (seed 0, epoch 0, batch 8): its target is far off
OUTLIER = epoch_permutation(N, 0, 0, True)[8 * (SPIKE_STEP - 1)]


def _data():
    return spike_samples(n=N, spike_index=OUTLIER)


def _linear():
    torch.manual_seed(0)
    return _Reg()


class _Reg(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x)


def test_rolling_median_detector():
    d = SpikeDetector(factor=3.0, window=5)
    assert [d.check(v) for v in (1.0, 1.1, 0.9, 1.0, 1.05)] == [None] * 5  # warming up
    assert d.check(3.5) == 1.0  # 3.5 > 3 x median(1, 1.1, 0.9, 1, 1.05)
    assert d.check(2.9) is None  # below the bar; and the spike did not enter the history
    assert 3.5 not in d.history and len(d.history) == 5


def test_spike_logged_with_its_step_and_samples(tmp_path):
    train = _data()
    loop = make_loop(tmp_path, _linear(), train, logging_steps=1, max_steps=STEPS, learning_rate=0.01)
    loop.train()
    logs = [h for h in loop.state.log_history if "loss" in h]
    worst = max(logs, key=lambda h: h["loss"])
    spikes = [
        json.loads(line) for line in (tmp_path / "run" / "doctor" / "spikes.jsonl").read_text().splitlines()
    ]
    assert [s["step"] for s in spikes] == [worst["step"]] == [SPIKE_STEP]
    assert OUTLIER in spikes[0]["sample_indices"]
    assert len(spikes[0]["sample_indices"]) == 8
    assert worst.get("doctor/loss_spike") == 1


def _snapshots():
    seen = {}

    class Recorder:
        name = "weights"

        def on_step_end(self, loop, state):
            seen[state.global_step] = loop.model.lin.weight.detach().clone()

    return Recorder(), seen


def test_skip_batch_drops_the_update_and_a_resume_skips_it_again(tmp_path):
    rec, seen = _snapshots()
    args = dict(logging_steps=1, max_steps=STEPS, learning_rate=0.01, save_strategy="steps", save_steps=2)
    doctor = {"on_spike": "skip_batch"}
    loop = make_loop(tmp_path, _linear(), _data(), doctor=doctor, plugins=[rec], **args)
    loop.train()
    skipped = [
        json.loads(x)
        for x in (tmp_path / "run" / "doctor" / "skipped_batches.jsonl").read_text().splitlines()
    ]
    assert len(skipped) == 1 and OUTLIER in skipped[0]["sample_indices"]
    step = skipped[0]["step"]
    assert step == SPIKE_STEP
    assert torch.equal(seen[step], seen[step - 1])  # the spiking step changed no weight
    assert not torch.equal(seen[step + 1], seen[step])  # the next one trained
    final = seen[STEPS]
    # resume from the checkpoint before the skip: the same step is skipped again, from the file
    before = max(s for s in range(2, step, 2))
    rec2, seen2 = _snapshots()
    again = make_loop(tmp_path, _linear(), _data(), doctor=doctor, plugins=[rec2], **args)
    again.train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{before}"))
    assert torch.equal(seen2[step], seen[step - 1])  # resumed at step - 1: unchanged again
    assert torch.allclose(seen2[STEPS], final, atol=1e-7)
    assert doctor_of(again).state_dict()["skipped_steps"] == {str(step): skipped[0]["sample_indices"]}


class DoctorReads(TorchFunctionMode):
    """Records each read of a tensor's value to the host (on a GPU: a host-device sync) that the
    doctor's code makes, with the step it happens at."""

    READS = {"item", "tolist", "__float__", "__bool__", "__int__", "cpu", "numpy"}

    def __init__(self, loop):
        super().__init__()
        self.loop, self.steps = loop, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            f = sys._getframe(1)  # the caller, past torch's own Python frames if any
            while f is not None and "/site-packages/torch/" in f.f_code.co_filename:
                f = f.f_back
            if f is not None and "corelooper_doctor" in f.f_code.co_filename:
                self.steps.append(self.loop.state.global_step)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("doctor", "reads_at"),
    [
        ({}, []),  # the window loss the loop logged: nothing read
        ({"spike_per_step": True}, [4, 8, 12, 16]),  # each step's loss, read with each log
        ({"on_spike": "skip_batch"}, list(range(0, STEPS))),  # before each update: asked for
    ],
)
def test_what_the_doctor_reads_from_the_device_and_when(tmp_path, doctor, reads_at):
    loop = make_loop(
        tmp_path, _linear(), _data(), doctor=doctor, logging_steps=4, max_steps=STEPS, learning_rate=0.01
    )
    reads = DoctorReads(loop)
    with reads:
        loop.train()
    assert reads.steps == reads_at


def test_per_step_spikes_are_found_at_the_next_log_step(tmp_path):
    loop = make_loop(
        tmp_path,
        _linear(),
        _data(),
        doctor={"spike_per_step": True},
        logging_steps=4,
        max_steps=STEPS,
        learning_rate=0.01,
    )
    loop.train()
    spikes = [
        json.loads(line) for line in (tmp_path / "run" / "doctor" / "spikes.jsonl").read_text().splitlines()
    ]
    assert [s["step"] for s in spikes] == [SPIKE_STEP]  # the step itself, not its window
    assert OUTLIER in spikes[0]["sample_indices"] and len(spikes[0]["sample_indices"]) == 8
    flagged = [h["step"] for h in loop.state.log_history if h.get("doctor/loss_spike")]
    assert flagged == [12]  # the log of the window that holds step 11
