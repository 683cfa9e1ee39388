"""What a provider may return, checked on every answer, and the refusal of hook wrappers on them.

``Plugins.call_provider`` is the one way the loop, the builtin and plugins call a provider; it
checks each answer with ``CHECKS[hook]``, derived from the provider's return annotation in
``hookspecs`` (``-> Module | None``): ``Returns`` has, for each return type, its check and what
it is in words (messages, docs/hooks.md, ``corelooper hooks``). The checks run per
micro-batch for ``compute_loss``/``training_step``: they read types and shapes only (no device
sync). No torch import here: ``corelooper --help`` loads this.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import hookspecs
from .errors import PluginError

# Hooks whose implementations corelooper calls each on its own (one that raises must not stop
# the others, or each is given the previous one's result): a wrapper there has nothing to wrap.
ONE_AT_A_TIME = frozenset({"on_exception", *hookspecs.DECLARATIONS, *hookspecs.TRANSFORMS})


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


class Returns:
    """The return types of providers, each named as a hookspec's return annotation names it
    (``-> Module | None``; ``None`` is every provider's "let the next one answer"). Each checks an
    answer given the call's keyword arguments (types and shapes only: no device sync); its
    docstring says the type in words (messages, docs/hooks.md, ``corelooper hooks``)."""

    def Module(r, kw) -> bool:
        """a torch.nn.Module"""
        return "torch" in sys.modules and isinstance(r, sys.modules["torch"].nn.Module)

    def Dataset(r, kw) -> bool:
        """a dataset (map-style: __len__ and __getitem__; or an IterableDataset)"""
        torch = sys.modules.get("torch")
        iterable = torch is not None and isinstance(r, torch.utils.data.IterableDataset)
        return iterable or (hasattr(r, "__len__") and hasattr(r, "__getitem__"))

    def Backend(r, kw) -> bool:
        """an object with the Backend protocol's methods (corelooper.backends.base.Backend)"""
        return not _backend_missing(r)

    def Optimizer(r, kw) -> bool:
        """a torch.optim.Optimizer (or an object with step(), zero_grad() and param_groups)"""
        return _has(r, "step", "zero_grad") and hasattr(r, "param_groups")

    def Scheduler(r, kw) -> bool:
        """a learning-rate scheduler (an object with step() and get_last_lr())"""
        return _has(r, "step", "get_last_lr")

    def Batches(r, kw) -> bool:
        """an iterable of batches"""
        return isinstance(r, Iterable)

    def Loss(r, kw) -> bool:
        """a scalar torch.Tensor (or (loss, outputs) when return_outputs is true)"""
        return _loss(r) or bool(kw.get("return_outputs") and type(r) is tuple and len(r) == 2 and _loss(r[0]))

    def Step(r, kw) -> bool:
        """(loss, grad_norm) with loss a torch.Tensor, or a result with a tensor .loss"""
        return (type(r) is tuple and len(r) == 2 and _tensor(r[0])) or _tensor(getattr(r, "loss", None))

    def Evaluation(r, kw) -> bool:
        """a tuple (metrics, predictions, label_ids) with metrics a dict"""
        return type(r) is tuple and len(r) == 3 and isinstance(r[0], Mapping)

    def Metrics(r, kw) -> bool:
        """a dict of metrics"""
        return isinstance(r, Mapping)

    def EvalMetric(r, kw) -> bool:
        """an object with update(predictions, label_ids) and compute() -> dict"""
        return _has(r, "update", "compute")

    def Config(r, kw) -> bool:
        """a corelooper.config.Config (config itself, or a copy with another batch geometry)"""
        return type(r) is type(kw["config"])

    def Records(r, kw) -> bool:
        """an iterable of per-sample records (dicts)"""
        return isinstance(r, Iterable) and not isinstance(r, (str, bytes, Mapping))

    def Position(r, kw) -> bool:
        """a dict (the checkpoint's loop state, its position in this run's micro-batches)"""
        return isinstance(r, Mapping) and "micro_batches_in_epoch" in r


RETURNS: dict[str, Callable[[Any, dict], bool]] = {n: f for n, f in vars(Returns).items() if n[0] != "_"}


def returns(hook: str) -> Callable[[Any, dict], bool]:
    """The check of provider ``hook``'s answers, by its hookspec's return annotation (a string:
    postponed annotations); its ``__doc__`` says the type in words."""
    return RETURNS[getattr(hookspecs, hook).__annotations__["return"].removesuffix(" | None")]


CHECKS = {hook: returns(hook) for hook in hookspecs.PROVIDERS}  # hook -> check(result, call kwargs)


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
    expected = returns(hook).__doc__ if hook in CHECKS else "another type"
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
    """Hook wrappers are refused at registration where there is nothing to wrap. On a provider
    the loop must know which implementation answered (the sum/mean loss rule; whom to blame for
    a wrong result), which a wrapper that may replace the answer would hide. The implementations
    of ``on_exception``, the transforms and the declarations are called one at a time (one that
    raises does not stop the others; a transform gets the previous one's result)."""
    for hook, impl in impls:  # (hook name, pluggy HookImpl) of one plugin
        if not (impl.hookwrapper or impl.wrapper) or hook not in (*hookspecs.PROVIDERS, *ONE_AT_A_TIME):
            continue
        provider = hook in hookspecs.PROVIDERS
        then = (
            f", calling the next one with `plugins.call_next({hook!r}, self, **kwargs)`" if provider else ""
        )
        raise PluginError(
            f"Plugin {name!r} declares a hook wrapper on {'the provider ' if provider else ''}{hook!r}; "
            "corelooper calls its implementations one at a time, so there is nothing to wrap (hook "
            f"wrappers work on the other events). Implement {hook!r} as a plain implementation{then} "
            "(docs/hooks.md)."
        )
