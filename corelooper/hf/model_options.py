"""``train.gradient_checkpointing``, ``train.torch_compile`` and ``train.tf32``, applied once before
the optimizer is built.

Gradient checkpointing: HF models use their own ``activation_checkpointing_enable`` (transformers
5) or ``gradient_checkpointing_enable`` (non-reentrant checkpoints, as HF recommends). A plain
module is checkpointed block by block: every child of every ``nn.ModuleList`` (the usual container
of transformer/residual blocks) recomputes its forward during backward instead of keeping
activations. A model without a ``ModuleList`` can define ``gradient_checkpointing_enable()`` itself.
"""

from __future__ import annotations

import functools

import torch

from ..errors import ConfigError


def _checkpointed(module: torch.nn.Module, forward):
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if module.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


def enable_gradient_checkpointing(model: torch.nn.Module) -> int:
    """Turn on activation checkpointing; returns the number of checkpointed blocks (-1: the
    model's own ``gradient_checkpointing_enable`` did it)."""
    newer = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x name
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if callable(newer) or callable(enable):
        if callable(newer):
            newer(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            try:
                enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            except TypeError:  # a model's own method without HF's keyword
                enable()
        if getattr(getattr(model, "config", None), "use_cache", False):
            model.config.use_cache = False  # caching is pointless while training, and clashes
        return -1
    blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    if not blocks:
        raise ConfigError(
            f"train.gradient_checkpointing = true, but {type(model).__name__} has no "
            "gradient_checkpointing_enable() method and no nn.ModuleList of blocks to checkpoint. Keep its "
            "blocks in an nn.ModuleList, add a gradient_checkpointing_enable() method, or set "
            "train.gradient_checkpointing = false."
        )
    for block in blocks:
        if not getattr(block, "_corelooper_checkpointed", False):
            block.forward = _checkpointed(block, block.forward)
            block._corelooper_checkpointed = True
    return len(blocks)


def apply_model_options(loop, model: torch.nn.Module) -> torch.nn.Module:
    a = loop.args
    if hasattr(getattr(model, "config", None), "use_cache"):  # as HF 5.x's Trainer
        model.config.use_cache = a.use_cache
    if getattr(a, "tf32", None) is not None:
        torch.backends.cuda.matmul.allow_tf32 = a.tf32
        torch.backends.cudnn.allow_tf32 = a.tf32
    if getattr(a, "gradient_checkpointing", False):
        enable_gradient_checkpointing(model)
    compile_ = getattr(a, "torch_compile", False) or getattr(a, "torch_compile_backend", None)
    if compile_ and not getattr(model, "_corelooper_compiled", False):
        # In place (nn.Module.compile): the module keeps its type, state_dict keys and signature.
        kwargs = {
            k: v for k, v in (("backend", a.torch_compile_backend), ("mode", a.torch_compile_mode)) if v
        }
        model.compile(**kwargs)
        model._corelooper_compiled = True
    return model
