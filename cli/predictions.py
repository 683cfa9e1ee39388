"""Model outputs written to a file (``corelooper predict --output``) and read back.

``.safetensors``: tensors ``predictions`` and ``label_ids`` with the metrics in the metadata;
``.jsonl``: one line per sample. The model's outputs come from ``Loop.predict()`` in dataset order;
a plugin's per-sample records (``predict_records``) are written by ``write_records``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from corelooper.errors import ConfigError

FORMATS = (".safetensors", ".jsonl")
LARGE_JSON = 10_000_000  # numbers: ~100 MB of JSON


def write_predictions(
    path: str | Path,
    predictions: torch.Tensor | None,
    label_ids: torch.Tensor | None,
    metrics: dict[str, Any],
) -> Path:
    """``.safetensors``: tensors ``predictions`` and ``label_ids`` (metrics in the metadata);
    ``.jsonl``: one line per sample ``{"index", "prediction", "label_ids"}``. Metrics also go to
    ``<name>.metrics.json`` next to the file when there are any."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ConfigError(f"--output {str(path)!r}: use a file ending in {' or '.join(FORMATS)}.")
    if predictions is None:
        raise ConfigError("Nothing to write: the model produced no predictions (is the dataset empty?).")
    _note_logits(path, predictions)
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


def write_records(path: str | Path, records) -> int:
    """One JSON line per record (``predict_records``' answer), written to a temporary file and
    renamed into place; returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def _note_logits(path: Path, predictions: torch.Tensor) -> None:
    """Per-position floats (a causal LM's logits over its vocabulary) are written as asked, with one
    note: how large they are as JSON, and that per-sample records come from a plugin's command."""
    if not (predictions.is_floating_point() and predictions.dim() >= 3):
        return
    size = ""
    if path.suffix == ".jsonl" and predictions.numel() >= LARGE_JSON:
        size = (
            f" ({predictions.numel() / 1e6:.0f} million numbers; about {predictions.numel() * 10 / 1e6:.0f} MB "
            "as JSON, slow to write and read); --output with .safetensors holds them exactly in "
            f"{predictions.numel() * predictions.element_size() / 1e6:.0f} MB"
        )
    logging.getLogger("corelooper").warning(
        "--output %s: the predictions are the model's raw outputs per position, %s floats (logits)%s. "
        "One record per sample (its loss, token ids, generated text) comes from a plugin that answers "
        "the hook predict_records for this model (`corelooper plugins` lists the installed ones).",
        path.name,
        list(predictions.shape),
        size,
    )


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
