"""Which batch columns reach the model: its ``forward`` signature and HF's ``remove_unused_columns``.

``model_inputs`` drops the columns ``forward`` does not accept, deciding once per set of keys
and saying which in one log line; a ``compute_loss`` plugin still sees every column.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger("corelooper.data.loader")


@dataclass(frozen=True)
class ForwardSignature:
    accepts_labels: bool
    accepts_loss_kwargs: bool
    params: frozenset[str]
    var_kwargs: bool


def forward_signature(model: torch.nn.Module) -> ForwardSignature:
    params = inspect.signature(model.forward).parameters
    names = frozenset(params)
    var_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepts_loss_kwargs = getattr(model, "accepts_loss_kwargs", None)
    if accepts_loss_kwargs is None:
        accepts_loss_kwargs = "num_items_in_batch" in names or (var_kwargs and "labels" in names)
    return ForwardSignature("labels" in names, bool(accepts_loss_kwargs), names, var_kwargs)


def innermost_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose ``forward`` declares the real arguments: a wrapper that passes
    ``**kwargs`` through (a PEFT model, say) names what it wraps with ``get_base_model()``."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


# -- unused columns ------------------------------------------------------------------------------

_LABEL_NAMES = ("labels", "label", "label_ids")
# HF's FlashAttentionKwargs: taken through ``**kwargs`` by transformers models (packed varlen batches).
_FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_column_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> keys -> columns


def accepted_columns(signature, keys: Iterable[str]) -> tuple[str, ...] | None:
    """Which of ``keys`` the model's ``forward`` takes (``None``: all of them)."""
    keys = tuple(keys)
    allowed = set(signature.params) | set(_LABEL_NAMES)
    if signature.var_kwargs:
        allowed |= set(_FLASH_KWARGS)
    kept = tuple(k for k in keys if k in allowed)
    return None if len(kept) == len(keys) else kept


def model_inputs(loop, batch: Mapping) -> Mapping:
    """``batch`` without the columns the model's ``forward`` does not accept (decided once per set
    of keys, logged once). Off with ``train.remove_unused_columns = false``."""
    if not getattr(loop.args, "remove_unused_columns", True):
        return batch
    plans = _column_plans.setdefault(loop, {})
    keys = tuple(batch)
    plan = plans.get(keys, 0)
    if plan == 0:
        model = innermost_model(loop.backend.unwrap_model(loop.model))
        plan = accepted_columns(forward_signature(model), keys)
        plans[keys] = plan
        if plan is not None:
            dropped = [k for k in keys if k not in plan]
            logger.warning(
                "The batch columns %s are not arguments of %s.forward and are not passed to it "
                "(train.remove_unused_columns = false keeps them; a compute_loss plugin still "
                "sees every column).",
                dropped, type(model).__name__,
            )
    if plan is None:
        return batch
    return {k: batch[k] for k in plan}
