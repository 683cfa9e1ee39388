"""Build the DeepSpeed config dict from corelooper's [train] and [deepspeed] sections.

corelooper owns batch size, accumulation, clipping, precision, optimizer and scheduler; the
DeepSpeed config owns sharding. Where DeepSpeed has a default that would silently change the
numbers (gradient_clipping = 1.0), the value is always written explicitly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from corelooper.errors import ConfigError


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_json(ref: str, base: Path | None) -> dict[str, Any]:
    path = Path(ref)
    if not path.is_absolute() and base is not None and (base / path).exists():
        path = base / path
    if not path.is_file():
        raise ConfigError(f"deepspeed.config = {ref!r}: no such file (looked in {str(path.parent)!r}).")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed.config = {ref!r} is not valid JSON: {e}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed.config = {ref!r} must hold a JSON object.")
    return data


def build(args, section: dict, world_size: int, on_cuda: bool, base: Path | None = None) -> dict:
    """The dict passed to ``deepspeed.initialize(config=...)``."""
    stage = section.get("zero_stage", 2)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed.zero_stage = {stage!r}: use 0, 1, 2 or 3.")
    zero: dict[str, Any] = {"stage": stage}
    for key in ("offload_optimizer", "offload_param"):
        device = section.get(key, "none")
        if device not in ("none", "cpu"):
            raise ConfigError(f'deepspeed.{key} = {device!r}: use "none" or "cpu" (nvme: in the JSON file).')
        if device == "cpu":
            zero[key] = {"device": "cpu", "pin_memory": on_cuda}
    if "offload_param" in zero and stage != 3:
        raise ConfigError('deepspeed.offload_param = "cpu" needs deepspeed.zero_stage = 3.')
    if "offload_optimizer" in zero and stage == 0:
        raise ConfigError('deepspeed.offload_optimizer = "cpu" needs deepspeed.zero_stage 1, 2 or 3.')

    micro, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    ours: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": ga,
        "train_batch_size": micro * ga * world_size,
        # DeepSpeed clips at 1.0 when this key is absent: always say what corelooper means.
        "gradient_clipping": float(args.max_grad_norm) if args.max_grad_norm > 0 else 0.0,
        "bf16": {"enabled": args.mixed_precision == "bf16"},
        "fp16": {"enabled": args.mixed_precision == "fp16"},
        # The loop calls backward once per micro-batch and step() once per optimizer step.
        "managed_gradient_accumulation": False,
        # corelooper's optimizer (AdamW or a plugin's) runs inside ZeRO; no JIT-built ops.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    config = _merge(ours, {"zero_optimization": zero})
    if section.get("extra"):  # a table, e.g. HF's TrainingArguments(deepspeed={...}): as a file's keys
        config = _apply_file(config, ours, section["extra"], "train.deepspeed / deepspeed.extra")
    if section.get("config"):
        config = _apply_file(config, ours, read_json(section["config"], base), section["config"])
    return config


def _without_auto(data):
    """HF's ``"auto"`` values below the top level (bucket sizes HF derives from the model's hidden
    size, ...) left out: DeepSpeed's defaults apply. The top-level ones are filled from [train]."""
    if isinstance(data, dict):
        return {k: _without_auto(v) for k, v in data.items() if v != "auto"}
    return data


def _apply_file(config: dict, ours: dict, data: dict, ref: str) -> dict:
    for key in ("optimizer", "scheduler"):
        if key in data:
            raise ConfigError(
                f"deepspeed.config = {ref!r} has an {key!r} section. corelooper builds the "
                f"{key} (train.learning_rate, lr_scheduler_type, ... or a plugin's create_{key} "
                "hook), so the numbers match every backend: remove it from the JSON file."
            )
    data = copy.deepcopy(data)
    for key, value in ours.items():
        if isinstance(data.get(key), dict):
            data[key] = {k: v for k, v in data[key].items() if v != "auto"} or "auto"
        given = data.get(key)
        if given is None or given == "auto":
            data.pop(key, None)
            continue
        if isinstance(value, dict):
            enabled = given.get("enabled", False) if isinstance(given, dict) else given
            if enabled not in ("auto", value["enabled"]):
                raise ConfigError(
                    f"deepspeed.config = {ref!r} sets {key}.enabled = {enabled!r}, but "
                    f"train.mixed_precision says {value['enabled']!r}: set train.mixed_precision "
                    'instead (or write "auto" in the JSON file).'
                )
            continue
        if key in (
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "train_batch_size",
            "gradient_clipping",
        ) and float(given) != float(value):
            raise ConfigError(
                f"deepspeed.config = {ref!r} sets {key} = {given!r}, but corelooper's [train] "
                f'gives {value!r}. Write "auto" in the JSON file (filled from [train], also when a '
                "resume on another number of processes changes the accumulation to keep the global "
                "batch), or set it in [train] (per_device_train_batch_size, "
                "gradient_accumulation_steps, max_grad_norm)."
            )
    return _merge(config, _without_auto({k: v for k, v in data.items() if k not in ("bf16", "fp16")}))
