"""One dispatcher for every provider: a provider's answer is checked against what its hookspec
declares (a wrong type is the plugin's fault: PluginError naming plugin, hook, expected, got);
hook wrappers on providers are refused at registration; ``evaluate()``/``predict()`` called
alone report a plugin's error as ``train()`` does, after ``on_exception``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import toys

from corelooper import hookimpl, hookspecs
from corelooper.errors import DataError, PluginError, TrainingError
from corelooper.loop import Loop
from corelooper.plugins import load_plugins


def _ce(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["labels"])


class Wrong:
    """A plugin whose one provider ``hook`` returns ``make(**kwargs)``."""

    name = "wrong"

    def __init__(self, hook: str, make):
        setattr(self, hook, make)


WRONG = [  # (hook, what the plugin returns, how the message names it, words of the expectation)
    ("compute_loss", lambda model, batch: 0.5, "a float", "a scalar torch.Tensor"),
    ("compute_loss", lambda model, batch: {"loss": _ce(model, batch)}, "a dict", "(loss, outputs)"),
    (
        "compute_loss",
        lambda model, batch: _ce(model, batch).reshape(1),
        "a torch.Tensor of shape (1,)",
        "a scalar torch.Tensor",
    ),
    ("create_optimizer", lambda model: list(model.parameters()), "a list", "torch.optim.Optimizer"),
    ("train_dataloader", lambda: 3, "an int", "an iterable of batches"),
    ("create_scheduler", lambda: "cosine", "a str", "get_last_lr()"),
    ("training_step", lambda: torch.tensor(0.5), "a torch.Tensor of shape ()", "(loss, grad_norm)"),
    ("training_step", lambda: (0.5, None), "a tuple of 2 (float, NoneType)", "(loss, grad_norm)"),
]


@pytest.mark.parametrize(("hook", "make", "got", "expected"), WRONG)
def test_a_wrong_type_from_a_training_provider_names_the_plugin(train_args, hook, make, got, expected):
    loop = Loop(
        toys.mlp(),
        train_args(max_steps=2, per_device_train_batch_size=8),
        train_dataset=toys.Blobs(16),
        plugins=[Wrong(hook, make)],
    )
    with pytest.raises(PluginError) as e:
        loop.train()
    msg = str(e.value)
    assert f"Plugin 'wrong' returned {got} from hook {hook!r}; expected " in msg, msg
    assert expected in msg and "-p no:wrong" in msg, msg
    assert e.value.exit_code == 3


EVAL_WRONG = [
    ("eval_dataloader", lambda: 7, "an int", "an iterable of batches"),
    ("compute_metrics", lambda: 0.75, "a float", "a dict of metrics"),
    ("evaluation_loop", lambda: {"eval_loss": 1.0}, "a dict", "(metrics, predictions, label_ids)"),
    (
        "compute_loss",
        lambda model, batch, return_outputs: (_ce(model, batch), None, None),
        "a tuple of 3 (Tensor, NoneType, NoneType)",
        "(loss, outputs)",
    ),
]


@pytest.mark.parametrize(("hook", "make", "got", "expected"), EVAL_WRONG)
def test_a_wrong_type_from_an_evaluation_provider_names_the_plugin(train_args, hook, make, got, expected):
    loop = Loop(
        toys.mlp(),
        train_args(),
        eval_dataset=toys.Blobs(8),
        compute_metrics=toys.accuracy,
        plugins=[Wrong(hook, make)],
    )
    with pytest.raises(PluginError) as e:
        loop.evaluate()
    assert f"Plugin 'wrong' returned {got} from hook {hook!r}; expected " in str(e.value), str(e.value)
    assert expected in str(e.value)


def test_a_backend_that_is_not_one_names_the_plugin(train_args):
    with pytest.raises(PluginError) as e:
        Loop(toys.mlp(), train_args(), plugins=[Wrong("create_backend", lambda: "cuda")])
    msg = str(e.value)
    assert (
        "Plugin 'wrong' returned a str from hook 'create_backend'; expected an object with the "
        "Backend protocol's methods" in msg
    ), msg
    assert "missing: device, num_processes, is_main_process, prepare, prepare_model, to_device" in msg


def test_every_provider_declares_what_it_returns_once_and_its_check_derives_from_it():
    """The return annotation is the one declaration: ``X | None`` (None: the next one answers),
    X a type ``dispatch.Returns`` knows: its check, and what it is in words (its docstring)."""
    from corelooper.dispatch import CHECKS, RETURNS, returns

    for name in hookspecs.PROVIDERS:
        annotation = getattr(hookspecs, name).__annotations__["return"]
        assert annotation.endswith(" | None") and annotation.removesuffix(" | None") in RETURNS, name
        assert CHECKS[name] is returns(name), name
        assert not hasattr(getattr(hookspecs, name), "corelooper_returns"), name  # no second declaration
    assert set(CHECKS) == set(hookspecs.PROVIDERS)
    declared = {
        getattr(hookspecs, n).__annotations__["return"].removesuffix(" | None") for n in hookspecs.PROVIDERS
    }
    assert set(RETURNS) == declared  # no return type that no provider declares


def test_corelooper_hooks_shows_what_each_provider_returns(cli):
    from corelooper.dispatch import returns

    r = cli("hooks")
    assert r.returncode == 0, r.stderr
    for name in hookspecs.PROVIDERS:
        entry = r.stdout.split(f"\n{name}(", 1)[1].split("\n", 2)[1]  # the line after the signature
        assert entry == f"    returns: {returns(name).__doc__}, or None (the next provider answers)", (
            name,
            entry,
        )


def test_right_answers_pass_the_checks(train_args):
    """What the builtin and the documented alternatives return is accepted: a (loss, outputs)
    pair when outputs were asked for, a loss alone otherwise, a (loss, grad_norm) step."""

    class Fine:
        name = "fine"

        def compute_loss(self, model, batch, num_items_in_batch, return_outputs):
            logits = model(batch["x"])
            loss = F.cross_entropy(logits, batch["labels"], reduction="sum") / num_items_in_batch
            return (loss, logits) if return_outputs else loss

    loop = Loop(
        toys.mlp(),
        train_args(max_steps=2, per_device_train_batch_size=8),
        train_dataset=toys.Blobs(16),
        eval_dataset=toys.Blobs(8),
        compute_metrics=toys.accuracy,
        plugins=[Fine()],
    )
    loop.train()
    metrics = loop.evaluate()
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["eval_loss"] > 0


# -- hook wrappers on providers: refused at registration, for every provider -----------------------


@pytest.mark.parametrize("hook", hookspecs.PROVIDERS)
@pytest.mark.parametrize("style", ["wrapper", "hookwrapper"])
def test_a_hook_wrapper_on_a_provider_is_refused_at_registration(hook, style):
    def wrap(**kwargs):
        return (yield)

    plugin = type("WrapperPlugin", (), {hook: staticmethod(hookimpl(**{style: True})(wrap))})()
    plugins = load_plugins(autoload=False)
    with pytest.raises(PluginError) as e:
        plugins.register(plugin, "wrapping")
    msg = str(e.value)
    assert f"Plugin 'wrapping' declares a hook wrapper on the provider {hook!r}" in msg, msg
    assert plugins.get("wrapping") is None and "wrapping" not in plugins.info


def test_a_hook_wrapper_on_an_event_is_still_accepted():
    class EventWrapper:
        @hookimpl(wrapper=True)
        def on_step_end(self):
            return (yield)

    plugins = load_plugins(autoload=False)
    plugins.register(EventWrapper(), "ok")
    assert plugins.get("ok") is not None


# -- evaluate() and predict() called alone: the same error handling as train() ------------------


class Raises:
    name = "raiser"

    def __init__(self, hook: str):
        self.exceptions: list[BaseException] = []

        def boom(**_):
            raise ValueError("no metrics today")

        setattr(self, hook, boom)

    def on_exception(self, exception):
        self.exceptions.append(exception)


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_a_plugin_error_in_evaluate_or_predict_alone_is_blamed_and_on_exception_fires(train_args, call):
    plugin = Raises("compute_metrics")
    loop = Loop(toys.mlp(), train_args(), eval_dataset=toys.Blobs(8), plugins=[plugin])
    with pytest.raises(PluginError) as e:
        loop.evaluate() if call == "evaluate" else loop.predict(toys.Blobs(8))
    assert "Plugin 'raiser' raised in hook 'compute_metrics'" in str(e.value)
    assert "ValueError: no metrics today" in str(e.value)
    assert [type(x) for x in plugin.exceptions] == [ValueError]


def test_an_error_in_evaluation_during_train_fires_on_exception_once(train_args):
    plugin = Raises("compute_metrics")
    loop = Loop(
        toys.mlp(),
        train_args(max_steps=2, per_device_train_batch_size=8, eval_strategy="steps", eval_steps=1),
        train_dataset=toys.Blobs(16),
        eval_dataset=toys.Blobs(8),
        plugins=[plugin],
    )
    with pytest.raises(
        PluginError, match="Plugin 'raiser' raised in hook 'compute_metrics' at global_step 1"
    ):
        loop.train()
    assert len(plugin.exceptions) == 1


def test_a_model_error_in_predict_alone_is_blamed_on_the_model_and_on_exception_fires(train_args):
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            raise RuntimeError("bad weights")

    plugin = Raises("on_log")  # only to record on_exception
    loop = Loop(Broken(), train_args(), plugins=[plugin])
    with pytest.raises(
        TrainingError,
        match="Prediction failed at global_step 0: RuntimeError: bad weights. "
        "The error came from the model or its loss",
    ):
        loop.predict(toys.Blobs(8))
    assert [str(x) for x in plugin.exceptions] == ["bad weights"]


def _bad_accuracy(predictions, label_ids):
    return {"accuracy": (predictions.argmax(-1) == label_ids).mean()}  # bool mean: a RuntimeError


class _BadStreamingMetric:
    def update(self, predictions, label_ids):
        raise ValueError("labels and predictions disagree")

    def compute(self):
        return {}


@pytest.mark.parametrize("metric", [_bad_accuracy, _BadStreamingMetric()], ids=["function", "streaming"])
def test_an_error_in_the_users_compute_metrics_names_it_not_the_model(train_args, metric):
    loop = Loop(
        toys.mlp(),
        train_args(max_steps=2, per_device_train_batch_size=8, eval_strategy="steps", eval_steps=1),
        train_dataset=toys.Blobs(16),
        eval_dataset=toys.Blobs(8),
        compute_metrics=metric,
    )
    with pytest.raises(TrainingError) as info:
        loop.train()
    message = str(info.value)
    # evaluation inside train(): the action is training's
    assert message.startswith("Training failed at global_step 1: the run's compute_metrics (")
    assert f"{__file__}:" in message and "Fix it there" in message and "the model or its loss" not in message


def test_an_error_in_the_users_data_collator_names_it(train_args):
    def collate(rows):
        raise KeyError("input_ids")

    loop = Loop(
        toys.mlp(),
        train_args(max_steps=2, per_device_train_batch_size=8),
        train_dataset=toys.Blobs(16),
        data_collator=collate,
    )
    with pytest.raises(
        DataError,
        match=r"Loading a training batch failed at global_step 0: the collator "
        r"test_an_error_in_the_users_data_collator_names_it.<locals>.collate "
        r"\(.*test_dispatch.py:\d+\) raised KeyError: 'input_ids'. Check it against",
    ):
        loop.train()
