"""From a drop-in ``Trainer`` to a config: the ``[train]`` table for its ``TrainingArguments``.

``Trainer.export_config("config.toml")`` (or ``corelooper hf-export-config training_args.json``
on the ``training_args.json`` that ``save_model`` writes, or any ``args.to_json_string()``)
writes the arguments that differ from ``TrainingArguments``' defaults, under their HF names
(corelooper's ``[train]`` keys), with a ``[model]`` / ``[data]`` skeleton to fill in: the next
step from a script to ``corelooper run config.toml`` and plugins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Written by to_dict() but meaningless in a config (set per process, or by the launcher).
NOT_SETTINGS = frozenset({"local_rank", "hub_token", "logging_dir"})
SKELETON = """
# The model and data your script built in Python: name a `module:callable` that returns each
# (or, with corelooper-hf, a model folder and data files). See README.md, "Run from a config".
# [model]
# factory = "mypkg.model:build"           # or: name_or_path = "models/my-model"
# [data]
# train = "mypkg.data:train_set"          # or: train = "data/train.jsonl"
# eval = "mypkg.data:eval_set"
"""


def changed_arguments(values: dict[str, Any]) -> dict[str, Any]:
    """The ``TrainingArguments.to_dict()`` values that differ from a default ``TrainingArguments``."""
    from transformers import TrainingArguments

    defaults = TrainingArguments(output_dir=values.get("output_dir") or "trainer_output").to_dict()
    changed = {}
    for key, value in values.items():
        if key in NOT_SETTINGS or key not in defaults or value == defaults[key] or value is None:
            continue
        changed[key] = value
    changed["output_dir"] = values.get("output_dir") or "trainer_output"
    return dict(sorted(changed.items()))


def config_text(values: dict[str, Any]) -> str:
    """The TOML text: ``[train]`` with the changed arguments, then the model/data skeleton."""
    from corelooper.config import dumps_toml

    return dumps_toml({"train": changed_arguments(values)}) + SKELETON


def export_config(args, path: str | Path) -> Path:
    """Write the config for ``args`` (a ``TrainingArguments``) to ``path``; returns the path."""
    path = Path(path)
    path.write_text(config_text(args.to_dict()))
    return path


def export_from_json(source: str | Path, path: str | Path) -> Path:
    """The same from a ``training_args.json`` (``save_model``) or ``args.to_json_string()`` file."""
    from corelooper.errors import ConfigError

    try:
        values = json.loads(Path(source).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{source}: cannot read TrainingArguments as JSON ({e}).") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a JSON object of TrainingArguments fields.")
    path = Path(path)
    path.write_text(config_text(values))
    return path
