"""What a provider may return, checked on every answer, and the refusal of hook wrappers on them.

``Plugins.call_provider`` is the one way the loop, the builtin and plugins call a provider; it
checks each answer with ``CHECKS[hook]`` (what ``hookspecs`` declares in words with
``@returns``). The checks run per micro-batch for ``compute_loss``/``training_step``: they read
types and shapes only (no device sync). No torch import here: ``corelooper --help`` loads this.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from . import hookspecs
from .errors import PluginError


def _tensor(value) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


def _loss(value) -> bool:
    return _tensor(value) and value.ndim == 0  # metadata: no device sync


def _has(value, *names: str) -> bool:
    return all(callable(getattr(value, n, None)) for n in names)


def _backend_missing(value) -> list[str]:
    from .backends.base import Backend  # torch is imported by then: a backend is being made

    methods = [n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")]
    return [n for n in ("device", "num_processes", "is_main_process", *methods) if not hasattr(value, n)]


def _module(value) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def _dataset(value) -> bool:
    torch = sys.modules.get("torch")
    iterable = torch is not None and isinstance(value, torch.utils.data.IterableDataset)
    return iterable or (hasattr(value, "__len__") and hasattr(value, "__getitem__"))


CHECKS: dict[str, Any] = {  # hook -> check(result, kwargs of the call) -> bool
    "create_model": lambda r, kw: _module(r),
    "create_dataset": lambda r, kw: _dataset(r),
    "compute_loss": lambda r, kw: (
        _loss(r) or bool(kw.get("return_outputs") and type(r) is tuple and len(r) == 2 and _loss(r[0]))
    ),
    "training_step": lambda r, kw: (
        (type(r) is tuple and len(r) == 2 and _tensor(r[0])) or _tensor(getattr(r, "loss", None))
    ),
    "create_optimizer": lambda r, kw: _has(r, "step", "zero_grad") and hasattr(r, "param_groups"),
    "create_scheduler": lambda r, kw: _has(r, "step", "get_last_lr"),
    "train_dataloader": lambda r, kw: isinstance(r, Iterable),
    "eval_dataloader": lambda r, kw: isinstance(r, Iterable),
    "evaluation_loop": lambda r, kw: type(r) is tuple and len(r) == 3 and isinstance(r[0], Mapping),
    "compute_metrics": lambda r, kw: isinstance(r, Mapping),
    "eval_metric": lambda r, kw: _has(r, "update", "compute"),
    "create_backend": lambda r, kw: not _backend_missing(r),
    "resume_config": lambda r, kw: type(r) is type(kw["config"]),
    "resume_position": lambda r, kw: isinstance(r, Mapping) and "micro_batches_in_epoch" in r,
}


def describe(value) -> str:
    """``value``'s type as a message says it: "a float", "a tuple of 2 (Tensor, NoneType)"."""
    if _tensor(value):
        return f"a torch.Tensor of shape {tuple(value.shape)}"
    if type(value) is tuple:
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value[:4])})"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def wrong_result(plugins, hook: str, impl, result) -> PluginError:
    """The error for a provider's answer that fails ``CHECKS[hook]``."""
    name = plugins.pm.get_name(impl.plugin) or repr(impl.plugin)
    info = plugins.info.get(name)
    base = name.rsplit(".", 1)[0] if info is not None and info.kind == "run" else name
    expected = getattr(getattr(hookspecs, hook, None), "corelooper_returns", "another type")
    if hook == "create_backend":
        expected += f" (missing: {', '.join(_backend_missing(result))})"
    fix = "Fix the plugin" + (
        "" if info is not None and info.kind == "builtin" else f", or disable it with `-p no:{base}`"
    )
    return PluginError(
        f"Plugin {name!r} returned {describe(result)} from hook {hook!r}; expected {expected}. "
        f"{fix} (`corelooper hooks` shows what each provider returns)."
    )


def refuse_wrappers(name: str, impls) -> None:
    """Hook wrappers on providers are refused at registration, for every provider: the loop must
    know which implementation answered (the sum/mean loss rule; whom to blame for a wrong
    result), which a wrapper that may replace the answer would hide."""
    for hook, impl in impls:  # (hook name, pluggy HookImpl) of one plugin
        if hook in hookspecs.PROVIDERS and (impl.hookwrapper or impl.wrapper):
            raise PluginError(
                f"Plugin {name!r} declares a hook wrapper on the provider {hook!r}; corelooper "
                "refuses wrappers on providers (hook wrappers work on events). Implement "
                f"{hook!r} as a provider instead, calling the next one with "
                f"`plugins.call_next({hook!r}, self, **kwargs)` (see docs/hooks.md)."
            )
