"""Optimizers by name (train.optim), optim_args, parameter groups and LR multipliers."""

from __future__ import annotations

import copy

import pytest
import torch

from corelooper.errors import ConfigError


def optimizer_of(loop):
    return loop.hook.create_optimizer(loop=loop, model=loop.model)


@pytest.mark.parametrize(
    "name,cls,extra",
    [
        ("adamw_torch", torch.optim.AdamW, {"fused": False}),
        ("adamw_torch_fused", torch.optim.AdamW, {"fused": True}),
        ("sgd", torch.optim.SGD, {"momentum": 0.0}),
        (
            "adafactor",
            pytest.importorskip("transformers.optimization").Adafactor,
            {"scale_parameter": False, "relative_step": False},
        ),
        ("rmsprop", torch.optim.RMSprop, {}),
        ("adagrad", torch.optim.Adagrad, {}),
    ],
)
def test_optim_by_name(make_loop, name, cls, extra):
    opt = optimizer_of(make_loop(optim=name, learning_rate=0.02))
    assert type(opt) is cls
    assert opt.defaults["lr"] == 0.02
    for k, v in extra.items():
        assert opt.defaults[k] == v


def test_optim_args_as_hf_string_and_as_table(make_loop):
    opt = optimizer_of(make_loop(optim="sgd", optim_args="momentum=0.9, nesterov=True, dampening=0"))
    assert (opt.defaults["momentum"], opt.defaults["nesterov"], opt.defaults["dampening"]) == (0.9, True, 0)
    opt = optimizer_of(make_loop(optim="rmsprop", optim_args={"alpha": 0.9, "centered": True}))
    assert (opt.defaults["alpha"], opt.defaults["centered"]) == (0.9, True)


def test_sgd_momentum_steps_match_hand_computation(make_loop):
    """Two steps of SGD with momentum 0.9 on one weight, computed by hand."""
    loop = make_loop(optim="sgd", optim_args="momentum=0.9", learning_rate=0.1, weight_decay=0.0)
    w = torch.nn.Parameter(torch.tensor([1.0]))
    opt = loop.hook.create_optimizer(loop=loop, model=torch.nn.ParameterDict({"w": w}))
    for _ in range(2):
        (w**2).sum().backward()  # grad 2w
        opt.step()
        opt.zero_grad()
    # step 1: g=2, buf=2, w=1-0.2=0.8; step 2: g=1.6, buf=0.9*2+1.6=3.4, w=0.8-0.34=0.46
    assert w.item() == pytest.approx(0.46)


def test_fused_adamw_trains_like_adamw_torch(run_loop, tmp_path):
    plain = run_loop(optim="adamw_torch", output_dir=tmp_path / "a", save_strategy="no")
    fused = run_loop(optim="adamw_torch_fused", output_dir=tmp_path / "b", save_strategy="no")
    assert fused.optimizer.defaults["fused"] is True
    for p, q in zip(plain.model.parameters(), fused.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    losses = [h["loss"] for h in fused.state.log_history if "loss" in h and "train_loss" not in h]
    assert losses[-1] < losses[0]


def test_parameter_groups_no_decay_and_lr_multipliers(make_loop):
    """Biases get no weight decay; `net\\.0\\.` (first layer) trains at 0.1x the LR."""
    loop = make_loop(optim="sgd", learning_rate=0.5, weight_decay=0.01, lr_multipliers={r"net\.0\.": 0.1})
    opt = optimizer_of(loop)
    names = {id(p): n for n, p in loop.model.named_parameters()}
    by_name = {}
    for g in opt.param_groups:
        for p in g["params"]:
            by_name[names[id(p)]] = (g["lr"], g["weight_decay"])
    assert by_name == {
        "net.0.weight": (0.05, 0.01),
        "net.0.bias": (0.05, 0.0),
        "net.2.weight": (0.5, 0.01),
        "net.2.bias": (0.5, 0.0),
    }


def test_without_weight_decay_one_group_makes_the_same_update_as_hfs_two(make_loop):
    """weight_decay = 0: decayed and not-decayed parameters are one group (one fused kernel
    launch per step); the update is element for element the one of HF's two-group layout."""
    loop = make_loop(optim="adamw_torch_fused", weight_decay=0.0)
    opt = optimizer_of(loop)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 0.0
    model = loop.model
    with torch.no_grad():
        start = [p.clone() for p in model.parameters()]
    names = dict(model.named_parameters())
    two = torch.optim.AdamW(
        [
            {"params": [names[n] for n in names if not n.endswith("bias")], "weight_decay": 0.0},
            {"params": [names[n] for n in names if n.endswith("bias")], "weight_decay": 0.0},
        ],
        lr=loop.args.learning_rate,
        fused=True,
    )
    grads = [torch.randn_like(p) for p in model.parameters()]
    results = []
    for optimizer in (opt, two):
        with torch.no_grad():
            for p, p0, g in zip(model.parameters(), start, grads, strict=True):
                p.copy_(p0)
                p.grad = g.clone()
        optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_lr_multiplier_scales_the_update_through_training(make_loop):
    """Plain SGD, constant LR: after training, the first layer moved exactly as a run whose
    multiplier is 1 would have moved it with a 0.25x LR on that layer only -- check one step."""
    loop = make_loop(
        optim="sgd",
        learning_rate=0.2,
        max_steps=1,
        eval_strategy="no",
        save_strategy="no",
        lr_multipliers={r"net\.0\.weight": 0.25},
        max_grad_norm=0.0,
    )
    model0, train = copy.deepcopy(loop.model), loop.train_dataset  # what the run starts from
    with loop:
        loop.train()
    batch = next(iter(loop.hook.train_dataloader(loop=loop, dataset=train)))
    loss = torch.nn.functional.cross_entropy(model0(batch["x"]), batch["labels"])
    loss.backward()
    trained = dict(loop.model.named_parameters())
    for name, p0 in model0.named_parameters():
        mult = 0.25 if name == "net.0.weight" else 1.0
        torch.testing.assert_close(trained[name], p0 - 0.2 * mult * p0.grad, rtol=1e-5, atol=1e-7)


def test_unknown_optimizer_and_bad_options_are_config_errors(make_loop):
    with pytest.raises(
        ConfigError, match=r"train.optim = 'adamw_torh'.*Did you mean 'adamw_torch'.*create_optimizer"
    ):
        optimizer_of(make_loop(optim="adamw_torh"))
    with pytest.raises(ConfigError, match="optim_args.*KEY=VALUE"):
        optimizer_of(make_loop(optim="sgd", optim_args="momentum"))
    with pytest.raises(ConfigError, match="sgd.*optim_args.*momentun"):
        optimizer_of(make_loop(optim="sgd", optim_args="momentun=0.9"))
    with pytest.raises(ConfigError, match="lr_multipliers.*'embed'.*match no parameter"):
        optimizer_of(make_loop(lr_multipliers={"embed": 0.1}))


class ASGDPlugin:
    """What an optimizer package does to add a name: answer create_optimizer for it only."""

    def create_optimizer(self, loop, model):
        if loop.args.optim != "asgd":
            return None
        from corelooper.hf.optimizers import optim_kwargs, parameter_groups_for

        return torch.optim.ASGD(
            parameter_groups_for(loop, model), lr=loop.args.learning_rate, **optim_kwargs(loop.args)
        )


def test_a_plugin_adds_an_optimizer_name(run_loop, make_loop, tmp_path):
    loop = run_loop([ASGDPlugin()], optim="asgd", optim_args="lambd=0.001", save_strategy="no")
    assert (
        type(loop.optimizer.optimizer if hasattr(loop.optimizer, "optimizer") else loop.optimizer)
        is torch.optim.ASGD
    )
    assert optimizer_of(loop).defaults["lambd"] == 0.001
    # other names still reach the builtin provider
    assert type(optimizer_of(make_loop([ASGDPlugin()], optim="sgd"))) is torch.optim.SGD
    with pytest.raises(ConfigError, match="'asgd' is not a known optimizer"):
        optimizer_of(make_loop(optim="asgd", output_dir=tmp_path / "x"))
