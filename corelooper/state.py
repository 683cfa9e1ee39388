"""What the loop knows (``LoopState``) and what plugins ask of it (``Control``), as in HF."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopState:
    """Facts about the run. Saved as ``loop_state.json`` in every checkpoint."""

    global_step: int = 0
    """Optimizer steps done (already incremented when ``on_step_end`` fires)."""
    epoch: float = 0.0
    """Epochs done, fractional within an epoch."""
    max_steps: int = 0
    num_train_epochs: int = 0
    steps_per_epoch: int = 0
    """Optimizer steps in one epoch (0 when the data has no length)."""
    step_in_epoch: int = 0
    """Optimizer steps done in the current epoch: where a resume continues."""
    micro_batches_in_epoch: int = 0
    """Micro-batches consumed in the current epoch (index-level skip on resume)."""
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int = 0
    """Per-device micro-batch size."""
    gradient_accumulation_steps: int = 1
    num_input_tokens_seen: int = 0
    total_samples_seen: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True
    world_size: int = 1
    preempted: bool = False
    """True when a SIGTERM/SIGINT ended training early (set before ``on_train_end``)."""
    stop_signal: int | None = None
    """The signal number that stopped training (the CLI exits with 128 + it)."""
    plugin_states: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("plugin_states")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class Control:
    """Intents for the loop, set by the builtin flow logic and by plugins (HF semantics).

    The loop acts on ``should_log``/``should_evaluate``/``should_save`` after ``on_step_end`` and
    ``on_epoch_end`` and resets them; ``should_training_stop`` ends training after the current
    optimizer step; ``should_epoch_stop`` ends the current epoch.
    """

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False
