"""corelooper-peft: parameter-efficient fine-tuning with Hugging Face ``peft``.

Inert unless the config has a ``[peft]`` section. Then, when the loop is built, the model is
wrapped with ``peft.get_peft_model`` (only the adapter trains: the optimizer sees only parameters
with ``requires_grad``), the trainable-parameter count is logged when training begins, and every
checkpoint and the final export hold only the adapter (``adapter_model.safetensors`` +
``adapter_config.json``, loadable with ``PeftModel.from_pretrained``); the core's checkpoint loader
loads such adapters back in place on resume. ``merge_on_export = true`` also writes the merged
full model (adapter folded into the base weights) to ``output_dir/<merged_dir>``.

Any PEFT method works through its config class: ``method`` is the PEFT type (``lora``, ``ia3``,
``loha``, ``lokr``, ``adalora``, ``boft``, ``vera``, ``prefix_tuning``, ...) and ``[peft.config]``
holds that config's keyword arguments (``r``, ``lora_alpha``, ``target_modules``, ...).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from corelooper import hookimpl
from corelooper.errors import ConfigError

__version__ = "0.2.0"

logger = logging.getLogger("corelooper.peft")
SECTION = "peft"


@hookimpl
def corelooper_config_sections():
    return {
        SECTION: {
            "method": "lora",
            "task_type": "CAUSAL_LM",
            "config": {},
            "merge_on_export": False,
            "merged_dir": "merged",
        }
    }


def _active(loop) -> bool:
    return SECTION in loop.config.sections


def build_peft_config(section: dict):
    """The ``peft`` config object of ``section`` (errors name the key to fix)."""
    from peft import PEFT_TYPE_TO_CONFIG_MAPPING

    method = str(section["method"]).upper()
    if method not in PEFT_TYPE_TO_CONFIG_MAPPING:
        known = ", ".join(sorted(k.lower() for k in PEFT_TYPE_TO_CONFIG_MAPPING))
        raise ConfigError(f"peft.method = {section['method']!r} is not a PEFT method. Known: {known}.")
    kwargs = dict(section["config"] or {})
    if section["task_type"]:
        kwargs.setdefault("task_type", section["task_type"])
    config_class = PEFT_TYPE_TO_CONFIG_MAPPING[method]
    try:
        return config_class(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"[peft.config] is not valid for {config_class.__name__} (peft.method = "
            f"{section['method']!r}): {e}."
        ) from None


def wrap(model, section: dict):
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        return model
    config = build_peft_config(section)
    try:
        return get_peft_model(model, config)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"peft could not wrap {type(model).__name__} with {type(config).__name__}: {e}. Set "
            "[peft.config] target_modules to names of the model's layers (e.g. ['q_proj', 'v_proj'])."
        ) from None


@hookimpl
def on_init_end(loop):
    if _active(loop):
        loop.model = wrap(loop.model, loop.config.section(SECTION))


@hookimpl
def on_train_begin(loop, state):
    if not _active(loop):
        return
    model = loop.backend.unwrap_model(loop.model)
    trainable, total = model.get_nb_trainable_parameters()
    logger.info("peft: %d of %d parameters train (%.4f%%)", trainable, total, 100 * trainable / total)
    loop.log({"trainable_params": trainable, "all_params": total,
              "trainable_percent": round(100 * trainable / total, 4)})


@hookimpl
def on_train_end(loop, state):
    if not _active(loop):
        return
    section = loop.config.section(SECTION)
    if section["merge_on_export"] and state.is_world_process_zero:
        export_merged(loop.backend.unwrap_model(loop.model), Path(loop.args.output_dir) / section["merged_dir"])


def export_merged(peft_model, directory: Path) -> Path:
    """The base model with the adapter folded into its weights (the training model is untouched)."""
    merged = copy.deepcopy(peft_model).merge_and_unload()
    directory.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(directory)
    return directory
