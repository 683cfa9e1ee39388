"""Exact resume: a run of N steps and a run stopped at N/2 then resumed end bitwise-identical.

The model has dropout (so the restored torch RNG matters), the stop falls in the middle of an
epoch, gradient accumulation is on, and the data is shuffled per epoch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from corelooper.config import TrainArgs
from corelooper.loop import Loop

N = 14  # optimizer steps; 40 samples / batch 4 / GA 2 -> 5 steps per epoch: N/2 = 7 is mid-epoch 2


@pytest.fixture(autouse=True)
def _no_installed_plugins(monkeypatch):
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")


class Samples(torch.utils.data.Dataset):
    """Random 3-class samples; counts ``__getitem__`` calls (to prove skipped samples are not read)."""

    def __init__(self, n: int = 40):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.reads.append(i)
        return {"x": self.x[i], "labels": self.y[i]}


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def forward(self, x):
        return self.net(x)


class StopAt:
    """Ends training after ``step`` (as a job killed there would have, with its checkpoint)."""

    name = "stop_at"

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, state, control):
        if state.global_step == self.step:
            control.should_training_stop = True


def make_loop(out, plugins=(), dataset=None, **overrides) -> Loop:
    args = dict(
        output_dir=str(out),
        max_steps=N,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=1,
        save_steps=N // 2,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.01,
    )
    torch.manual_seed(0)
    return Loop(
        DropoutMLP(),
        TrainArgs(**{**args, **overrides}),
        train_dataset=dataset or Samples(),
        plugins=plugins,
        blocked_plugins=["console"],
    )


def step_logs(loop: Loop) -> dict[int, tuple]:
    return {
        h["step"]: (h["loss"], h["grad_norm"], h["learning_rate"])
        for h in loop.state.log_history
        if "loss" in h and "train_runtime" not in h
    }


def assert_same_weights(a: Loop, b: Loop) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs"


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # GA 2, stop mid-epoch
        {
            "gradient_accumulation_steps": 1,
            "max_steps": 12,
            "save_steps": 6,
        },  # 10 steps/epoch: stop mid-epoch 1
        {"dataloader_num_workers": 1},  # worker seeds must not be drawn from the (restored) global RNG
        {"logging_steps": 3},  # stop at 7, inside the logging window 7..9: the log at 9 averages 3 steps
    ],
    ids=["ga2-mid-epoch", "no-ga", "worker", "log-window"],
)
def test_stopped_and_resumed_equals_straight_run(tmp_path, overrides):
    straight = make_loop(tmp_path / "straight", **overrides)
    straight.train()
    half = (overrides.get("max_steps", N)) // 2

    first = make_loop(tmp_path / "split", plugins=[StopAt(half)], **overrides)
    first.train()
    assert first.state.global_step == half
    assert 0 < first.state.step_in_epoch < first.state.steps_per_epoch  # really mid-epoch

    resumed = make_loop(tmp_path / "split", **overrides)
    resumed.train(resume_from_checkpoint="latest" if half == 7 else tmp_path / "split" / f"checkpoint-{half}")
    assert resumed.state.global_step == straight.state.global_step
    assert_same_weights(straight, resumed)
    # every step's logged loss, grad norm and learning rate, before and after the resume
    logs_straight, logs_resumed = step_logs(straight), step_logs(resumed)
    every = overrides.get("logging_steps", 1)
    assert sorted(logs_resumed) == list(range(every, straight.state.global_step + 1, every)) + (
        [straight.state.global_step] if straight.state.global_step % every else []
    )
    assert logs_resumed == logs_straight
    # optimizer moments too (the next step would diverge otherwise)
    for (ka, va), (kb, vb) in zip(
        straight.optimizer.state_dict()["state"].items(),
        resumed.optimizer.state_dict()["state"].items(),
        strict=True,
    ):
        assert ka == kb and all(torch.equal(va[n], vb[n]) for n in va)


def test_without_rng_restore_the_comparison_fails(tmp_path, monkeypatch):
    """The exact-resume check can fail: skip restoring the RNG and dropout draws differ."""
    straight = make_loop(tmp_path / "straight")
    straight.train()
    make_loop(tmp_path / "split", plugins=[StopAt(7)]).train()
    monkeypatch.setattr("corelooper.checkpoints.checkpoint.set_rng_state", lambda state: None)
    resumed = make_loop(tmp_path / "split")
    resumed.train(resume_from_checkpoint="latest")
    sa, sb = straight.model.state_dict(), resumed.model.state_dict()
    assert not all(torch.equal(sa[k], sb[k]) for k in sa)
    assert step_logs(resumed)[8] != step_logs(straight)[8]


def test_skip_reads_no_skipped_sample(tmp_path):
    """Resuming at step 7 reads only the samples of steps 8..N, never the skipped ones."""
    first = make_loop(tmp_path / "out", plugins=[StopAt(7)])
    first.train()
    data = Samples()
    resumed = make_loop(tmp_path / "out", dataset=data)
    resumed.train(resume_from_checkpoint="latest")
    loader = resumed.hook.train_dataloader(loop=resumed, dataset=data)
    per_epoch = len(loader)  # micro-batches per epoch (10)
    consumed_before = 7 * 2  # micro-batches of steps 1..7
    expected = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        expected += loader.batch_indices()
    expected = expected[consumed_before : N * 2]
    assert per_epoch == 10
    assert data.reads == [i for batch in expected for i in batch]


def test_resume_deep_in_epoch_reads_as_little_as_at_start(tmp_path):
    """Index-level skip: resuming 9/10 into a long epoch reads only the remaining samples."""
    big = Samples(200)  # 25 steps per epoch
    first = make_loop(tmp_path / "out", dataset=big, plugins=[StopAt(22)], max_steps=24, save_steps=22)
    first.train()
    data = Samples(200)
    resumed = make_loop(tmp_path / "out", dataset=data, max_steps=24, save_steps=22)
    resumed.train(resume_from_checkpoint="latest")
    assert len(data.reads) == 2 * 2 * 4  # 2 steps x GA 2 x batch 4


def test_python_resume_argument_from_config(tmp_path):
    """train.resume_from_checkpoint in the config works like the train() argument."""
    first = make_loop(tmp_path / "out", plugins=[StopAt(7)])
    first.train()
    resumed = make_loop(tmp_path / "out", resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-7"))
    state = resumed.train()
    straight = make_loop(tmp_path / "straight")
    straight.train()
    assert state.global_step == N
    assert_same_weights(straight, resumed)
