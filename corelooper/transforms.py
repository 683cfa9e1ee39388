"""Model and data transforms: every ``transform_model`` / ``transform_data`` implementation, in
its declared order, each given the previous one's result (``corelooper.hookspecs``).

The order is declared by the implementation, never taken from the order plugins were registered
or named in (entry points register by name, so their order is only the alphabet)::

    from corelooper.transforms import MODEL_WRAP, order

    @hookimpl
    @order(MODEL_WRAP)
    def transform_model(config, model):
        return get_peft_model(model, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import PluginError

MODEL_PATCH = 100  # change the model's own modules in place or swap them (kernels, attention)
MODEL_WRAP = 200  # wrap the model (PEFT adapters): after every patch of the base model
DATA_TOKENIZE = 100  # rows -> model inputs, with the collator that batches them (SFT)
DATA_PREPARED = 200  # work on model inputs (filters, curricula): after tokenisation
DEFAULT_ORDER = 500  # an implementation that declares no order runs after the named stages
DATA_PARTS = ("train_dataset", "eval_dataset", "data_collator")


def order(number: int) -> Callable:
    """Declare where a transform implementation runs (lower first); see the stages above."""

    def mark(fn: Callable) -> Callable:
        fn.order = number
        return fn

    return mark


def ordered_impls(plugins, hook_name: str) -> list:
    """The implementations of ``hook_name`` in their declared order (then by plugin name); a
    wrapper is refused when it registers (there is nothing to wrap)."""
    impls = getattr(plugins.hook, hook_name).get_hookimpls()
    return sorted(impls, key=lambda i: (getattr(i.function, "order", DEFAULT_ORDER), i.plugin_name))


def transform_model(plugins, loop, model):
    """``model`` after every ``transform_model`` implementation, in order."""
    import torch

    for impl in ordered_impls(plugins, "transform_model"):
        result = plugins.call_blamed(
            "transform_model", impl, {"loop": loop, "config": loop.config, "model": model}
        )
        if result is None:
            continue
        if not isinstance(result, torch.nn.Module):
            raise PluginError(
                f"Plugin {impl.plugin_name!r}: transform_model returned {type(result).__name__}, "
                "expected a torch.nn.Module (or None to keep the model)."
            )
        model = result
    return model


def transform_data(plugins, loop, model, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (``DATA_PARTS``) after every ``transform_data`` implementation, in order."""
    data = dict(data)
    for impl in ordered_impls(plugins, "transform_data"):
        result = plugins.call_blamed(
            "transform_data", impl, {"loop": loop, "config": loop.config, "model": model, **data}
        )
        if result is None:
            continue
        unknown = sorted(set(result) - set(DATA_PARTS)) if isinstance(result, dict) else None
        if unknown is None or unknown:
            got = f"the keys {unknown}" if unknown else type(result).__name__
            raise PluginError(
                f"Plugin {impl.plugin_name!r}: transform_data returned {got}, expected a dict with "
                f"some of {list(DATA_PARTS)} (or None to keep the data)."
            )
        data.update(result)
    return data
