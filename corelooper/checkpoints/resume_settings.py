"""Settings that differ between a checkpoint and the run resuming it: applied, warned or refused.

A resume restores the optimizer and the scheduler, which carry the learning rate, weight decay and
epsilon they were built with, so a ``--set train.learning_rate=...`` would be silently undone (as
in HF Trainer). Instead every ``[train]`` key that differs from the checkpoint's ``config.toml``
is, in one line each: applied (learning rate, weight decay and epsilon by ``apply``; every key
read afresh each step), warned (``GEOMETRY``: not the same batches) or refused (``REFUSED``: what
the restored state fixes; a ConfigError naming the key). docs/checkpoints.md lists them.
"""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError

logger = logging.getLogger("corelooper")

REFUSED = (
    "optim",
    "optim_args",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "lr_multipliers",
    "seed",
    "mixed_precision",
)
GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps")
IGNORED = ("output_dir", "overwrite_output_dir", "resume_from_checkpoint", "disable_tqdm", "run_name")


def _saved_config(directory: Path) -> dict[str, Any] | None:
    """The checkpoint's ``config.toml``, or None when it has none."""
    from ..config import tomllib  # tomli on Python 3.10

    path = Path(directory) / "config.toml"
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} is unreadable ({type(e).__name__}: {e}). Resume from "
            "another checkpoint."
        ) from None


def saved_train(directory: Path) -> dict[str, Any]:
    return (_saved_config(directory) or {}).get("train", {})


def saved_sections(directory: Path) -> set[str]:
    """The top-level sections of the checkpoint's ``config.toml`` (empty when it has none)."""
    return set(_saved_config(directory) or ())


def check_same_model(config, directory: Path) -> None:
    """An output_dir of another run: its [model] section differs from this config's."""
    saved = _saved_config(directory)
    if saved is None or not config.model.factory:
        return
    saved = saved.get("model", {})
    mine = {"factory": config.model.factory, "args": config.model.args}
    diffs = [
        f"model.{k}: checkpoint {saved.get(k)!r} vs config {v!r}"
        for k, v in mine.items()
        if saved.get(k, {} if k == "args" else None) != v
    ]
    if diffs:
        raise CheckpointError(
            f"Checkpoint {str(directory)!r} belongs to a different run ({'; '.join(diffs)}). Resume "
            "with the config it was trained with, or choose another train.output_dir."
        )


def _differs(old, new) -> bool:
    if isinstance(old, float) and isinstance(new, float) and math.isnan(old) and math.isnan(new):
        return False
    return old != new


def _shown(value) -> str:
    """As the config writes it: ``2``, not ``2.0`` (num_train_epochs is a float)."""
    return repr(int(value)) if isinstance(value, float) and value.is_integer() else repr(value)


def compare(config, directory: Path, saved_state: dict[str, Any], state) -> list[str]:
    """Refuse, warn or log each differing ``[train]`` key; returns the applied ones' lines."""
    saved = saved_train(directory)
    if not saved:
        return []  # a checkpoint without its config: nothing to compare with
    current = {k: v for k, v in vars(config.train).items() if not k.startswith("_")}
    changed = {
        k: (saved.get(k), v) for k, v in current.items() if k not in IGNORED and _differs(saved.get(k), v)
    }
    refused = [
        f"train.{k} {_shown(old)} -> {_shown(new)}" for k, (old, new) in changed.items() if k in REFUSED
    ]
    if refused:
        raise ConfigError(
            f"Resuming {str(directory)!r} with changed settings the checkpoint fixes: {'; '.join(refused)}. "
            "The restored optimizer, scheduler and RNG state were built with the old values; drop "
            "these overrides, or start a new run from the checkpoint's model.safetensors."
        )
    geometry = [f"{k} {old} -> {new}" for k, (old, new) in changed.items() if k in GEOMETRY]
    world = saved_state.get("world_size", 1)
    if world != state.world_size:
        geometry.append(f"world_size {world} -> {state.world_size}")
    saved_global = (
        saved_state.get("train_batch_size", 0) * saved_state.get("gradient_accumulation_steps", 1) * world
    )
    now_global = (
        config.train.per_device_train_batch_size * config.train.gradient_accumulation_steps * state.world_size
    )
    if (
        geometry and saved_global != now_global
    ):  # the same global batch: a resume_position provider resumes exactly
        warnings.warn(
            f"Resuming with a different batch geometry ({', '.join(geometry)}): training continues "
            "from the checkpoint, but not with the batches an uninterrupted run would have seen.",
            stacklevel=3,
        )
    lines = [
        f"resume: train.{k} {_shown(old)} -> {_shown(new)} (applied)"
        for k, (old, new) in changed.items()
        if k not in GEOMETRY
    ]
    for line in lines:
        logger.warning(line)
    return lines


def apply(config, saved_train: dict[str, Any], optimizer, scheduler) -> None:
    """Write the run's learning rate, weight decay and epsilon over the restored optimizer's (the LR
    scaled by new/old in every group and the scheduler's base LRs: lr_multipliers and the schedule's
    position are kept)."""
    new = config.train
    old_lr = saved_train.get("learning_rate")
    if old_lr and _differs(old_lr, new.learning_rate):
        ratio = new.learning_rate / old_lr
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] = group[key] * ratio
        for attr in ("base_lrs", "_last_lr"):
            if isinstance(getattr(scheduler, attr, None), list):
                setattr(scheduler, attr, [v * ratio for v in getattr(scheduler, attr)])
    for key, group_key in (("weight_decay", "weight_decay"), ("adam_epsilon", "eps")):
        old, value = saved_train.get(key), getattr(new, key)
        if old is None or not _differs(old, value):
            continue
        for group in optimizer.param_groups:
            if group_key in group and group[group_key] == old:  # groups without decay keep 0.0
                group[group_key] = value
