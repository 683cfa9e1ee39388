"""corelooper.gradients against torch's own functions (the oracle): the same norm and the same
clipped gradients, bit for bit, on the fast path and on every case it hands to torch."""

from __future__ import annotations

import math

import pytest
import torch

from corelooper.gradients import _one_foreach_group, clip_grad_norm_, parameters_of, zero_grad


def _params(shapes, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float32).to(dtype))
        p.grad = (torch.randn(shape, generator=g) * scale).to(dtype)
        params.append(p)
    return params


def _clone(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def _same(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        if a.grad is None or b.grad is None:
            assert a.grad is None and b.grad is None
        else:
            assert a.grad.dtype == b.grad.dtype
            assert torch.equal(a.grad, b.grad) or (a.grad.isnan() == b.grad.isnan()).all()


SHAPES = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]


@pytest.mark.parametrize("max_norm", [1.0, 0.05, 1e4, float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e3])
def test_clip_matches_torch_bit_for_bit(max_norm, dtype, scale):
    ours = _params(SHAPES, dtype, scale)
    theirs = _clone(ours)
    assert _one_foreach_group([p.grad for p in ours])  # the fast path is what is tested
    norm = clip_grad_norm_(iter(ours), max_norm)  # a generator, as model.parameters()
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm.dtype == expected.dtype and torch.equal(norm, expected)
    _same(ours, theirs)


def test_clip_scales_only_above_max_norm():
    params = _params(SHAPES, scale=10.0)
    before = torch.cat([p.grad.flatten() for p in params]).norm()
    norm = clip_grad_norm_(params, 1.0)
    after = torch.cat([p.grad.flatten() for p in params]).norm()
    assert math.isclose(float(norm), float(before), rel_tol=1e-5)
    assert math.isclose(float(after), 1.0, rel_tol=1e-4)
    small = _params(SHAPES, scale=1e-4)
    grads = [p.grad.clone() for p in small]
    clip_grad_norm_(small, 1.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(small, grads, strict=True))


def test_clip_non_finite_gradients_as_torch():
    for bad in (float("nan"), float("inf")):
        ours = _params(SHAPES)
        ours[2].grad[3, 4] = bad
        theirs = _clone(ours)
        norm = clip_grad_norm_(ours, 1.0)
        expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        assert not math.isfinite(float(norm))
        assert torch.equal(norm.isnan(), expected.isnan()) and (math.isnan(float(norm)) or norm == expected)
        _same(ours, theirs)


def test_parameters_without_gradients_are_skipped():
    ours = _params(SHAPES)
    ours[1].grad = None
    ours[4].grad = None
    theirs = _clone(ours)
    norm = clip_grad_norm_(ours, 0.5)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs, 0.5))
    _same(ours, theirs)


def test_other_cases_go_to_torch():
    """Mixed dtypes, a sparse gradient, no gradient at all: torch's function answers (the same
    result, or the same error, as calling it)."""
    mixed = _params(SHAPES[:3]) + _params(SHAPES[3:], torch.float64, seed=1)
    assert not _one_foreach_group([p.grad for p in mixed])
    theirs = _clone(mixed)
    assert torch.equal(clip_grad_norm_(mixed, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    _same(mixed, theirs)

    emb = torch.nn.Embedding(20, 4, sparse=True)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    assert not _one_foreach_group([emb.weight.grad])
    with pytest.raises(NotImplementedError) as theirs_error:  # torch 2.13 has no sparse norm on CPU
        torch.nn.utils.clip_grad_norm_(emb.parameters(), 0.1)
    with pytest.raises(NotImplementedError) as ours_error:  # handed to torch: the same error
        clip_grad_norm_(emb.parameters(), 0.1)
    assert str(ours_error.value) == str(theirs_error.value)

    none = _params(SHAPES[:2])
    for p in none:
        p.grad = None
    assert torch.equal(clip_grad_norm_(none, 1.0), torch.nn.utils.clip_grad_norm_(_clone(none), 1.0))


def test_zero_grad_sets_every_gradient_to_none():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.1}])
    model(torch.randn(5, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    zero_grad(opt)
    assert all(p.grad is None for p in model.parameters())


def test_zero_grad_calls_an_overriding_optimizer_and_keeps_the_profiler_range():
    calls = []

    class Custom(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    lin = torch.nn.Linear(3, 1)
    opt = Custom(lin.parameters(), lr=0.1)
    lin(torch.randn(2, 3)).sum().backward()
    zero_grad(opt)
    assert calls == [True] and lin.weight.grad is None

    plain = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.randn(2, 3)).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        zero_grad(plain)
    assert lin.weight.grad is None
    assert any("zero_grad" in e.name for e in prof.events())  # torch's own range, as before


# -- parameters_of: list(model.parameters()), kept until a module registers something ---------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _same_objects(ours, model):
    theirs = list(model.parameters())
    return len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs, strict=True))


def test_parameters_of_is_model_parameters_and_kept_between_calls():
    model = _mlp()
    first = parameters_of(model)
    assert _same_objects(first, model)
    assert parameters_of(model) is first  # no walk over the modules on the next step
    other = _mlp()  # building a model the lists do not hold: nothing is listed again
    assert _same_objects(parameters_of(other), other) and parameters_of(model) is first


def test_parameters_of_keeps_its_list_when_a_forward_slices_a_module_list():
    """Llama's forward runs ``self.layers[: config.num_hidden_layers]``: a new ModuleList, whose
    registrations are of modules the model already holds. Counted, the list was made again every
    step (and a compiled model recompiled every step: tests/test_lm_options.py)."""

    class Sliced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers[:2]:
                x = layer(x)
            return x

    model = Sliced()
    first = parameters_of(model)
    model(torch.randn(2, 4)).sum().backward()
    assert parameters_of(model) is first
    model.layers.append(torch.nn.Linear(4, 4))  # a real change of the model: listed again
    assert _same_objects(parameters_of(model), model) and len(parameters_of(model)) == 8


def test_parameters_of_sees_a_new_submodule_a_replaced_parameter_and_a_parametrization():
    model = _mlp()
    before = parameters_of(model)
    model.add_module("head", torch.nn.Linear(2, 2))  # a module added after the first step
    assert _same_objects(parameters_of(model), model) and len(parameters_of(model)) == len(before) + 2
    model[0].weight = torch.nn.Parameter(torch.zeros(8, 4))  # a parameter object replaced
    assert any(p is model[0].weight for p in parameters_of(model))
    torch.nn.utils.parametrize.register_parametrization(model[2], "weight", torch.nn.Identity())
    assert _same_objects(parameters_of(model), model)  # weight is now parametrizations.weight.original


def test_parameters_of_sees_lora_layers_injected_by_peft():
    import peft  # installed with corelooper-peft by scripts/setup, as tests/test_matrix.py relies on

    model = _mlp()
    parameters_of(model)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"])
    peft.inject_adapter_in_model(config, model)
    names = {id(p): n for n, p in model.named_parameters()}
    listed = parameters_of(model)
    assert _same_objects(listed, model)
    assert sum("lora_" in names[id(p)] for p in listed) == 4


def test_parameters_of_walks_a_dispatched_model_every_time():
    """accelerate's offload hooks swap entries of ``module._parameters`` without registering
    them: a model with an ``hf_device_map`` is never served from the kept list."""
    model = _mlp()
    model.hf_device_map = {"": "cpu"}
    parameters_of(model)
    model[0]._parameters["weight"] = torch.nn.Parameter(torch.ones(8, 4))  # no registration hook
    assert _same_objects(parameters_of(model), model)


def test_clip_over_parameters_of_matches_torch_after_the_model_grows():
    model = _mlp()
    reference = _mlp()
    x = torch.randn(3, 4)
    for m in (model, reference):
        m(x).sum().backward()
    assert torch.equal(
        clip_grad_norm_(parameters_of(model), 0.1),
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1),
    )
    for m in (model, reference):
        torch.manual_seed(1)
        m.add_module("extra", torch.nn.Linear(2, 2))
        m.zero_grad()
        m.extra(m(x)).sum().backward()
    assert torch.equal(
        clip_grad_norm_(parameters_of(model), 0.1),
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1),
    )
    _same(list(model.parameters()), list(reference.parameters()))
