"""Hooks fire in the documented order (hookspecs' module docstring), with the documented
counts, and plugins written in every allowed style work."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import toys

from corelooper import hookimpl, hookspecs
from corelooper.errors import PluginError
from corelooper.loop import Loop
from corelooper.plugins import load_plugins


class Recorder:
    """Records every event with the global step at which it fired."""

    name = "recorder"

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.extra: list[tuple[str, object]] = []


def _make_recorder_method(event: str):
    def method(self, state):
        self.calls.append((event, state.global_step))

    method.__name__ = event
    return method


for _event in hookspecs.EVENTS:
    setattr(Recorder, _event, _make_recorder_method(_event))


def expected_train_events(
    micro_per_step: list[int], epochs: int, logging_steps: int, eval_batches: int
) -> list[tuple[str, int]]:
    """The order written in hookspecs' docstring, for epoch eval/save strategies."""
    out = [("on_train_begin", 0)]
    step, max_steps = 0, len(micro_per_step) * epochs
    for _ in range(epochs):
        out.append(("on_epoch_begin", step))
        for n in micro_per_step:
            out += [("on_batch_fetched", step)] * n + [("on_step_begin", step)]
            for i in range(n):
                out += [("on_before_backward", step), ("on_after_backward", step)]
                if i < n - 1:
                    out.append(("on_substep_end", step))
            out += [("on_pre_optimizer_step", step), ("on_optimizer_step", step)]
            step += 1
            out.append(("on_step_end", step))
            if step % logging_steps == 0 or step == max_steps:
                out.append(("on_log", step))
        out.append(("on_epoch_end", step))
        out += [("on_evaluate_begin", step)] + [("on_prediction_step", step)] * eval_batches
        out += [("on_log", step), ("on_evaluate", step)]
        out.append(("on_save", step))
    out += [("on_log", step), ("on_train_end", step)]  # the run summary, then the end
    return out


def test_documented_order_and_counts_with_gradient_accumulation(train_args):
    rec = Recorder()
    # 10 samples, batch 2 -> 5 micro-batches; GA 2 -> steps of 2, 2 and 1 micro-batches
    args = train_args(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        logging_steps=2,
        eval_strategy="epoch",
        save_strategy="epoch",
        per_device_eval_batch_size=4,
    )
    loop = Loop(
        toys.mlp(),
        args,
        train_dataset=toys.Blobs(10),
        eval_dataset=toys.Blobs(6, seed=1),
        plugins=[rec],
        blocked_plugins=["console"],
    )
    assert rec.calls == [("on_init_end", 0)]
    rec.calls.clear()
    loop.train()
    assert rec.calls == expected_train_events([2, 2, 1], epochs=2, logging_steps=2, eval_batches=2)
    assert loop.state.global_step == 6

    rec.calls.clear()
    loop.predict(toys.Blobs(6, seed=1))
    assert rec.calls == [("on_evaluate_begin", 6)] + [("on_prediction_step", 6)] * 2 + [("on_predict", 6)]

    # resuming: on_load_checkpoint after the restore, before on_train_begin
    rec2 = Recorder()
    args2 = train_args(**{**dataclasses.asdict(args), "num_train_epochs": 3})
    loop2 = Loop(
        toys.mlp(),
        args2,
        train_dataset=toys.Blobs(10),
        eval_dataset=toys.Blobs(6, seed=1),
        plugins=[rec2],
        blocked_plugins=["console"],
    )
    loop2.train(resume_from_checkpoint="latest")
    names = [c for c, _ in rec2.calls]
    assert names[:4] == ["on_init_end", "on_load_checkpoint", "on_train_begin", "on_epoch_begin"]
    assert rec2.calls[1] == ("on_load_checkpoint", 6)
    assert names.count("on_step_end") == 3 and loop2.state.global_step == 9


def test_every_event_receives_loop_state_control_and_its_own_arguments(train_args):
    got: dict[str, set] = {}

    class AllArgs:
        name = "allargs"

    spec_args = {
        name: getattr(hookspecs, name).__code__.co_varnames[: getattr(hookspecs, name).__code__.co_argcount]
        for name in hookspecs.EVENTS
    }
    for event, names in spec_args.items():
        assert names[:3] == ("loop", "state", "control"), event
        src = f"def {event}(self, {', '.join(names)}):\n    got[{event!r}] = dict(zip({names!r}, ({', '.join(names)},)))"
        ns = {"got": got}
        exec(src, ns)
        setattr(AllArgs, event, ns[event])

    args = train_args(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
    )
    loop = Loop(
        toys.mlp(),
        args,
        train_dataset=toys.Blobs(16),
        eval_dataset=toys.Blobs(4),
        plugins=[AllArgs()],
        blocked_plugins=["console"],
    )
    loop.train()
    loop.predict(toys.Blobs(4))
    missing = set(hookspecs.EVENTS) - set(got) - {"on_exception", "on_load_checkpoint", "on_nonfinite"}
    assert not missing
    for values in got.values():
        assert values["loop"] is loop and values["state"] is loop.state and values["control"] is loop.control
    assert set(got["on_log"]["logs"]) >= {"train_loss"} and "eval_loss" in got["on_evaluate"]["metrics"]
    assert got["on_save"]["checkpoint_dir"].name == "checkpoint-2"
    assert got["on_before_backward"]["loss"].ndim == 0
    assert got["on_pre_optimizer_step"]["optimizer"] is loop.optimizer
    assert got["on_evaluate_begin"]["metric_key_prefix"] == "test"  # the last: predict()'s
    assert set(got["on_batch_fetched"]["batch"]) == {"x", "labels"}
    assert got["on_batch_fetched"]["batch"]["x"].device.type == "cpu"  # as fetched, before the device


def test_a_key_added_to_a_fetched_batch_reaches_compute_loss(train_args):
    """on_batch_fetched may change the batch in place: the step and compute_loss get it; once per
    micro-batch, before on_step_begin; an evaluation's batches do not fire it."""
    seen: list[str] = []

    class Tagger:
        name = "tagger"

        @hookimpl
        def on_batch_fetched(self, state, batch):
            batch["weight"] = state.global_step
            seen.append("fetched")

        @hookimpl
        def on_step_begin(self, loop):
            seen.append(f"step of {loop.num_micro_batches}")

        @hookimpl
        def compute_loss(self, model, batch):
            seen.append(f"loss weight {batch.get('weight')}")
            return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])

    args = train_args(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2)
    loop = Loop(
        toys.mlp(), args, train_dataset=toys.Blobs(16), plugins=[Tagger()], blocked_plugins=["console"]
    )
    loop.train()
    assert seen == ["fetched", "fetched", "step of 2", "loss weight 0", "loss weight 0"] + [
        "fetched",
        "fetched",
        "step of 2",
        "loss weight 1",
        "loss weight 1",
    ]
    seen.clear()
    loop.evaluate(toys.Blobs(4))
    assert seen == ["loss weight None"]  # compute_loss ran on the one batch, on_batch_fetched did not


def test_should_training_stop_from_a_plugin_stops_at_that_step(train_args):
    seen = []

    class Stopper:
        name = "stopper"

        @hookimpl
        def on_step_end(self, state, control):
            seen.append(state.global_step)
            if state.global_step == 3:
                control.should_training_stop = True

    args = train_args(per_device_train_batch_size=4, num_train_epochs=5)  # 4 steps per epoch
    loop = Loop(
        toys.mlp(), args, train_dataset=toys.Blobs(16), plugins=[Stopper()], blocked_plugins=["console"]
    )
    loop.train()
    assert seen == [1, 2, 3]
    assert loop.state.global_step == 3
    assert [h["step"] for h in loop.state.log_history if "loss" in h] == [1, 2, 3]


def test_subset_arguments_and_unmarked_functions(train_args):
    steps, logs = [], []

    def on_step_end(state):  # no marker, one argument of five
        steps.append(state.global_step)

    def on_log(logs):  # only its own argument
        seen_logs.append(dict(logs))

    seen_logs = logs
    plugin = types.SimpleNamespace(name="plain", on_step_end=on_step_end, on_log=on_log)
    module = types.ModuleType("plain_module")  # a module plugin, unmarked too, defined in the module
    module.steps = steps
    exec("def on_train_end(control):\n    steps.append('end')", vars(module))
    loop = Loop(
        toys.mlp(),
        train_args(max_steps=2, per_device_train_batch_size=8),
        train_dataset=toys.Blobs(16),
        plugins=[plugin, module],
        blocked_plugins=["console"],
    )
    loop.train()
    assert steps == [1, 2, "end"]
    assert [entry.get("loss") is not None for entry in logs] == [True, True, False]  # + the summary


@pytest.mark.parametrize(
    ("attr", "hint"),
    [("on_step_ends", "on_step_end"), ("on_epoc_begin", "on_epoch_begin"), ("compute_los", "compute_loss")],
)
def test_misspelt_hook_name_is_a_clear_plugin_error(attr, hint):
    plugin = types.SimpleNamespace(name="typo", **{attr: lambda state: None})
    with pytest.raises(PluginError) as exc:
        load_plugins(objects=[plugin], autoload=False)
    msg = str(exc.value)
    assert "'typo'" in msg and repr(attr) in msg and f"Did you mean {hint!r}" in msg


def test_marked_function_with_unknown_name_is_a_plugin_error():
    class Marked:
        name = "marked"

        @hookimpl
        def after_everything(self, state):
            pass

    with pytest.raises(PluginError, match="'after_everything', which is not a corelooper hook"):
        load_plugins(objects=[Marked()], autoload=False)


def test_unknown_argument_name_is_a_plugin_error():
    class BadArgs:
        name = "badargs"

        def on_step_end(self, state, ctrl):
            pass

    with pytest.raises(PluginError, match="'badargs'.*ctrl"):
        load_plugins(objects=[BadArgs()], autoload=False)


def test_ordinary_helper_methods_are_not_hooks():
    class Helper:
        name = "helper"

        def summarise(self):  # not like any hook name: allowed
            return 1

        def on_step_end(self, state):
            pass

    pl = load_plugins(objects=[Helper()], autoload=False)
    assert pl.info["helper"].hooks == ["on_step_end"]


def test_on_exception_gets_the_error_and_replaces_the_rest(train_args):
    rec = Recorder()
    got = []

    class Raiser:
        name = "raiser"

        def on_step_end(self, state):
            if state.global_step == 2:
                raise ValueError("broken plugin")

        def on_exception(self, exception):
            got.append(exception)

    loop = Loop(
        toys.mlp(),
        train_args(max_steps=4, per_device_train_batch_size=8),
        train_dataset=toys.Blobs(16),
        plugins=[rec, Raiser()],
        blocked_plugins=["console"],
    )
    with pytest.raises(PluginError, match=r"Plugin 'raiser' raised in hook 'on_step_end' at global_step 2"):
        loop.train()
    assert [type(e) for e in got] == [ValueError]
    assert rec.calls[-1] == ("on_exception", 2)
    assert ("on_train_end", 2) not in rec.calls
