"""The Loop is not a shared bag: the step returns a ``StepResult``, the public Loop API is
read-only, the loss type is resolved once, and model/data transforms run in their declared
order (``corelooper.transforms``), not in the order plugins were registered."""

from __future__ import annotations

import pytest
import torch
import toys

from corelooper.errors import PluginError
from corelooper.loop import Loop
from corelooper.step import StepResult, default_training_step
from corelooper.transforms import DATA_PREPARED, DATA_TOKENIZE, MODEL_PATCH, MODEL_WRAP, order


def _loop(train_args, plugins=(), model=None, **args):
    model = model if model is not None else toys.mlp()
    return Loop(
        model,
        train_args(
            **{
                "max_steps": 4,
                "per_device_train_batch_size": 8,
                "max_grad_norm": 1.0,
                "overwrite_output_dir": True,
                **args,
            }
        ),
        train_dataset=toys.Blobs(32),
        plugins=plugins,
        blocked_plugins=["console"],
    )


def _train_logs(loop):
    return [h for h in loop.state.log_history if "loss" in h and "train_runtime" not in h]


def test_the_step_returns_its_results_and_writes_nothing_on_the_loop(train_args):
    seen = []

    class Watch:
        name = "watch"

        def training_step(self, loop, micro_batches):
            result = default_training_step(loop, micro_batches)
            seen.append(result)
            return result

    loop = _loop(train_args, [Watch()], lr_scheduler_type="linear", learning_rate=0.1)
    loop.train()
    assert len(seen) == 4 and all(isinstance(r, StepResult) for r in seen)
    assert [r.learning_rate for r in seen] == pytest.approx([0.1, 0.075, 0.05, 0.025])  # the rate each used
    assert all(
        r.num_micro_batches == 1 and r.grad_norm is not None and r.loss.requires_grad is False for r in seen
    )
    assert loop.last_step is seen[-1]
    logs = _train_logs(loop)
    assert [h["learning_rate"] for h in logs] == pytest.approx([0.1, 0.075, 0.05, 0.025])
    assert [h["grad_norm"] for h in logs] == pytest.approx([float(r.grad_norm) for r in seen])
    assert [h["loss"] for h in logs] == pytest.approx([float(r.loss) for r in seen], abs=1e-4)
    for name in ("learning_rate", "grad_norm"):
        assert not hasattr(loop, name)  # no step result is left on the Loop as an attribute


def test_a_provider_returning_the_older_tuple_keeps_working(train_args):
    """A third-party ``training_step`` written for ``(loss, grad_norm)``: its loss and norm are
    logged, and the learning rate is the scheduler's current one (it reported none)."""

    class TupleStep:
        name = "tuple_step"

        def training_step(self, loop, micro_batches):
            result = default_training_step(loop, micro_batches)
            return result.loss, result.grad_norm

    ref = _loop(train_args, lr_scheduler_type="constant", learning_rate=0.1)
    ref.train()
    loop = _loop(train_args, [TupleStep()], lr_scheduler_type="constant", learning_rate=0.1)
    loop.train()
    assert isinstance(loop.last_step, StepResult) and loop.last_step.learning_rate is None
    want, got = _train_logs(ref), _train_logs(loop)
    assert [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in got] == [
        (h["loss"], h["grad_norm"], h["learning_rate"]) for h in want
    ]


@pytest.mark.parametrize(
    "name",
    [
        "model",
        "config",
        "args",
        "train_dataset",
        "data_collator",
        "loss_type",
        "num_micro_batches",
        "is_training",
        "optimizer",
        "backend",
        "state",
    ],
)
def test_the_public_loop_api_is_read_only(train_args, name):
    loop = _loop(train_args)
    with pytest.raises(AttributeError):
        setattr(loop, name, None)


def test_the_loss_type_is_resolved_once_from_the_first_batch(train_args):
    loop = _loop(train_args)
    assert loop.loss_type == "auto"
    loop.train()
    assert loop.loss_type == "cross_entropy"  # integer class labels
    float_labels = {"x": torch.zeros(2, 8), "labels": torch.zeros(2)}
    assert loop.resolve_loss_type(float_labels) == "cross_entropy"  # kept for the run
    fresh = _loop(train_args)
    assert fresh.resolve_loss_type(float_labels) == "mse" == fresh.loss_type


class Scale:
    """A patch of the model (x2 on its last layer): its order shows in the result."""

    def __init__(self, name):
        self.name = name

    @order(MODEL_PATCH)
    def transform_model(self, model):
        with torch.no_grad():
            model.net[2].weight.mul_(2.0)


class Shift:
    """A transform that declares no order (+1 on the last layer): after the named stages."""

    def __init__(self, name):
        self.name = name

    def transform_model(self, model):
        with torch.no_grad():
            model.net[2].weight.add_(1.0)


class Wrap(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_model_transforms_run_in_their_declared_order_whatever_the_registration(train_args):
    def weights(plugins):
        torch.manual_seed(0)
        loop = _loop(train_args, plugins, model=toys.mlp())
        return loop.model.net[2].weight.detach().clone()

    torch.manual_seed(0)
    base = toys.mlp().net[2].weight.detach()
    # patch (x2) then the default-order shift (+1), in either registration order and names
    a = weights([Scale("zz_scale"), Shift("aa_shift")])
    b = weights([Shift("zz_shift"), Scale("aa_scale")])
    assert torch.equal(a, base * 2 + 1) and torch.equal(a, b)


def test_each_transform_gets_the_previous_result_and_data_transforms_see_the_final_model(train_args):
    seen = {}

    class Wrapper:
        name = "wrapper"

        @order(MODEL_WRAP)
        def transform_model(self, loop, model):
            seen["backend_at_model_transform"] = loop.backend
            return Wrap(model)

    class Tokenize:
        name = "tokenize"

        @order(DATA_TOKENIZE)
        def transform_data(self, loop, model, train_dataset):
            seen["model"], seen["backend"] = model, loop.backend
            return {"train_dataset": torch.utils.data.Subset(train_dataset, range(16))}

    class Filter:
        name = "a_filter"  # sorts first by name, runs second by order

        @order(DATA_PREPARED)
        def transform_data(self, train_dataset, data_collator):
            seen["filtered"] = len(train_dataset)
            return {"train_dataset": torch.utils.data.Subset(train_dataset, range(8))}

    loop = _loop(train_args, [Filter(), Tokenize(), Wrapper()])
    assert seen["backend_at_model_transform"] is None  # before the backend, as TRL wraps PEFT
    assert isinstance(loop.model, Wrap) and seen["model"] is loop.model and seen["backend"] is loop.backend
    assert seen["filtered"] == 16 and len(loop.train_dataset) == 8


def test_a_transform_returning_the_wrong_thing_names_the_plugin(train_args):
    class Bad:
        name = "bad_transform"

        def transform_data(self, train_dataset):
            return train_dataset  # the dataset itself, not {"train_dataset": ...}

    with pytest.raises(PluginError, match=r"'bad_transform': transform_data returned Blobs, expected a dict"):
        _loop(train_args, [Bad()])

    class NotAModel:
        name = "not_a_model"

        def transform_model(self, model):
            return [model]

    with pytest.raises(PluginError, match=r"'not_a_model': transform_model returned list"):
        _loop(train_args, [NotAModel()])
