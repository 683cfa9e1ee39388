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
from corelooper.transforms import MODEL_WRAP, order

__version__ = "0.2.0"

logger = logging.getLogger("corelooper.peft")
SECTION = "peft"


@hookimpl
def corelooper_configure(config, plugins):
    from corelooper.builtin.console import quiet_library

    quiet_library("peft")  # peft's deprecation notices for its own calls (shown with --verbose)
    plugins.section_or_inactive(config, "peft")  # `corelooper plugins --config` says why


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
@order(MODEL_WRAP)
def transform_model(loop, config, model):
    """Wrap the model before the backend is created (as TRL does before the Accelerator), after
    any ``MODEL_PATCH`` transform of the base model; data transforms (SFT) see the wrapped one."""
    if SECTION not in config.sections:
        return None
    wrapped = wrap(model, config.section(SECTION))
    route_adapter_loads(loop, wrapped)
    return wrapped


@hookimpl(trylast=True)  # after the console's "training N steps" line
def on_train_begin(loop, state):
    if not _active(loop):
        return
    model = loop.backend.unwrap_model(loop.model)
    trainable, total = model.get_nb_trainable_parameters()
    logger.info("peft: %d of %d parameters train (%.4f%%)", trainable, total, 100 * trainable / total)
    loop.log(
        {
            "trainable_params": trainable,
            "all_params": total,
            "trainable_percent": round(100 * trainable / total, 4),
        }
    )


@hookimpl
def on_train_end(loop, state):
    if not _active(loop):
        return
    section = loop.config.section(SECTION)
    # An interrupted run (SIGTERM/SIGINT) left a checkpoint, not a finished model: no export.
    if not section["merge_on_export"] or state.preempted:
        return
    directory = Path(loop.args.output_dir) / section["merged_dir"]
    backend = loop.backend
    model = backend.unwrap_model(loop.model)
    if getattr(backend, "shards_parameters", False):
        # ZeRO-3 / FSDP: each rank holds a shard; every rank takes part in the gather and the
        # main rank merges an unsharded copy rebuilt from the full weights.
        full = backend.model_state_dict(loop.model)
        if state.is_world_process_zero:
            export_merged(unsharded_copy(model, full), directory, run_tokenizer(loop))
    elif state.is_world_process_zero:
        export_merged(model, directory, run_tokenizer(loop))
    if state.is_world_process_zero:
        logger.warning("peft: the merged model (adapter folded into the base weights) is in %s", directory)
    backend.wait_for_everyone()


def run_tokenizer(loop):
    """The run's tokenizer (with its chat template): the collator's, else the one in the folder
    the base model was loaded from (``[model] tokenizer`` first); None when there is none (a
    model built by a factory)."""
    for owner in (loop.data_collator, loop):
        tok = getattr(owner, "tokenizer", None) or getattr(owner, "processing_class", None)
        if hasattr(tok, "save_pretrained"):
            return tok
    model = loop.backend.unwrap_model(loop.model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    folders = [loop.config.model.tokenizer, getattr(getattr(base, "config", None), "_name_or_path", None)]
    for folder in (f for f in folders if f and Path(f).is_dir()):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(
                folder, local_files_only=True, trust_remote_code=loop.config.model.trust_remote_code
            )
        except (OSError, ValueError, KeyError, TypeError):  # no tokenizer files there
            continue
    return None


def unsharded_copy(peft_model, full_state: dict):
    """A plain (unsharded) PeftModel with ``full_state``'s weights: the same Hugging Face base
    architecture built from its config, the same adapter config."""
    from peft import get_peft_model

    base = peft_model.get_base_model()
    if not hasattr(base, "config"):
        raise ConfigError(
            f"peft.merge_on_export = true with a sharded backend needs a Hugging Face base model "
            f"(rebuilt from its config to merge); {type(base).__name__} is not one. Merge the "
            "exported adapter offline instead."
        )
    config = copy.deepcopy(peft_model.peft_config[peft_model.active_adapter])
    fresh = get_peft_model(type(base)(base.config), config)
    fresh.load_state_dict(full_state)
    return fresh


def route_adapter_loads(loop, peft_model) -> None:
    """Resuming loads the adapter in place (the core calls ``model.load_adapter``): send that
    through :func:`load_adapter_in_place`, so sharded backends (ZeRO-3, FSDP) get full tensors
    copied into their shards instead of peft's plain ``load_state_dict`` (which sees ZeRO-3's
    0-size placeholders). Loading a *new* adapter name keeps peft's own path."""
    peft_load = peft_model.load_adapter

    def load_adapter(model_id, adapter_name="default", is_trainable=False, **kwargs):
        if adapter_name in peft_model.peft_config and Path(model_id, ADAPTER_FILE).is_file():
            return load_adapter_in_place(loop, Path(model_id), adapter_name)
        return peft_load(model_id, adapter_name, is_trainable=is_trainable, **kwargs)

    peft_model.load_adapter = load_adapter


ADAPTER_FILE = "adapter_model.safetensors"


def load_adapter_in_place(loop, directory: Path, adapter_name: str = "default") -> None:
    """Restore ``directory``'s adapter weights into the training model, on every backend.

    peft maps the saved names to the model's (its ``set_peft_model_state_dict``, run on index
    placeholders with the final ``load_state_dict`` captured: peft would otherwise turn values
    into DTensor shards itself); the backend copies the real tensors (gathering ZeRO-3
    partitions, scattering FSDP shards). A bad file or tensor is a CheckpointError naming it.
    """
    import torch
    from peft import set_peft_model_state_dict

    from corelooper.errors import CheckpointError

    path = directory / ADAPTER_FILE
    weights = _read_adapter(path)
    names = list(weights)
    model = loop.backend.unwrap_model(loop.model)
    mapped: dict = {}

    def capture(state_dict, strict=True, assign=False):
        mapped.update(state_dict)
        return _no_incompatible_keys()

    model.load_state_dict = capture  # peft maps the names; the backend does the copying
    try:
        set_peft_model_state_dict(
            model, {k: torch.tensor(i) for i, k in enumerate(names)}, adapter_name=adapter_name
        )
    except (KeyError, ValueError, RuntimeError, IndexError) as e:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r}: peft could not map its tensors: {e}."
        ) from None
    finally:
        del model.load_state_dict
    mapped = {k: weights[names[int(v)]] if v.dim() == 0 else v for k, v in mapped.items()}
    _check_adapter_tensors(model, mapped, path, adapter_name)
    loop.backend.load_model_state_dict(loop.model, mapped, strict=False)


def _read_adapter(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from corelooper.errors import CheckpointError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} is unreadable (truncated or corrupt?): {e}."
        ) from None


def _no_incompatible_keys():
    from torch.nn.modules.module import _IncompatibleKeys

    return _IncompatibleKeys([], [])


def _check_adapter_tensors(model, mapped: dict, path: Path, adapter_name: str) -> None:
    """Every trainable adapter tensor present with the model's shape (ZeRO-3: ``ds_shape``)."""
    from corelooper.errors import CheckpointError

    params = dict(model.named_parameters())
    expected = {
        n: tuple(getattr(p, "ds_shape", None) or p.shape)
        for n, p in params.items()
        if f".{adapter_name}." in n or n.endswith(f".{adapter_name}")
    }
    wrong = [
        f"{k}: file {tuple(v.shape)} vs model {expected[k]}"
        for k, v in mapped.items()
        if k in expected and tuple(v.shape) != expected[k]
    ]
    unknown = sorted(k for k in mapped if k not in params and k not in dict(model.named_buffers()))
    missing = sorted(k for k in expected if k not in mapped)
    if wrong or unknown or missing:
        parts = (
            ([f"shape mismatch {'; '.join(wrong[:3])}"] if wrong else [])
            + ([f"not in the model: {unknown[:3]}"] if unknown else [])
            + ([f"missing from the file: {missing[:3]}"] if missing else [])
        )
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} does not fit the model's adapter {adapter_name!r} "
            f"({', '.join(parts)}). It was saved with another [peft] config or base model: resume "
            "with the config it was trained with."
        )


def export_merged(peft_model, directory: Path, tokenizer=None) -> Path:
    """The base model with the adapter folded into its weights (the training model is untouched),
    as a complete Hugging Face folder: weights, config, generation config, and the tokenizer with
    its chat template, so ``from_pretrained`` and ``corelooper eval`` load it as it is."""
    merged = copy.deepcopy(peft_model).merge_and_unload()
    directory.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(directory)
    generation = getattr(merged, "generation_config", None)
    if generation is not None and not (directory / "generation_config.json").exists():
        generation.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory
