"""The non-finite guard (``train.on_nonfinite``): a NaN/Inf loss or gradient norm is caught at the
step it happens; ``stop`` ends the run naming the step, micro-batch and samples and keeps the last
finite checkpoint; ``skip_step`` skips the update (and the scheduler) and counts it; ``ignore``
does nothing. The non-finite values are real (an inf loss, a NaN gradient), not mocked."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import toys
from conftest import run_cli

from corelooper import Loop
from corelooper.checkpoints.checkpoint import list_checkpoints
from corelooper.errors import TrainingError
from corelooper.guard import NonFiniteError


class InfLossFrom:
    """compute_loss: the builtin's loss, times inf from global step ``start`` (1-based) on, up
    to ``stop`` (exclusive; None: for good)."""

    name = "inf_loss"

    def __init__(self, start: int, stop: int | None = None):
        self.start, self.stop = start, stop

    def compute_loss(self, loop, model, batch, num_items_in_batch, return_outputs):
        from corelooper.losses import default_loss

        loss = default_loss(loop, model, batch, num_items_in_batch, return_outputs)
        step = loop.state.global_step + 1
        if model.training and step >= self.start and (self.stop is None or step < self.stop):
            loss = loss * float("inf")
        return loss


class NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss with a non-finite gradient norm."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class NanGradAt(torch.nn.Module):
    def __init__(self, step: int):
        super().__init__()
        self.inner, self.step, self.calls = toys.mlp(), step, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
        out = self.inner(x)
        return NanGradient.apply(out) if self.training and self.calls == self.step else out


def mlp():
    torch.manual_seed(0)
    return toys.mlp()


def finite(loop) -> bool:
    return all(torch.isfinite(v).all() for v in loop.backend.unwrap_model(loop.model).state_dict().values())


def test_stop_names_the_step_the_micro_batch_and_its_samples(train_args, tmp_path):
    args = train_args(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=10,
        save_strategy="steps",
        save_steps=5,
        save_total_limit=1,
        output_dir=str(tmp_path / "run"),
    )
    loop = Loop(
        mlp(), args, train_dataset=toys.Blobs(64), plugins=[InfLossFrom(7)], blocked_plugins=["console"]
    )
    with pytest.raises(NonFiniteError) as info:
        loop.train()
    msg = str(info.value)
    assert "global_step 7" in msg and "micro-batch 0 of 2" in msg
    indices = loop.train_loader.batch_indices()[12]  # step 7's first micro-batch: batches 12, 13
    assert f"samples {indices}" in msg
    assert "checkpoint-5" in msg and "is finite" in msg and "verifies" in msg
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-5"]  # never rotated away
    assert not (tmp_path / "run" / "model.safetensors").exists()  # no final model from a NaN run
    assert loop.state.global_step == 6 and finite(loop)  # the bad update was never applied


def test_a_nan_gradient_with_a_finite_loss_is_caught_by_its_norm(train_args):
    loop = Loop(
        NanGradAt(step=3),
        train_args(per_device_train_batch_size=8, max_steps=6),
        train_dataset=toys.Blobs(64),
        blocked_plugins=["console"],
    )
    with pytest.raises(NonFiniteError, match=r"global_step 3: the gradient norm \(nan\) with finite losses"):
        loop.train()
    assert finite(loop)


def test_the_norm_is_checked_without_clipping_too(train_args):
    loop = Loop(
        NanGradAt(step=2),
        train_args(per_device_train_batch_size=8, max_steps=4, max_grad_norm=0.0),
        train_dataset=toys.Blobs(64),
        blocked_plugins=["console"],
    )
    with pytest.raises(NonFiniteError, match="global_step 2"):
        loop.train()


def test_skip_step_skips_the_update_and_the_schedule_and_counts_it(train_args, tmp_path):
    seen = []

    class Watch:
        name = "watch"

        def on_nonfinite(self, state, sample_indices, action, loss):
            seen.append((state.global_step + 1, action, len(sample_indices), bool(torch.isinf(loss))))

    kw = dict(
        per_device_train_batch_size=8,
        max_steps=8,
        logging_steps=4,
        lr_scheduler_type="linear",
        on_nonfinite="skip_step",
    )
    skipping = Loop(
        mlp(),
        train_args(**kw, output_dir=str(tmp_path / "a")),
        train_dataset=toys.Blobs(64),
        plugins=[InfLossFrom(3, stop=5), Watch()],
        blocked_plugins=["console"],
    )
    skipping.train()
    assert seen == [(3, "skip_step", 1, True), (4, "skip_step", 1, True)]
    logs = [h for h in skipping.state.log_history if "loss" in h and "train_runtime" not in h]
    assert [h["skipped_steps"] for h in logs] == [2, 2]
    assert skipping.state.global_step == 8 and finite(skipping)
    # 6 updates, 6 scheduler steps: the learning rate is where an 8-step schedule is after 6
    assert skipping.scheduler.last_epoch == 6


def test_skip_step_stops_after_max_skipped_steps_in_a_row(train_args):
    loop = Loop(
        mlp(),
        train_args(
            per_device_train_batch_size=8, max_steps=10, on_nonfinite="skip_step", max_skipped_steps=3
        ),
        train_dataset=toys.Blobs(64),
        plugins=[InfLossFrom(2)],
        blocked_plugins=["console"],
    )
    with pytest.raises(NonFiniteError, match=r"global_step 5 after 3 skipped steps in a row"):
        loop.train()
    assert finite(loop)


def test_ignore_carries_on_but_never_writes_a_non_finite_model(train_args, tmp_path):
    from corelooper.checkpoints.checkpoint import NonFiniteWeights

    loop = Loop(
        mlp(),
        train_args(per_device_train_batch_size=8, max_steps=4, on_nonfinite="ignore"),
        train_dataset=toys.Blobs(64),
        plugins=[InfLossFrom(2)],
        blocked_plugins=["console"],
    )
    with pytest.raises(NonFiniteWeights, match="final model"):
        loop.train()
    assert loop.state.global_step == 4 and not finite(loop)  # every step ran, NaN and all
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_the_deferred_check_skips_the_update_on_the_device(train_args):
    """On an accelerator the host reads the flag one step later, and the fused optimizer skips the
    bad update itself (found_inf). Forced here on the CPU, where fused AdamW honours found_inf too."""
    loop = Loop(
        mlp(),
        train_args(per_device_train_batch_size=8, max_steps=8, optim="adamw_torch_fused"),
        train_dataset=toys.Blobs(64),
        plugins=[InfLossFrom(3, stop=4)],
        blocked_plugins=["console"],
    )
    loop.guard.deferred = True
    before = {}

    class Snapshot:
        name = "snapshot"

        def on_step_end(self, loop, state):
            if state.global_step == 2:
                before.update({k: v.clone() for k, v in loop.model.state_dict().items()})

    loop.plugins.register(Snapshot(), "snapshot")
    with pytest.raises(NonFiniteError, match="global_step 3"):
        loop.train()
    assert loop.state.global_step == 3  # detected when step 4 came to its update
    after = loop.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # neither 3 nor 4 was applied


def test_the_deferred_check_holds_the_host_batches_not_their_device_copies(train_args):
    """A deferred check keeps a step's batches until the next step's check, for ``on_nonfinite``.
    Device copies kept that long put two steps' inputs on the GPU during every forward (the H200's
    real-OOM run, 2026-12-04); the guard keeps the host batches and moves them only to report. A
    second device cannot exist here: a backend whose ``to_device`` copies, as a move does, stands
    in for it; the deferred check is forced on the CPU as in the test above."""
    alive_at_forward, reported = [], []

    class Plugin(toys.CopyingDevice):
        def on_nonfinite(self, micro_batches):
            reported.append(any(micro_batches[0]["x"] is r() for r in self.copies))

    plugin = Plugin("x")
    model = mlp()
    model.register_forward_pre_hook(lambda *_: alive_at_forward.append(plugin.alive(but_last=True)))
    loop = Loop(
        model,
        train_args(per_device_train_batch_size=8, max_steps=6, optim="adamw_torch_fused"),
        train_dataset=toys.Blobs(64),
        plugins=[plugin, InfLossFrom(5, stop=6)],
        blocked_plugins=["console"],
    )
    loop.guard.deferred = True
    with pytest.raises(NonFiniteError, match="global_step 5"):
        loop.train()
    # no earlier step's device copy is alive during a training forward (a diagnosis plugin may re-run one after)
    assert alive_at_forward[:6] == [0] * 6
    assert reported == [True]  # on_nonfinite still gets the batches on the device


@pytest.mark.slow
def test_the_cli_exits_6_with_one_paragraph_and_keeps_the_last_finite_checkpoint(tmp_path):
    (tmp_path / "task.py").write_text(
        textwrap.dedent("""
        import torch

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                return {"x": torch.randn(8, generator=g), "labels": torch.tensor(i % 4)}

        def build(**_):
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

        def data(**_):
            return Data()
    """)
    )
    (tmp_path / "plugin.py").write_text(
        textwrap.dedent("""
        import torch.nn.functional as F

        def compute_loss(loop, model, batch, num_items_in_batch):
            loss = F.cross_entropy(model(batch["x"]), batch["labels"], reduction="sum") / num_items_in_batch
            return loss * float("inf") if loop.state.global_step + 1 >= 7 else loss
    """)
    )
    (tmp_path / "config.toml").write_text(
        textwrap.dedent("""
        [model]
        factory = "task.py:build"
        [data]
        train = "task.py:data"
        [train]
        output_dir = "out"
        max_steps = 12
        per_device_train_batch_size = 8
        save_strategy = "steps"
        save_steps = 5
        save_total_limit = 1
        [plugins]
        local = ["plugin.py"]
    """)
    )
    proc = run_cli("run", "config.toml", cwd=tmp_path, env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert proc.returncode == 6, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("corelooper: error:")]
    assert len(errors) == 1 and "global_step 7" in errors[0] and "checkpoint-5" in errors[0]
    assert [p.name for p in list_checkpoints(tmp_path / "out")] == ["checkpoint-5"]
    state = json.loads((tmp_path / "out" / "checkpoint-5" / "loop_state.json").read_text())
    assert state["global_step"] == 5


def test_nonfinite_error_is_a_training_error():
    assert issubclass(NonFiniteError, TrainingError)
