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
_last_columns: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> the last batch's keys
_dropped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> the columns not passed


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
    keys = _last_columns[loop] = tuple(batch)
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
    _dropped[loop] = {} if plan is None else {k: v for k, v in batch.items() if k not in plan}
    return batch if plan is None else {k: batch[k] for k in plan}


# -- a batch the model cannot take -----------------------------------------------------------------


def call_model(loop, model, args: tuple, kwargs: Mapping):
    """``model(*args, **kwargs)``; an error caused by the batch becomes one paragraph (exit 4)."""
    try:
        return model(*args, **kwargs)
    except Exception as e:
        raise_for_batch(loop, model, kwargs, e)
        raise


def _text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value:
        return _text(value[0])
    return None


def _labels_problem(labels, classes: int | None) -> str | None:
    """What makes ``labels`` wrong for a model of ``classes`` outputs (None: nothing found)."""
    if not torch.is_tensor(labels) or not classes or classes < 2:
        return None
    if labels.is_floating_point():
        if labels.dim() > 1 and labels.shape[-1] == classes:  # multi-hot labels: a column per class
            return None
        return (
            f"holds {labels.dtype} values while the model gives {classes} class scores: class labels are "
            "integer ids (cast the column to int or torch.long; a regression needs a model with one output)"
        )
    ids = labels[labels != -100]
    if ids.numel() and (ids.min() < 0 or ids.max() >= classes):
        return (
            f"holds class ids from {int(ids.min())} to {int(ids.max())} in this batch while the model has "
            f"{classes} classes (0-{classes - 1}; -100 marks no label): fix the labels or the model's outputs"
        )
    return None


def _sizes(inner, classes: int | None) -> tuple[int | None, int | None]:
    """(classes of the labels, token ids of the input embedding) where an HF model tells them:
    a classifier's ``num_labels``, else its output layer's width (a causal LM's vocabulary)."""
    if classes is None and "Classification" in type(inner).__name__:
        classes = getattr(getattr(inner, "config", None), "num_labels", None)
    try:  # HF's get_*_embeddings: None, or NotImplementedError, where a model has none
        head, embed = inner.get_output_embeddings(), inner.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        head = embed = None
    return classes or getattr(head, "out_features", None), getattr(embed, "num_embeddings", None)


def _ids_problem(ids, vocab: int | None) -> str | None:
    if not (torch.is_tensor(ids) and not ids.is_floating_point() and vocab and ids.numel()):
        return None
    low, high = int(ids.min()), int(ids.max())
    return (
        None
        if 0 <= low and high < vocab
        else f"holds token ids from {low} to {high} in this batch while the model's embedding has {vocab} "
        f"rows (0-{vocab - 1}): tokenize with the model's own tokenizer, or grow the embedding "
        "(model.resize_token_embeddings)"
    )


def raise_for_batch(loop, model, kwargs: Mapping, error: Exception, classes: int | None = None) -> None:
    """Raise a ``DataError`` naming the column when ``error`` (of the model or the loss) comes
    from the batch: text not turned into tensors, a list per sample, labels of the wrong type or
    range (``classes``: the model's outputs), columns that are not ``forward``'s arguments."""
    if isinstance(error, torch.OutOfMemoryError):
        return
    data, failed = (
        loop.config.data,
        f"{type(error).__name__}: {(str(error).strip() + chr(10)).splitlines()[0]}",
    )
    where = f"data.train = {data.train!r}" if data.train else "train_dataset"
    if not loop.is_training:
        where = f"data.eval = {data.eval!r}" if data.eval else "eval_dataset"
    inner = innermost_model(loop.backend.unwrap_model(model))
    classes, vocab = _sizes(inner, classes)
    # the model got no input but labels, and columns were held back: those (raw text?) are the cause
    dropped = _dropped.get(loop, {})
    starved = bool(dropped) and not any(
        torch.is_tensor(v) for k, v in kwargs.items() if k not in (*_LABEL_NAMES, "num_items_in_batch")
    )
    seen = {**dropped, **kwargs} if starved else kwargs
    texts = {k: _text(v) for k, v in seen.items() if _text(v) is not None}
    lists = [k for k, v in kwargs.items() if isinstance(v, (list, tuple)) and k not in texts]
    wrong = _labels_problem(kwargs.get("labels"), classes)
    wrong = ("labels", wrong) if wrong else ("input_ids", _ids_problem(kwargs.get("input_ids"), vocab))
    if texts:
        key, first = next(iter(texts.items()))
        fix = (
            "Map the class names to integer ids in the dataset"
            if key == "labels"
            else "Tokenize it in the dataset or a collator (data.collator, or a plugin that tokenizes chat, "
            "prompt-completion and text files: `corelooper plugins` lists those installed), or remove it "
            "from the samples"
        )
        hint = f"holds strings (e.g. {first[:40]!r}), which the model cannot take ({failed}). {fix}."
    elif lists:
        key, made = (
            lists[0],
            f"torch's default collation (no data.collator) makes {len(kwargs[lists[0]])} tensors",
        )
        made = "the collator makes a list" if loop.data_collator is not None else made
        hint = (
            f"is a list in each sample, and {made} of it: the model cannot take that ({failed}). Make each "
            "value a tensor of one shape, or give a collator that pads and stacks them (data.collator, or a "
            "plugin's: `corelooper plugins` lists those installed)."
        )
    elif wrong[1]:
        key, hint = wrong[0], f"{wrong[1]} ({failed})."
    elif starved or isinstance(error, TypeError) and "required" in str(error) and "argument" in str(error):
        columns = list(_last_columns.get(loop, ())) or list(kwargs)
        raise DataError(
            f"{type(inner).__name__}.forward cannot be called with the batch ({error}). The batch's columns: "
            f"{columns}; forward's arguments: {list(inspect.signature(inner.forward).parameters)}. Name the "
            f"columns of the dataset ({where}) or of the collator as forward's arguments."
        ) from error
    else:
        return
    raise DataError(f"Column {key!r} of the dataset ({where}) {hint}") from error
