"""Optimizers by name (``train.optim``, HF's names), ``optim_args``, and parameter groups.

Built in: ``adamw_torch``, ``adamw_torch_fused``, ``sgd``, ``adafactor`` (transformers'
``Adafactor(scale_parameter=False, relative_step=False)``, as HF builds it), ``rmsprop``,
``adagrad``. Options beyond the ``[train]`` keys go in ``train.optim_args``: HF's
``"momentum=0.9,nesterov=True"`` string or a TOML table ``{ momentum = 0.9, nesterov = true }``.

Parameter groups: no weight decay on biases and normalisation weights (HF's rule, see
``no_decay_parameter_names``), and
``train.lr_multipliers = { "embed" = 0.1 }`` scales the learning rate of every parameter whose
name matches the pattern (a regular expression searched in the name, as printed by
``model.named_parameters()``; the first matching pattern wins). Schedulers scale each group's LR
from its own starting value, so the multiplier holds through the whole run.

Another optimizer package adds a name by implementing the ``create_optimizer`` provider: return
an optimizer when ``loop.args.optim`` is your name and ``None`` otherwise (the next provider,
finally this builtin one, answers). ``parameter_groups_for(loop, model)`` gives the same groups
as the built-in optimizers, e.g.::

    def create_optimizer(loop, model):
        if loop.args.optim == "lion":
            from corelooper.hf.optimizers import optim_kwargs, parameter_groups_for
            return Lion(parameter_groups_for(loop, model), lr=loop.args.learning_rate, **optim_kwargs(loop.args))
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..errors import ConfigError

_NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def no_decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """Parameters without weight decay, by HF's rule (``Trainer.get_decay_parameter_names``, 5.x):
    lower-case names with ``bias``, ``layernorm``, ``rmsnorm``, a ``norm`` component or a ``_norm``
    suffix, and parameters of ``nn.LayerNorm`` submodules (decay would pull them to 0 for no
    benefit). Other norm layers are told by their names only, as in HF (an ``nn.RMSNorm`` named
    ``ln`` is decayed there too)."""
    names = set()
    for full, _ in model.named_parameters():
        path = full.split(".")[:-1]
        inside_layernorm = any(
            isinstance(model.get_submodule(".".join(path[: i + 1])), torch.nn.LayerNorm)
            for i in range(len(path))
        )
        if inside_layernorm or _NO_DECAY_NAME.search(full.lower()):
            names.add(full)
    return names


def parameter_groups(
    model: torch.nn.Module,
    weight_decay: float,
    lr: float | None = None,
    lr_multipliers: dict[str, float] | None = None,
) -> list[dict]:
    """Groups by (weight decay, LR multiplier). A group with a multiplier carries its own ``lr``."""
    skip = no_decay_parameter_names(model)
    patterns = []
    for pattern, mult in (lr_multipliers or {}).items():
        try:
            patterns.append((re.compile(pattern), float(mult), pattern))
        except re.error as e:
            raise ConfigError(
                f"train.lr_multipliers: {pattern!r} is not a valid regular expression ({e})."
            ) from None
    groups: dict[tuple[bool, str | None], dict] = {}
    used = set()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        match = next(((pat, m, raw) for pat, m, raw in patterns if pat.search(name)), None)
        # With no weight decay the two groups would be the same: one group is one fused kernel
        # launch per step, not two (same update, element by element).
        decay = name not in skip and weight_decay != 0
        key = (decay, match[2] if match else None)
        if key not in groups:
            group: dict[str, Any] = {"params": [], "weight_decay": weight_decay if decay else 0.0}
            if match:
                if lr is None:
                    raise ValueError("parameter_groups: lr_multipliers need the base lr")
                group["lr"] = lr * match[1]
                group["lr_multiplier"] = match[1]
            groups[key] = group
        groups[key]["params"].append(p)
        if match:
            used.add(match[2])
    unused = [raw for _, _, raw in patterns if raw not in used]
    if unused:
        names = [n for n, _ in model.named_parameters()][:8]
        raise ConfigError(
            f"train.lr_multipliers: pattern(s) {unused} match no parameter name. Parameter "
            f"names look like {names}; a pattern is a regular expression searched in them."
        )
    # Decayed, no-multiplier group first: the order users expect from HF (decay, no decay).
    return sorted(groups.values(), key=lambda g: ("lr_multiplier" in g, g["weight_decay"] == 0.0))


def parameter_groups_for(loop, model: torch.nn.Module) -> list[dict]:
    a = loop.args
    return parameter_groups(model, a.weight_decay, a.learning_rate, getattr(a, "lr_multipliers", None))


def _parse_value(raw: str) -> Any:
    low = raw.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw.strip()


def optim_kwargs(args) -> dict[str, Any]:
    """``train.optim_args`` as keyword arguments: a table, or HF's ``"k=v,k=v"`` string."""
    raw = getattr(args, "optim_args", None)
    if not raw:
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    out = {}
    for item in str(raw).split(","):
        if not item.strip():
            continue
        if "=" not in item:
            raise ConfigError(
                f"train.optim_args = {raw!r}: {item.strip()!r} is not KEY=VALUE. Write "
                '"momentum=0.9,nesterov=True" or a table { momentum = 0.9, nesterov = true }.'
            )
        k, v = item.split("=", 1)
        out[k.strip()] = _parse_value(v)
    return out


def _adamw(a, groups, extra, fused: bool = False):
    adam = {"lr": a.learning_rate, "betas": (a.adam_beta1, a.adam_beta2), "eps": a.adam_epsilon}
    return torch.optim.AdamW(groups, **{**adam, "fused": fused, **extra})


def _adamw_fused(a, groups, extra):
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    # HF's default (one kernel for all parameters: the cheapest step on CPU and GPU); where the
    # device has no fused kernel (or parameters are not floating point), the plain AdamW.
    supported = _get_fused_kernels_supported_devices()
    fused = all(p.device.type in supported and p.is_floating_point() for g in groups for p in g["params"])
    return _adamw(a, groups, extra, fused)


def _lr_only(cls, a, groups, extra):
    """A torch optimizer that takes only the learning rate from ``[train]`` (the rest: ``optim_args``)."""
    return cls(groups, **{"lr": a.learning_rate, **extra})


def _adafactor(a, groups, extra):
    # What HF builds for optim = "adafactor": transformers' Adafactor with the run's learning rate
    # (not its own relative step size) and no parameter-scale factor.
    from transformers.optimization import Adafactor

    return Adafactor(
        groups, **{"lr": a.learning_rate, "scale_parameter": False, "relative_step": False, **extra}
    )


OPTIMIZERS: dict[str, Callable[[Any, list, dict], torch.optim.Optimizer]] = {
    "adamw_torch": _adamw,
    "adamw_torch_fused": _adamw_fused,
    "sgd": partial(_lr_only, torch.optim.SGD),
    "adafactor": _adafactor,
    "rmsprop": partial(_lr_only, torch.optim.RMSprop),
    "adagrad": partial(_lr_only, torch.optim.Adagrad),
}


def create_optimizer(loop, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer named by ``train.optim`` (what the builtin ``create_optimizer`` returns)."""
    a = loop.args
    name = getattr(a, "optim", "adamw_torch")
    if name not in OPTIMIZERS:
        import difflib

        close = difflib.get_close_matches(name, list(OPTIMIZERS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"train.optim = {name!r} is not a known optimizer.{hint} Built in: "
            f"{', '.join(OPTIMIZERS)}. Another optimizer comes from a plugin implementing the "
            "create_optimizer hook for that name: is it installed and enabled "
            "(`corelooper plugins`)?"
        )
    extra = optim_kwargs(a)
    groups = parameter_groups_for(loop, model)
    try:
        return OPTIMIZERS[name](a, groups, extra)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(
            f"train.optim = {name!r} with train.optim_args = {extra!r} failed: {type(e).__name__}: {e}."
        ) from None
