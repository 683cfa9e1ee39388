"""The plugin contract of the architecture issue: per-run plugin objects, the provider that
answered decides the loss scale, late registration, the step as a provider, explicit state.

Each of the three bugs named in the issue has a test here that fails on the old loop:
1. installed plugins were module-level objects shared by every Loop of a process;
2. a ``compute_loss`` that returned ``None`` made every loss 1/GA too small;
3. a plugin registered after an event first fired was never called for it.
"""

from __future__ import annotations

import json

import pytest
import torch
import toys

from corelooper import Loop
from corelooper.config import Config
from corelooper.errors import PluginError
from corelooper.step import default_training_step


def mlp():
    torch.manual_seed(0)  # the same initial weights for every Loop of a test
    return toys.mlp()


def losses(loop) -> list[float]:
    return [h["loss"] for h in loop.state.log_history if "loss" in h and "train_runtime" not in h]


def weights(loop) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in loop.backend.unwrap_model(loop.model).state_dict().items()}


class PassingLoss:
    """A compute_loss provider that lets the next one answer ("not my batch"), declared
    without num_items_in_batch: the old loop decided "mean loss, divide by GA" from it."""

    name = "passing_loss"

    def __init__(self):
        self.calls = 0

    def compute_loss(self, loop, model, batch):
        self.calls += 1
        return None


def test_a_provider_that_passes_leaves_the_loss_unchanged(train_args, tmp_path):
    args = train_args(per_device_train_batch_size=4, gradient_accumulation_steps=4, max_steps=4)
    plain = Loop(
        mlp(),
        train_args(
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            max_steps=4,
            output_dir=str(tmp_path / "plain"),
        ),
        train_dataset=toys.Blobs(64),
        blocked_plugins=["console"],
    )
    plain.train()
    passing = PassingLoss()
    other = Loop(mlp(), args, train_dataset=toys.Blobs(64), plugins=[passing], blocked_plugins=["console"])
    other.train()
    assert passing.calls == 16  # asked for every micro-batch, and passed each time
    assert losses(other) == losses(plain)  # was exactly 1/4 of it
    for k, v in weights(plain).items():
        assert torch.equal(v, weights(other)[k]), k


def test_a_mean_loss_provider_is_still_divided_by_the_micro_batches(train_args, tmp_path):
    """The answering provider lacks num_items_in_batch: it returns a mean, the loop averages."""

    class MeanLoss:
        name = "mean_loss"

        def compute_loss(self, model, batch):
            return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])

    args = train_args(per_device_train_batch_size=4, gradient_accumulation_steps=4, max_steps=4)
    mean = Loop(mlp(), args, train_dataset=toys.Blobs(64), plugins=[MeanLoss()], blocked_plugins=["console"])
    mean.train()
    plain = Loop(
        mlp(),
        train_args(
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            max_steps=4,
            output_dir=str(tmp_path / "plain"),
        ),
        train_dataset=toys.Blobs(64),
        blocked_plugins=["console"],
    )
    plain.train()
    # equal micro-batches: the mean of means is the global mean
    assert losses(mean) == pytest.approx(losses(plain), abs=1e-6)


def test_a_plugin_registered_after_an_event_fired_is_called_from_the_next_one(train_args):
    seen: list[int] = []

    class Late:
        name = "late"

        def on_step_end(self, state):
            seen.append(state.global_step)

    class RegistersLate:
        name = "registers_late"

        def on_step_end(self, loop, state):
            if state.global_step == 3:
                loop.plugins.register(Late(), "late")

    args = train_args(per_device_train_batch_size=8, max_steps=6)
    loop = Loop(
        mlp(), args, train_dataset=toys.Blobs(64), plugins=[RegistersLate()], blocked_plugins=["console"]
    )
    loop.train()
    # on_step_end had fired (and found no "late") at steps 1-3; from step 4 on it is called
    assert seen == [4, 5, 6]


def test_a_step_provider_can_wrap_the_default_step(train_args, tmp_path):
    """A SAM-style two-pass step: perturb, run the default step, and restore."""

    class CountingStep:
        name = "counting_step"

        def __init__(self):
            self.steps = 0

        def training_step(self, loop, micro_batches):
            self.steps += 1
            return default_training_step(loop, micro_batches)

    args = train_args(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=5)
    counting = CountingStep()
    wrapped = Loop(mlp(), args, train_dataset=toys.Blobs(64), plugins=[counting], blocked_plugins=["console"])
    wrapped.train()
    plain = Loop(
        mlp(),
        train_args(
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=5,
            output_dir=str(tmp_path / "plain"),
        ),
        train_dataset=toys.Blobs(64),
        blocked_plugins=["console"],
    )
    plain.train()
    assert counting.steps == 5
    assert losses(wrapped) == losses(plain)


def test_a_step_provider_can_replace_the_step(train_args):
    """A step that only evaluates the loss (no update): the weights never move."""

    class FrozenStep:
        name = "frozen_step"

        def training_step(self, loop, micro_batches):
            batch = loop.backend.to_device(micro_batches[0])
            with torch.no_grad():
                loss = torch.nn.functional.cross_entropy(loop.model(batch["x"]), batch["labels"])
            return loss, None

    args = train_args(per_device_train_batch_size=8, max_steps=3)
    loop = Loop(
        mlp(), args, train_dataset=toys.Blobs(64), plugins=[FrozenStep()], blocked_plugins=["console"]
    )
    before = weights(loop)
    loop.train()
    assert all(torch.equal(v, weights(loop)[k]) for k, v in before.items())
    assert len(losses(loop)) == 3


class Counter:
    """A per-run object with checkpointed state, registered by corelooper_configure."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class CounterPlugin:
    name = "counter"

    def corelooper_configure(self, plugins):
        counter = Counter()
        plugins.register(counter, "counter.run")
        plugins.register_for_checkpointing("counter", counter)


def test_state_is_saved_only_when_registered_and_restored_on_resume(train_args, tmp_path):
    class Unregistered:  # has state_dict, but never registered it: not saved (no scanning)
        name = "unregistered"

        def state_dict(self):
            return {"x": 1}

        def load_state_dict(self, state):
            raise AssertionError("never called")

    args = train_args(
        per_device_train_batch_size=8,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        output_dir=str(tmp_path / "run"),
    )
    loop = Loop(
        mlp(),
        args,
        train_dataset=toys.Blobs(64),
        plugins=[CounterPlugin(), Unregistered()],
        blocked_plugins=["console"],
    )
    loop.train()
    saved = json.loads((tmp_path / "run" / "checkpoint-3" / "plugins.json").read_text())
    assert saved["counter"] == {"steps": 3} and "unregistered" not in saved
    again = Loop(
        mlp(), args, train_dataset=toys.Blobs(64), plugins=[CounterPlugin()], blocked_plugins=["console"]
    )
    again.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert again.plugins.get("counter.run").steps == 6
    assert again.plugins.get("counter.run") is not loop.plugins.get("counter.run")


def test_register_for_checkpointing_needs_both_methods():
    class Half:
        def state_dict(self):
            return {}

    class Bad:
        name = "bad"

        def corelooper_configure(self, plugins):
            plugins.register_for_checkpointing("half", Half())

    with pytest.raises(PluginError, match=r"Half has no load_state_dict\(\)"):
        Loop(mlp(), Config(), train_dataset=toys.Blobs(8), plugins=[Bad()])


def test_inactive_reasons_are_declared_explicitly(train_args):
    class Sleepy:
        name = "sleepy"

        def corelooper_configure(self, config, plugins):
            plugins.set_inactive("sleepy", "no [sleepy] section")

    loop = Loop(mlp(), train_args(max_steps=1), train_dataset=toys.Blobs(8), plugins=[Sleepy()])
    assert loop.plugins.inactive["sleepy"] == "no [sleepy] section"


@pytest.mark.parametrize(
    "name", ["throughput", "best_metric", "preemption", "console", "jsonl", "run_record"]
)
def test_core_policies_are_plugins_that_can_be_switched_off(train_args, name):
    args = train_args(per_device_train_batch_size=8, max_steps=2)
    loop = Loop(toys.tiny_lm(), args, train_dataset=toys.lm_samples(16), blocked_plugins=[name])
    assert loop.plugins.get(name) is None and name in loop.plugins.skipped
    loop.train()
    assert loop.state.global_step == 2


def test_an_on_exception_hook_that_raises_is_named_and_the_others_still_run(train_args, caplog):
    """A broken cleanup hook neither hides the original error nor skips the other plugins'
    on_exception (the doctor's out-of-memory report was lost that way)."""
    import logging

    class Broken:
        def on_exception(self):
            raise ValueError("cleanup bug")

    class Reporter:
        seen = []

        def on_exception(self, exception):
            self.seen.append(type(exception).__name__)

    class Fails:
        def on_step_begin(self, state):
            if state.global_step == 1:
                raise KeyError("boom")

    reporter = Reporter()
    loop = Loop(
        mlp(), train_args(max_steps=3), train_dataset=toys.Blobs(16), plugins=[reporter, Broken(), Fails()]
    )
    with caplog.at_level(logging.WARNING, logger="corelooper"), pytest.raises(PluginError, match="boom"):
        loop.train()
    assert reporter.seen == ["KeyError"]
    assert "raised in hook 'on_exception' (ValueError: cleanup bug)" in caplog.text
