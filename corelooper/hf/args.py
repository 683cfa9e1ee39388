"""Every Hugging Face ``TrainingArguments`` name, and what it means in corelooper.

A ``[train]`` key (or a ``TrainArgs(...)`` keyword) that is not a corelooper field is looked up
here, in this order:

* ``MAPPED``: accepted and translated (``bf16 = true`` -> ``mixed_precision = "bf16"``,
  4.x names -> their 5.x field, with a note);
* ``UNSUPPORTED``: the values that are no-ops here are accepted (HF's default where it is
  corelooper's behaviour); any other value is refused with the corelooper way to do it, or with
  why it is not supported;
* a name an installed plugin answers to (its ``corelooper_settings``): translated by the plugin
  into its section (``load_plugins`` refuses it when that plugin is not loaded);
* otherwise the key is unknown, and the error offers the closest corelooper name.

This module imports nothing heavy: ``corelooper --help`` loads it.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, PluginError


class HFNameNote(FutureWarning):
    """A Transformers 4.x name was translated to its 5.x (corelooper) name."""


@dataclass
class Translation:
    """What the HF names of one ``[train]`` table become."""

    train: dict[str, Any]
    """corelooper ``[train]`` values."""
    sections: dict[str, dict[str, Any]]
    """Plugin section values (an HF name a plugin answers to -> ``{"section": {"key": ...}}``)."""
    notes: list[str]
    plugin_values: dict[str, Any] = field(default_factory=dict)
    """The HF names that plugins translated, as written (``load_plugins`` checks their plugin)."""


Mapper = Callable[[Any, Translation], None]


def _set(tr: Translation, key: str, value: Any, hf_name: str) -> None:
    if key in tr.train and tr.train[key] != value:
        raise ConfigError(
            f"train.{hf_name} = {value!r} contradicts train.{key} = {tr.train[key]!r}: set only one."
        )
    tr.train[key] = value


def _renamed(new: str) -> Mapper:
    """Another name of a corelooper field (``None``: HF's unset, ignored)."""

    def mapper(value: Any, tr: Translation, old: str = "") -> None:
        if value is not None:  # HF's "unset"
            _set(tr, new, value, old)

    return mapper


def _precision(dtype: str) -> Mapper:
    def mapper(value: Any, tr: Translation, old: str = "") -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"train.{old} must be true or false, got {value!r}.")
        if value:
            _set(tr, "mixed_precision", dtype, old)

    return mapper


def _sampling_from_group_by_length(value: Any, tr: Translation, old: str = "") -> None:
    if value:
        _set(tr, "train_sampling_strategy", "group_by_length", old)


def _accept(value: Any, tr: Translation, old: str = "") -> None:
    """Accepted as a no-op: HF's Trainer does not read it either, or it is always on here."""


# Transformers 4.x names (removed or renamed in 5.x): name -> (mapper, what it becomes), with a FutureWarning
FOUR_X: dict[str, tuple[Mapper, str]] = {
    "evaluation_strategy": (_renamed("eval_strategy"), "eval_strategy"),
    "warmup_ratio": (_renamed("warmup_steps"), "warmup_steps (a float < 1 is a ratio)"),
    "group_by_length": (_sampling_from_group_by_length, 'train_sampling_strategy = "group_by_length"'),
    "no_cuda": (_renamed("use_cpu"), "use_cpu"),
    "per_gpu_train_batch_size": (_renamed("per_device_train_batch_size"), "per_device_train_batch_size"),
    "per_gpu_eval_batch_size": (_renamed("per_device_eval_batch_size"), "per_device_eval_batch_size"),
    "include_tokens_per_second": (_accept, "nothing: tokens_per_second is always logged for token batches"),
    "torchdynamo": (_renamed("torch_compile_backend"), "torch_compile_backend"),
}
MAPPED: dict[str, tuple[Mapper, str]] = {
    "bf16": (_precision("bf16"), 'mixed_precision = "bf16"'),
    "fp16": (_precision("fp16"), 'mixed_precision = "fp16"'),
    "activation_checkpointing": (_renamed("gradient_checkpointing"), "gradient_checkpointing"),
    "do_train": (_accept, "nothing: HF's Trainer does not read it either (use `corelooper run`)"),
    "do_eval": (_accept, "nothing: HF's Trainer does not read it either (use `corelooper eval`)"),
    "do_predict": (_accept, "nothing: HF's Trainer does not read it either (use `corelooper predict`)"),
    "restore_callback_states_from_checkpoint": (
        _accept,
        "nothing: plugin state registered for checkpointing is always restored",
    ),
    "enable_jit_checkpoint": (_accept, "nothing: a SIGTERM/SIGINT always writes a checkpoint (exit 143/130)"),
    "log_on_each_node": (_accept, "nothing: only global rank 0 logs"),
    **FOUR_X,
}
# HF options a plugin answers to (its corelooper_settings declares the name), with HF's defaults:
# where no installed plugin declares one, its default is accepted (TrainingArguments().to_dict()
# holds every name) and another value asks for the plugin; docs/trainer-options.md names the package
# of each (the core never names a plugin). Static: no plugin is imported to learn this.
PLUGIN_OPTIONS: dict[str, tuple] = {
    "auto_find_batch_size": (False,),
    "deepspeed": (None,),
    "fsdp": (None, "", []),
    "fsdp_config": (None, {}),
    "use_liger_kernel": (False,),
    "liger_kernel_config": (None,),
    "neftune_noise_alpha": (None,),
    "logging_dir": (None,),
}
# Names from other tools: refused with the HF name (a user of them must learn it).
OTHER_TOOLS = {
    "lr": "learning_rate",
    "batch_size": "per_device_train_batch_size",
    "epochs": "num_train_epochs",
}


@dataclass(frozen=True)
class Unsupported:
    why: str
    """The corelooper way to do it, or why it is not supported."""
    accepts: tuple = ()
    """Values that are no-ops here (HF's default, where that is corelooper's behaviour)."""


_HUB = Unsupported(
    "Hub upload is not built in: upload output_dir after training (`hf upload REPO runs/x`) or in an "
    "on_save plugin.",
    (False, None, "every_save", "huggingface"),
)
_TRACKIO = Unsupported(
    "trackio has no corelooper plugin; `corelooper plugins` lists the installed loggers (train.report_to).",
    (None,),
)
_FULL_EVAL = Unsupported("evaluation runs in train.mixed_precision; the model is not cast for it.", (False,))
_DL = "the loader is rebuilt each epoch from seeded indices, so a resume is exact"

# HF's AcceleratorConfig() as TrainingArguments.to_dict() writes it: what corelooper's Accelerator does.
_HF_ACCELERATOR_DEFAULTS = {
    "split_batches": False,
    "dispatch_batches": None,
    "even_batches": True,
    "use_seedable_sampler": True,
    "non_blocking": False,
    "gradient_accumulation_kwargs": None,
}
# HF fields that take a dict or its JSON text (HF parses the text in TrainingArguments).
# (So are the fields plugins answer to: ``declared_train_fields``.)
_JSON_DICT_FIELDS = frozenset(
    {"lr_scheduler_kwargs", "accelerator_config", "gradient_checkpointing_kwargs", "optim_args"}
)

UNSUPPORTED: dict[str, Unsupported] = {
    "optim_target_modules": Unsupported(
        "GaLore/APOLLO optimizers are not built in: provide one with a create_optimizer plugin.", (None,)
    ),
    "average_tokens_across_devices": Unsupported(
        "corelooper always normalises the loss by the token count summed over all processes, so results do "
        "not depend on the number of processes.",
        (True,),
    ),
    "bf16_full_eval": _FULL_EVAL,
    "fp16_full_eval": _FULL_EVAL,
    "activation_checkpointing_kwargs": Unsupported(
        "gradient_checkpointing_kwargs are not supported: corelooper enables it with use_reentrant=False; "
        "call model.gradient_checkpointing_enable(...) in model.factory for other options.",
        (None, {}),
    ),
    "gradient_checkpointing_kwargs": Unsupported(
        "not supported: corelooper enables it with use_reentrant=False; call "
        "model.gradient_checkpointing_enable(...) in model.factory for other options.",
        (None, {}),
    ),
    "torch_empty_cache_steps": Unsupported(
        "not supported: emptying the CUDA cache every N steps only slows training; against fragmentation "
        "use PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
        (None,),
    ),
    "log_level": Unsupported(
        "corelooper's console is quiet by design; set Python logging levels yourself "
        "(logging.getLogger('transformers')).",
        ("passive",),
    ),
    "log_level_replica": Unsupported(
        "only rank 0 speaks; other ranks print nothing.", ("warning", "passive")
    ),
    "project": Unsupported(
        "trackio has no corelooper plugin; a logging plugin takes its project in its own "
        "section (`corelooper plugins` lists them).",
        ("huggingface",),
    ),
    "trackio_space_id": _TRACKIO,
    "trackio_bucket_id": _TRACKIO,
    "trackio_static_space_id": _TRACKIO,
    "prediction_loss_only": Unsupported(
        "evaluation keeps the model outputs only when metrics are computed: give no compute_metrics "
        "and only the loss is computed (what prediction_loss_only = true does).",
        (False,),
    ),
    "eval_do_concat_batches": Unsupported(
        "predictions are always concatenated (shorter ones padded with -100).", (True,)
    ),
    "eval_use_gather_object": Unsupported(
        "not supported: predictions are tensors, gathered across processes with padding.", (False,)
    ),
    "include_for_metrics": Unsupported(
        "compute_metrics receives predictions and label_ids; to use inputs or losses, collect them in an "
        "on_prediction_step plugin (it receives the batch and the outputs).",
        ([], None),
    ),
    "include_inputs_for_metrics": Unsupported(
        "4.x name of include_for_metrics: collect inputs in an on_prediction_step plugin.", (False,)
    ),
    "save_only_model": Unsupported(
        "not supported: a checkpoint always holds what an exact resume needs (optimizer, scheduler, RNG); "
        "the final model alone is output_dir/model.safetensors.",
        (False,),
    ),
    "save_safetensors": Unsupported("weights are always written as safetensors.", (True,)),
    "save_on_each_node": Unsupported(
        "rank 0 writes checkpoints: in multi-node runs output_dir must be on a shared filesystem.", (False,)
    ),
    "push_to_hub": _HUB,
    # to_dict() writes any token as "<HUB_TOKEN>": accepted, since no upload is ever made here
    "hub_token": Unsupported(_HUB.why, (*_HUB.accepts, "<HUB_TOKEN>")),
    "hub_private_repo": _HUB,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "full_determinism": Unsupported(
        "not built in: runs are seeded (seed, data_seed) and resume bitwise; for deterministic kernels "
        "call torch.use_deterministic_algorithms(True) in model.factory.",
        (False,),
    ),
    "accelerator_config": Unsupported(
        "corelooper builds its own Accelerator; to change it, return your own backend from a "
        "create_backend plugin.",
        (None, {}, _HF_ACCELERATOR_DEFAULTS),
    ),
    "parallelism_config": Unsupported(
        "use --nproc N (data parallel), or the section of a sharding plugin (`corelooper plugins`).", (None,)
    ),
    "dataloader_persistent_workers": Unsupported(f"not supported: {_DL}.", (False,)),
    "dataloader_prefetch_factor": Unsupported(f"not supported: {_DL}; torch's default (2) is used.", (None,)),
    "dataloader_multiprocessing_context": Unsupported(
        "not supported: workers start with the platform's default method.", (None,)
    ),
    "dataloader_in_order": Unsupported("batches are always yielded in order.", (True,)),
    "label_names": Unsupported(
        "labels are batch['labels'] (or the last element of a tuple sample): rename the column in the "
        "dataset or the collator, or implement compute_loss.",
        (None, ["labels"]),
    ),
    "ddp_backend": Unsupported(
        "the process group uses gloo on CPU and nccl on GPU; another backend needs a create_backend plugin.",
        (None,),
    ),
    "debug": Unsupported(
        "HF's debug options (underflow_overflow, tpu_metrics_debug) are not supported.", ("", [], None)
    ),
    "skip_memory_metrics": Unsupported("memory metrics are not logged.", (True,)),
    "local_rank": Unsupported("set by the launcher (torchrun / `corelooper run --nproc N`).", (-1,)),
    "half_precision_backend": Unsupported("4.x: mixed precision is train.mixed_precision.", ("auto",)),
    "fp16_opt_level": Unsupported('4.x apex option: not supported (use mixed_precision = "fp16").', ("O1",)),
    "fp16_backend": Unsupported("4.x: mixed precision is train.mixed_precision.", ("auto",)),
    "use_mps_device": Unsupported(
        "4.x: the device is chosen by accelerate (use_cpu to force the CPU).", (False,)
    ),
    "jit_mode_eval": Unsupported("4.x: not supported (use torch_compile).", (False,)),
    "use_ipex": Unsupported("4.x: not supported.", (False,)),
}


def _same(value: Any, accepted: Any) -> bool:
    return type(value) is type(accepted) and value == accepted or (value is None and accepted is None)


def translate(raw: dict[str, Any], known: set[str]) -> Translation:
    """corelooper ``[train]`` values, plugin-section values and notes for ``raw`` (HF names allowed).

    Raises ``ConfigError`` for a refused HF name; unknown names are left for the caller.
    """
    raw = {k: _json_dict(k, v) for k, v in raw.items()}
    tr = Translation(train={k: v for k, v in raw.items() if k in known}, sections={}, notes=[])
    for key, value in raw.items():
        if key in known:
            continue
        if key in UNSUPPORTED:
            if not any(_same(value, ok) for ok in UNSUPPORTED[key].accepts):
                raise ConfigError(f"train.{key} = {value!r}: {UNSUPPORTED[key].why}")
        elif key in OTHER_TOOLS:
            raise ConfigError(f"Unknown key train.{key}. Did you mean {OTHER_TOOLS[key]}? (the HF name)")
        elif key in MAPPED:
            mapper, what = MAPPED[key]
            mapper(value, tr, old=key)
            if key in FOUR_X and value is not None:  # None: HF's "unset" (a 5.x to_dict() has them)
                note = f"train.{key} is a Transformers 4.x name, read as {what}."
                tr.notes.append(note)
                warnings.warn(note, HFNameNote, stacklevel=4)
        elif not _plugin_field(key, value, raw, tr):
            if key not in PLUGIN_OPTIONS:
                tr.train.setdefault(key, value)  # unknown: the caller names it with a hint
            elif not any(_same(value, ok) for ok in PLUGIN_OPTIONS[key]):
                raise ConfigError(
                    f"train.{key} = {value!r} is a Hugging Face option that a corelooper plugin answers to, "
                    "and none loaded for this run does: install the package docs/trainer-options.md names "
                    f"for it and do not block it, or remove train.{key} (HF's default needs no plugin)."
                )
    return tr


def _json_dict(key: str, value: Any) -> Any:
    """A dict field given as JSON text (``'{"num_cycles": 2}'``), read as HF reads it."""
    if not isinstance(value, str) or not value.lstrip().startswith("{"):
        return value
    if key not in _JSON_DICT_FIELDS and key not in declared_train_fields():
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"train.{key} = {value!r} is not valid JSON ({e}): write a table instead."
        ) from None


def _plugin_field(key: str, value: Any, raw: dict[str, Any], tr: Translation) -> bool:
    """Translate a name an installed plugin answers to into its section; False if none does."""
    declared = declared_train_fields().get(key)
    if not declared:
        return False
    tr.plugin_values[key] = value
    part = declared[0][1](value, raw)  # the first plugin by name, as for providers
    for section, values in (part or {}).items():
        tr.sections.setdefault(section, {}).update(values)
    return True


def settings_of(plugin: Any, name: str) -> dict[str, Any]:
    """What the plugin ``name`` declares with ``corelooper_settings`` (``{}`` for nothing); an
    exception there is blamed on it and the hook."""
    declare = getattr(plugin, "corelooper_settings", None)
    try:
        return (declare() or {}) if callable(declare) else {}
    except Exception as e:
        raise PluginError(
            f"Plugin {name!r} raised in hook 'corelooper_settings': {type(e).__name__}: {e}"
        ) from e


_DECLARED: tuple[tuple, dict] = ((), {})


def _imported(ep) -> Any:
    """While autoload is off, a plugin module the program imported itself (to pass it to the
    ``Loop``) declares its names too: reading them imports nothing. A blocked one never does."""
    from .. import _BLOCKED

    return None if ep.name in _BLOCKED[-1] or ep.attr else sys.modules.get(ep.module)


def declared_train_fields() -> dict[str, list[tuple[str, Callable]]]:
    """The ``[train]`` keys installed plugins answer to: key -> [(plugin, translate), ...], by
    plugin name. Each plugin is imported through the one loader (once; never a blocked one, nor
    any while autoload is off; an import error is its one paragraph)."""
    global _DECLARED
    from .. import installed_entry_points, load_installed

    loaded = [
        (ep.name, obj) for ep in installed_entry_points() if (obj := load_installed(ep) or _imported(ep))
    ]
    key = tuple((name, id(obj)) for name, obj in loaded)
    if _DECLARED[0] != key:
        found: dict[str, list[tuple[str, Callable]]] = {}
        for name, obj in loaded:
            for field_name, translate in settings_of(obj, name).get("train", {}).items():
                found.setdefault(field_name, []).append((name, translate))
        _DECLARED = (key, found)
    return _DECLARED[1]


def hf_names() -> list[str]:
    """Every HF name this module and the installed plugins know (candidates for "did you mean")."""
    return [*MAPPED, *OTHER_TOOLS, *UNSUPPORTED, *PLUGIN_OPTIONS, *declared_train_fields()]


def hf_hint(key: str) -> str | None:
    """What an HF name becomes here, for error messages (None: not an HF name)."""
    if key in MAPPED:
        return MAPPED[key][1]
    if key in OTHER_TOOLS:
        return OTHER_TOOLS[key]
    if key in UNSUPPORTED:
        return UNSUPPORTED[key].why
    declared = declared_train_fields().get(key)
    return f"the plugin {declared[0][0]!r} answers to it" if declared else None
