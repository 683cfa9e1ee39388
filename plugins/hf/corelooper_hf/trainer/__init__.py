"""The drop-in ``Trainer``: ``from corelooper_hf import Trainer`` in place of ``transformers.Trainer``."""

from __future__ import annotations

from .trainer import Trainer

__all__ = ["Trainer"]
