"""Seeds and RNG states (python, numpy, torch CPU and CUDA), for repeatable runs and resumes."""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional at run time
    np = None


def set_seed(seed: int) -> None:
    random.seed(seed)
    if _has_accelerator():
        torch.manual_seed(seed)  # also seeds every CUDA (MPS, XPU) device
    else:  # the same CPU seed; torch.manual_seed would also queue a CUDA seed call, formatting a stack trace
        torch.default_generator.manual_seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


def _has_accelerator() -> bool:
    mps, xpu = getattr(torch.backends, "mps", None), getattr(torch, "xpu", None)
    return (
        torch.cuda.is_available()
        or (mps is not None and mps.is_available())
        or (xpu is not None and xpu.is_available())
    )


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        # as a tensor, not an ndarray: checkpoints load with torch.load(weights_only=True)
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        kind, keys, *rest = state["numpy"]
        keys = keys.numpy() if torch.is_tensor(keys) else np.asarray(keys)
        np.random.set_state((kind, keys.astype("uint32"), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
