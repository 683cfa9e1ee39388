"""A micro-batch to and from safetensors, so a failing step can be replayed (no pickle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_batch(batch, path: Path, metadata: dict) -> None:
    from safetensors.torch import save_file

    from .nonfinite import tensors_in

    structure = "dict" if isinstance(batch, dict) else "tensor" if torch.is_tensor(batch) else "tuple"
    flat = {p: t.detach().cpu().contiguous() for p, t in tensors_in(batch)}
    meta = {"structure": structure, **{k: json.dumps(v) for k, v in metadata.items()}}
    save_file(flat, str(path), metadata=meta)


def load_batch(path: Path):
    """The batch as it was: a dict (keys as saved), a tuple, or one tensor; and its metadata."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        flat = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    structure = meta.pop("structure", "dict")
    info = {k: json.loads(v) for k, v in meta.items()}
    if structure == "tensor":
        return next(iter(flat.values())), info
    if structure == "tuple":
        return tuple(flat[k] for k in sorted(flat, key=int)), info
    return unflatten(flat), info


def unflatten(flat: dict[str, torch.Tensor]) -> dict:
    out: dict = {}
    for key, t in flat.items():
        node, parts = out, key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = t
    return out
