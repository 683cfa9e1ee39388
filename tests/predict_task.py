"""Data and metric plugin for tests/test_predict.py (used from a config file by path)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from toys import Blobs  # noqa: E402


def blobs_37(**_) -> Blobs:
    """37 samples: not a multiple of 2 processes x batch 4, so shards and batches are uneven."""
    return Blobs(37, seed=3)


def compute_metrics(predictions, label_ids):
    return {
        "accuracy": (predictions.argmax(-1) == label_ids).float().mean().item(),
        "count": predictions.shape[0],
    }
