"""Model weights on disk: safetensors (sharded above ``save_max_shard_size``), shape checks, the
finite-weights check."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file  # every train() saves: not inside it

try:
    import numpy.ctypeslib  # noqa: F401  (save_file imports it on its first call)
except ImportError:  # numpy is optional for torch
    pass

from ..config import parse_size
from ..errors import CheckpointError
from .run_dir import WEIGHTS, WEIGHTS_INDEX


def torch_save(obj, path) -> None:
    """``torch.save`` without the zip records' CRC32: computing it costs more than writing the
    bytes (0.7 s vs 2-3 s for 512 MiB here), and every checkpoint file already has a checksum in
    ``manifest.json``. ``torch.load`` reads such files as usual."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, path)
    finally:
        torch.serialization.set_crc32_options(previous)


def all_finite(state_dict: dict[str, torch.Tensor]) -> bool:
    """Every floating value finite; one host read per device and dtype, no copy of the weights.

    A fused 2-norm screens each group (torch's vectorised kernels: ~15x faster on the CPU than
    the largest magnitude, whose reduction is not vectorised there). NaN and inf always make it
    non-finite; so can the squares of huge finite values. Only then is the exact test run: the
    largest magnitude (inf stays inf, NaN propagates, nothing overflows)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for v in state_dict.values():
        v = getattr(v, "_local_tensor", v)  # a DTensor: this rank's shard
        if torch.is_tensor(v) and v.is_floating_point() and v.numel():
            groups.setdefault((v.device, v.dtype), []).append(v.detach())
    return all(_norms_finite(ts, 2.0) or _norms_finite(ts, float("inf")) for ts in groups.values())


def _norms_finite(tensors: list[torch.Tensor], ord: float) -> bool:
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors, ord))).all())


def _untie(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors; safetensors refuses tensors that share memory (tied weights)."""
    seen: set[int] = set()
    tensors = {}
    for k, v in state_dict.items():
        v = v.detach()
        if v.numel():
            ptr = v.untyped_storage().data_ptr()
            if ptr in seen:
                v = v.clone()
            seen.add(ptr)
        tensors[k] = v.contiguous().cpu()
    return tensors


def save_weights(
    state_dict: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str = "5GB", model=None
) -> None:
    """``directory/model.safetensors``, or shards + ``model.safetensors.index.json`` above
    ``max_shard_size``. A Hugging Face ``PreTrainedModel`` is written by its own
    ``save_pretrained`` (same file names, plus config.json) so ``from_pretrained`` loads it."""
    limit = parse_size(max_shard_size)
    if callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config"):
        # transformers' "Writing model shards" bar at every save, on a pipe too: shown when verbose
        bars = sys.modules.get("transformers.utils.logging")
        hide = getattr(bars, "is_progress_bar_enabled", bool)() and not os.environ.get("CORELOOPER_VERBOSE")
        if hide:
            bars.disable_progress_bar()
        try:
            model.save_pretrained(directory, state_dict=state_dict, max_shard_size=limit)
        finally:
            if hide:
                bars.enable_progress_bar()
        return
    tensors = _untie(state_dict)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(directory / WEIGHTS), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"Checkpoint file {str(path)!r} is unreadable (truncated or corrupt?): {e}.")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / WEIGHTS_INDEX
    if not index.is_file():
        if not (directory / WEIGHTS).is_file():
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} has no model weights ({WEIGHTS} or {WEIGHTS_INDEX})."
            )
        return [directory / WEIGHTS]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise _unreadable(index, e) from None
    files = [directory / name for name in sorted(set(weight_map.values()))]
    for f in files:
        if not f.is_file():
            raise CheckpointError(
                f"Checkpoint {str(directory)!r}: shard {f.name!r}, named in {WEIGHTS_INDEX}, is missing."
            )
    return files


def _read_each(directory: Path, read) -> dict:
    """``read(file)`` of every weight file, merged; a file it cannot read is named."""
    out = {}
    for path in _weight_files(directory):
        try:
            out.update(read(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise _unreadable(path, e) from None
    return out


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors model in ``directory``."""
    return _read_each(directory, load_file)


def _header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    with safe_open(path, framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes from the safetensors headers only (no tensor data is read)."""
    return _read_each(directory, _header_shapes)


def tied_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Key -> other keys sharing its storage (tied weights, which save_pretrained drops)."""
    by_ptr: dict[tuple[int, int], list[str]] = {}
    for k, v in state_dict.items():
        v = getattr(v, "_local_tensor", v)  # a sharded (FSDP2 DTensor) value: its local shard
        if v.numel():
            by_ptr.setdefault((v.untyped_storage().data_ptr(), v.storage_offset()), []).append(k)
    return {k: [o for o in group if o != k] for group in by_ptr.values() if len(group) > 1 for k in group}


def check_shapes(
    model: torch.nn.Module,
    found: dict[str, tuple[int, ...]],
    where: str,
    full_shapes: dict[str, tuple[int, ...]] | None = None,
) -> list[str]:
    """Raise a CheckpointError naming every mismatch; returns keys to fill from their alias.
    ``full_shapes``: a backend's real shapes where the module holds placeholders (a backend's
    optional ``full_parameter_shapes(model)``, e.g. DeepSpeed ZeRO-3's partitioned parameters)."""
    expected = model.state_dict()
    aliases = tied_keys(expected)
    shapes = {k: tuple(v.shape) for k, v in expected.items()}
    shapes.update(full_shapes or {})
    expected.update({k: None for k in shapes if k not in expected})
    fill = [k for k in expected if k not in found and any(a in found for a in aliases.get(k, ()))]
    missing = sorted(set(expected) - set(found) - set(fill))
    unexpected = sorted(set(found) - set(expected))
    wrong = [
        f"{k}: checkpoint {tuple(found[k])} vs model {shapes[k]}"
        for k in expected
        if k in found and tuple(found[k]) != shapes[k]
    ]
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            parts.append(f"{len(wrong)} shape mismatches: " + "; ".join(wrong[:5]))
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:5]}")
        if unexpected:
            parts.append(f"not in the model: {unexpected[:5]}")
        raise CheckpointError(
            f"Checkpoint {where!r} does not match the model ({', '.join(parts)}). It was saved from "
            "another model (config); resume with the model config it was trained with, or start a "
            "new run in another train.output_dir."
        )
    return fill
