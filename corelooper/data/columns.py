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

from ..errors import DataError

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
        if (
            plan is not None
        ):  # a note (HF logs it as info) unless a loss plugin, which sees them all, is there
            dropped, plugin_loss = (
                [k for k in keys if k not in plan],
                loop.plugins.implemented_by_others("compute_loss"),
            )
            logger.log(
                logging.INFO if plugin_loss else logging.WARNING,
                "The batch columns %s are not arguments of %s.forward and are not passed to it "
                "(train.remove_unused_columns = false keeps them; a compute_loss plugin still "
                "sees every column).",
                dropped,
                type(model).__name__,
            )
    return batch if plan is None else {k: batch[k] for k in plan}


# -- a batch the model cannot take -----------------------------------------------------------------


def call_model(loop, model, args: tuple, kwargs: Mapping):
    """``model(*args, **kwargs)``; a ``TypeError`` caused by the batch (text not turned into
    tensors, columns that are not ``forward``'s arguments) becomes one paragraph (exit 4)."""
    try:
        return model(*args, **kwargs)
    except TypeError as e:
        hint = batch_mismatch(loop, model, kwargs, e)
        if hint is None:
            raise
        raise DataError(hint) from e


def _text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value:
        return _text(value[0])
    return None


def batch_mismatch(loop, model, kwargs: Mapping, error: TypeError) -> str | None:
    data = loop.config.data
    where = (
        (f"data.train = {data.train!r}" if data.train else "train_dataset")
        if loop.is_training
        else (f"data.eval = {data.eval!r}" if data.eval else "eval_dataset")
    )
    texts = {k: _text(v) for k, v in kwargs.items() if _text(v) is not None}
    if texts:
        key, first = next(iter(texts.items()))
        return (
            f"Column {key!r} of the dataset ({where}) holds strings (e.g. {first[:40]!r}), and the model "
            f"cannot take them ({type(error).__name__}: {error}). Tokenize the column in the dataset or "
            "the collator (data.collator), or remove it from the samples."
        )
    if "required" in str(error) and "argument" in str(error):
        inner = innermost_model(loop.backend.unwrap_model(model))
        arguments = list(inspect.signature(inner.forward).parameters)
        # the columns before model_inputs dropped those forward does not take
        plans = _column_plans.get(loop, {})
        columns = next((list(keys) for keys, plan in plans.items() if plan == tuple(kwargs)), list(kwargs))
        return (
            f"{type(inner).__name__}.forward cannot be called with the batch ({error}). The batch's "
            f"columns: {columns}; forward's arguments: {arguments}. Name the columns of the "
            f"dataset ({where}) or of the collator as forward's arguments."
        )
    return None
