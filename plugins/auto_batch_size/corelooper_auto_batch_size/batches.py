"""Cutting batches into smaller micro-batches, and recognising out-of-memory errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from corelooper.data.loader import tensor_rows

# RuntimeError messages that mean "the device (or host) ran out of memory". CUDA raises
# torch.OutOfMemoryError; cuDNN/cuBLAS and other back-ends report OOM as a plain RuntimeError.
_OOM_MESSAGES = (
    "out of memory",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
)


_OOM_ERROR = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (_OOM_ERROR, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def cut(batch: Any, size: int) -> list:
    """``batch`` as consecutive pieces of at most ``size`` samples, in order (views, no copy).

    Tensors whose dim 0 is the batch dimension are sliced; so are per-sample lists (e.g. a
    list of strings with one entry per sample). Anything else is shared by every piece.
    """
    n = tensor_rows(batch)
    if n <= size:
        return [batch]
    return [_take(batch, slice(i, i + size), n) for i in range(0, n, size)]


def _take(obj: Any, sl: slice, n: int) -> Any:
    if torch.is_tensor(obj):
        return obj[sl] if obj.dim() and obj.shape[0] == n else obj
    if isinstance(obj, Mapping):
        items = {k: _take(v, sl, n) for k, v in obj.items()}
        try:
            return type(obj)(items)  # dict, OrderedDict, HF BatchEncoding
        except Exception:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_take(v, sl, n) for v in obj))
    if isinstance(obj, (list, tuple)):
        if any(torch.is_tensor(v) or isinstance(v, (Mapping, list, tuple)) for v in obj):
            return type(obj)(_take(v, sl, n) for v in obj)
        return obj[sl] if len(obj) == n else obj  # per-sample values (strings, ids)
    return obj


def cut_all(micro_batches: list, size: int) -> list:
    return [piece for batch in micro_batches for piece in cut(batch, size)]


def sample_shape(batch: Any) -> str:
    """ "sequence length 512" for token batches, else the shape of one sample of the input."""
    if isinstance(batch, Mapping) and torch.is_tensor(batch.get("input_ids")):
        ids = batch["input_ids"]
        if ids.dim() >= 2:
            return f"sequence length {ids.shape[1]}"
    first = None
    if isinstance(batch, Mapping):
        first = next((v for k, v in batch.items() if k != "labels" and torch.is_tensor(v)), None)
    elif isinstance(batch, (list, tuple)):
        first = next((v for v in batch if torch.is_tensor(v)), None)
    elif torch.is_tensor(batch):
        first = batch
    if first is None or first.dim() == 0:
        return "sample shape unknown"
    if first.dim() >= 2 and not first.is_floating_point():
        return f"sequence length {first.shape[1]}"
    return f"sample shape {tuple(first.shape[1:])}"
