"""Model outputs: collect them (``eval_accumulation_steps``), gather them across processes in
dataset order, write them to ``.safetensors`` or ``.jsonl`` and read them back.

Order: the evaluation loader gives each process a contiguous block of the dataset (rank 0 the
first), so concatenating the gathered blocks in rank order restores dataset order with no
duplicates. Outputs whose trailing sizes differ between batches or processes (sequences of
different lengths) are padded with -100, as HF does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError

PAD = -100


def _pad_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape[1:]) == tuple(shape):
        return t
    out = t.new_full((t.shape[0], *shape), PAD)
    out[(slice(None), *(slice(0, s) for s in t.shape[1:]))] = t
    return out


def concat_padded(chunks: list[torch.Tensor]) -> torch.Tensor:
    if len(chunks) == 1:
        return chunks[0]
    shape = tuple(max(c.shape[d] for c in chunks) for d in range(1, chunks[0].dim()))
    return torch.cat([_pad_to(c, shape) for c in chunks])


class OutputAccumulator:
    """Model outputs and labels of one process during ``evaluate``/``predict``.

    They stay on the device and are moved to the CPU every ``steps`` batches (HF's
    ``eval_accumulation_steps``; ``None``: once, at the end), so the device holds at most
    ``steps`` batches of outputs and the host syncs once per chunk, not per batch.
    """

    def __init__(self, steps: int | None = None):
        self.steps = steps
        self._preds: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._cpu_preds: list[torch.Tensor] = []
        self._cpu_labels: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self._preds or self._cpu_preds)

    def add(self, predictions: torch.Tensor, labels: torch.Tensor | None) -> None:
        self._preds.append(predictions.detach().float())
        if labels is not None:
            self._labels.append(labels.detach())
        if self.steps and len(self._preds) >= self.steps:
            self._offload()

    def _offload(self) -> None:
        if self._preds:
            self._cpu_preds.append(concat_padded(self._preds).cpu())
        if self._labels:
            self._cpu_labels.append(concat_padded(self._labels).cpu())
        self._preds, self._labels = [], []

    def local(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self._offload()
        preds = concat_padded(self._cpu_preds) if self._cpu_preds else None
        labels = concat_padded(self._cpu_labels) if self._cpu_labels else None
        return preds, labels

    def gather(self, backend) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every process's outputs, in rank order (= dataset order), on the CPU of every process."""
        preds, labels = self.local()
        return _gather(preds, backend), _gather(labels, backend)


def _gather(t: torch.Tensor | None, backend) -> torch.Tensor | None:
    if t is None:
        return None
    if backend.num_processes > 1 and t.dim() > 1:
        import torch.distributed as dist

        shape = torch.tensor(t.shape[1:], device=backend.device)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX)
        t = _pad_to(t, tuple(int(s) for s in shape.tolist()))
    return backend.gather(t.to(backend.device)).cpu()


# -- files --------------------------------------------------------------------------------------

FORMATS = (".safetensors", ".jsonl")


def write_predictions(path: str | Path, predictions: torch.Tensor | None, label_ids: torch.Tensor | None,
                      metrics: dict[str, Any]) -> Path:
    """``.safetensors``: tensors ``predictions`` and ``label_ids`` (metrics in the metadata);
    ``.jsonl``: one line per sample ``{"index", "prediction", "label_ids"}``. Metrics also go to
    ``<name>.metrics.json`` next to the file when there are any."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ConfigError(f"--output {str(path)!r}: use a file ending in {' or '.join(FORMATS)}.")
    if predictions is None:
        raise ConfigError("Nothing to write: the model produced no predictions (is the dataset empty?).")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        tensors = {"predictions": predictions.contiguous()}
        if label_ids is not None:
            tensors["label_ids"] = label_ids.contiguous()
        save_file(tensors, str(tmp), metadata={"metrics": json.dumps(metrics)})
    else:
        with open(tmp, "w") as f:
            for i in range(predictions.shape[0]):
                row = {"index": i, "prediction": _plain(predictions[i])}
                if label_ids is not None:
                    row["label_ids"] = _plain(label_ids[i])
                f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    if metrics:
        path.with_name(path.stem + ".metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return path


def _plain(t: torch.Tensor):
    v = t.tolist()
    return round(v, 6) if isinstance(v, float) else _round(v)


def _round(v):
    if isinstance(v, list):
        return [_round(x) for x in v]
    return round(v, 6) if isinstance(v, float) else v


def read_predictions(path: str | Path) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Read back a ``.safetensors`` predictions file: ``(predictions, label_ids, metrics)``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        preds = f.get_tensor("predictions")
        labels = f.get_tensor("label_ids") if "label_ids" in keys else None
    return preds, labels, json.loads(meta.get("metrics", "{}"))
