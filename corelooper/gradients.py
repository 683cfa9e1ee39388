"""Clipping and clearing the gradients of a step: torch's kernels, without torch's per-call wrappers.

``torch.nn.utils.clip_grad_norm_`` groups the gradients by device and dtype, checks foreach
support and moves every norm to the first device on every call (~30 µs of Python per step for a
small model). When every gradient is a dense tensor on one device in one dtype, ``clip_grad_norm_``
below runs the same kernels in the same order: torch's norm and gradients, bit for bit
(``tests/test_gradients.py``). Anything else goes to torch's function.

``parameters_of(model)`` is ``list(model.parameters())`` without the walk over every submodule
on every step (0.8 ms for a 28-layer Llama, 4.8 ms with LoRA: ``benchmarks/parameters_walk.py``):
the list is kept per model, made again after a module of a listed model registers a parameter or
a submodule (torch's global registration hooks: LoRA injected, a parametrization, a module
replaced). Others do not count: Llama's forward slices ``self.layers[:n]`` into a new ModuleList
each call; counted, under torch.compile dynamo recompiled on the count every step (21x slower,
H200). A model with a device map (accelerate's offload swaps parameters unregistered) is walked.

``Optimizer.zero_grad(set_to_none=True)`` sets each ``p.grad`` to None inside a profiler range;
``zero_grad`` does the same assignments without the range when no profiler is recording, and
calls the optimizer's own method when its class overrides it (accelerate's wrapper, DeepSpeed).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable

import torch
from torch.utils._foreach_utils import _device_has_foreach_support

_registrations = [0]  # parameters and submodules registered into a watched module since the hooks were set
_listed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (registrations, params)
_watched: weakref.WeakSet = weakref.WeakSet()  # every module of every listed model


def _count_registration(parent: torch.nn.Module, *_args) -> None:  # None: torch keeps the object
    if not torch.compiler.is_compiling() and parent in _watched:  # compiled: only a sliced ModuleList
        _registrations[0] += 1


@functools.cache  # once per process
def _watch_registrations() -> None:
    from torch.nn.modules import module

    module.register_module_parameter_registration_hook(_count_registration)
    module.register_module_module_registration_hook(_count_registration)


def parameters_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``list(model.parameters())``, listed again only when a module registered something."""
    _watch_registrations()
    listed = _listed.get(model)
    if listed is None or listed[0] != _registrations[0]:
        dispatched = bool(getattr(model, "hf_device_map", None))
        _watched.update(model.modules())
        listed = (_registrations[0], None if dispatched else list(model.parameters()))
        _listed[model] = listed
    return list(model.parameters()) if listed[1] is None else listed[1]


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` (2-norm, foreach): the norm of all
    gradients before clipping; gradients scaled by ``min(max_norm / (norm + 1e-6), 1)``."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not _one_foreach_group(grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    with torch.no_grad():
        # torch: vector_norm(stack([n.to(first_device) for n in _foreach_norm(...)])); the .to()
        # is the identity on one device.
        total_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        clip_coef = float(max_norm) / (total_norm + 1e-6)
        torch._foreach_mul_(grads, torch.clamp(clip_coef, max=1.0))
    return total_norm


def _one_foreach_group(grads: list[torch.Tensor]) -> bool:
    """All gradients in the one group torch would form, and torch would take its foreach path."""
    device, dtype = grads[0].device, grads[0].dtype
    return _device_has_foreach_support(device) and all(
        type(g) is torch.Tensor and g.layout is torch.strided and g.device == device and g.dtype == dtype
        for g in grads
    )


def zero_grad(optimizer, model: torch.nn.Module | None = None) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, then, as the HF Trainer's ``model.zero_grad()``
    after each step, every gradient of ``model``: a parameter with a gradient that the optimizer
    does not hold (a custom optimizer over some of the parameters) would otherwise carry it into
    the next step's clipping norm."""
    if type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad or torch.autograd._profiler_enabled():
        optimizer.zero_grad(set_to_none=True)  # its own method, or a profile that shows the range
    else:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
    if model is not None:
        clear_gradients(model)


def clear_gradients(model: torch.nn.Module) -> None:
    """``model.zero_grad()`` (set_to_none) over the kept list (``train()`` calls it first, as HF)."""
    for p in parameters_of(model):
        p.grad = None
