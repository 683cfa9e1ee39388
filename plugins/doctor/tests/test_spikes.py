"""Loss spikes: detected from the logged loss (no extra sync), or per step with skip_batch."""

from __future__ import annotations

import json

import torch
from corelooper_doctor.spikes import SpikeDetector
from doctor_fixtures import _only_named_plugins  # noqa: F401  (autouse)
from doctor_toys import doctor_of, make_loop, spike_samples

from corelooper.data import epoch_permutation

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
    spikes = [json.loads(line) for line in (tmp_path / "run" / "doctor" / "spikes.jsonl").read_text().splitlines()]
    assert [s["step"] for s in spikes] == [worst["step"]] == [SPIKE_STEP]
    assert OUTLIER in spikes[0]["sample_indices"]
    assert len(spikes[0]["sample_indices"]) == 8
    assert worst.get("loss_spike") == 1


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
    skipped = [json.loads(x) for x in (tmp_path / "run" / "doctor" / "skipped_batches.jsonl").read_text().splitlines()]
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
