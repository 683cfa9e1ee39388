"""Memory: per-log device figures, a breakdown after the first step, and the OOM report.

The breakdown is measured, not guessed: parameter and gradient bytes from the tensors,
optimizer-state bytes from ``optimizer.state`` after the first step, and activation bytes from
the tensors autograd saved for backward during the first micro-batch's forward (a
``saved_tensors_hooks`` pair on that one forward only). Temporaries that are freed during the
forward (and the logits' softmax in the loss) come on top: the "largest micro-batch" keeps 10%
of the device free for them.
"""

from __future__ import annotations

import math
import os
import resource
from typing import Any

import torch

from .settings import PREFIX
from .units import GB, fmt

HEADROOM = 0.9
LARGE = 16  # a batch this many times larger still fits: memory does not limit it


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def log_values(device: torch.device) -> dict[str, float]:
    """Device memory now and its peak since the last call (CUDA); peak RSS on the CPU."""
    if device.type == "cuda":
        out = {
            f"{PREFIX}memory_allocated_gb": round(torch.cuda.memory_allocated(device) / GB, 4),
            f"{PREFIX}memory_max_allocated_gb": round(torch.cuda.max_memory_allocated(device) / GB, 4),
            f"{PREFIX}memory_reserved_gb": round(torch.cuda.memory_reserved(device) / GB, 4),
        }
        torch.cuda.reset_peak_memory_stats(device)  # the next log's peak is that window's
        return out
    return {f"{PREFIX}memory_peak_rss_gb": round(peak_rss_bytes() / GB, 4)}


def peak_gb(values: dict[str, float]) -> float:
    """The peak among one log's memory values (device allocations on CUDA, RSS on the CPU)."""
    return max(
        values.get(f"{PREFIX}memory_max_allocated_gb", 0.0), values.get(f"{PREFIX}memory_peak_rss_gb", 0.0)
    )


def peak_kind(device: torch.device) -> str:
    return "device, allocated" if device.type == "cuda" else "process RSS"


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def device_capacity(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _unique_bytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        n += t.numel() * t.element_size()
    return n


class ActivationProbe:
    """Counts the bytes autograd saves for backward while it is entered (one forward)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._storages: set[int] = set()
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # e.g. tensors without storage
            key = id(t)
        if key not in self._storages:
            self._storages.add(key)
            self.bytes += t.untyped_storage().nbytes() if key != id(t) else t.numel() * t.element_size()
        return t

    def start(self, model: torch.nn.Module) -> None:
        for p in model.parameters():  # weights saved for backward are not activations
            try:
                self._storages.add(p.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # FSDP's resharded (freed) storages
                continue
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()

    def stop(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
            self._storages.clear()


def static_breakdown(model: torch.nn.Module, optimizer) -> dict[str, int]:
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    states = []
    for st in getattr(optimizer, "state", {}).values():
        states.extend(v for v in st.values() if torch.is_tensor(v))
    opt = _unique_bytes(states)
    if not states:  # before the first step: Adam-like optimizers keep two fp32 states
        opt = 2 * sum(p.numel() * 4 for p in trainable) if "adam" in type(optimizer).__name__.lower() else 0
    return {
        "parameters": _unique_bytes(params),
        "gradients": _unique_bytes(trainable),
        "optimizer_states": opt,
    }


def breakdown(
    model,
    optimizer,
    device,
    activation_bytes: int,
    micro_batch: int,
    tokens_per_sample: float,
    peak_step_bytes: int | None,
) -> dict[str, Any]:
    out: dict[str, Any] = dict(static_breakdown(model, optimizer))
    static = out["parameters"] + out["gradients"] + out["optimizer_states"]
    per_sample = activation_bytes / max(micro_batch, 1)
    capacity = device_capacity(device)
    out.update(
        activations=activation_bytes,
        micro_batch=micro_batch,
        tokens_per_sample=round(tokens_per_sample, 2),
        activations_per_sample=round(per_sample),
        activations_per_token=round(per_sample / tokens_per_sample) if tokens_per_sample else None,
        capacity=capacity,
        device=str(device),
    )
    if peak_step_bytes is not None:
        out["peak_first_step"] = peak_step_bytes
    free = HEADROOM * capacity - static
    out["largest_micro_batch"] = max(0, math.floor(free / per_sample)) if per_sample > 0 else None
    return out


def breakdown_line(b: dict) -> str:
    """The breakdown in the knob a user turns (``per_device_train_batch_size``) and the share of
    the device used; the raw estimate stays in ``memory.json`` (``largest_micro_batch``)."""
    used = b["parameters"] + b["gradients"] + b["optimizer_states"] + b["activations"]
    micro, fit = b["micro_batch"], b["largest_micro_batch"]
    share = f" ({used / b['capacity']:.0%})" if b.get("capacity") else ""
    return (
        f"doctor: memory per process on {b['device']}: {fmt(used)} of {fmt(b['capacity'])}{share} at "
        f"per_device_train_batch_size = {micro}: parameters {fmt(b['parameters'])}, gradients "
        f"{fmt(b['gradients'])}, optimizer states {fmt(b['optimizer_states'])}, activations "
        f"{fmt(b['activations'])} ({fmt(b['activations_per_sample'])} per sample"
        + (f", {fmt(b['activations_per_token'])} per token" if b.get("activations_per_token") else "")
        + f"); {batch_advice(micro, fit)}."
    )


def worth_saying(b: dict) -> bool:
    """Whether the breakdown line is worth a line of every run's output: the batch size is near or
    over what fits (otherwise it is in memory.json, and on the console with ``--verbose``)."""
    fit = b.get("largest_micro_batch")
    return fit is not None and fit < LARGE * max(b["micro_batch"], 1)


def batch_advice(micro: int, fit: int | None) -> str:
    if fit is None:
        return "no activations measured"
    if fit >= LARGE * max(micro, 1):
        return f"memory is not the limit: per_device_train_batch_size could grow {LARGE}x and more"
    if fit < micro:
        return (
            f"per_device_train_batch_size = {micro} may not fit: use {max(fit, 1)} or less, with "
            "gradient_accumulation_steps for the same global batch"
        )
    return f"per_device_train_batch_size up to {fit} should fit"
