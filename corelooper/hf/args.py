"""Every Hugging Face ``TrainingArguments`` name, and what it means in corelooper.

A ``[train]`` key (or a ``TrainArgs(...)`` keyword) that is not a corelooper field is looked up
here, in this order:

* ``MAPPED``: accepted and translated (``bf16 = true`` -> ``mixed_precision = "bf16"``,
  ``deepspeed = "ds.json"`` -> ``[deepspeed] config``, 4.x names -> their 5.x field, with a note);
* ``UNSUPPORTED``: the values that are no-ops here are accepted (HF's default where it is
  corelooper's behaviour); any other value is refused with the corelooper way to do it, or with
  why it is not supported;
* otherwise the key is unknown, and the error offers the closest corelooper name.

This module imports nothing heavy: ``corelooper --help`` loads it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError


class HFNameNote(FutureWarning):
    """A Transformers 4.x name was translated to its 5.x (corelooper) name."""


@dataclass
class Translation:
    """What the HF names of one ``[train]`` table become."""

    train: dict[str, Any]
    """corelooper ``[train]`` values."""
    sections: dict[str, dict[str, Any]]
    """Plugin section values (``neftune_noise_alpha`` -> ``{"neftune": {"noise_alpha": ...}}``)."""
    notes: list[str]


Mapper = Callable[[Any, Translation], None]


def _set(tr: Translation, key: str, value: Any, hf_name: str) -> None:
    if key in tr.train and tr.train[key] != value:
        raise ConfigError(
            f"train.{hf_name} = {value!r} contradicts train.{key} = {tr.train[key]!r}: set only one."
        )
    tr.train[key] = value


def _section(tr: Translation, section: str, key: str, value: Any) -> None:
    tr.sections.setdefault(section, {})[key] = value


def _renamed(new: str, note: str = "") -> Mapper:
    """A 4.x (or other tools') name for a corelooper field."""

    def mapper(value: Any, tr: Translation, old: str = "") -> None:
        if value is not None:  # HF's "unset"
            _set(tr, new, value, old)

    mapper.new_name = new  # type: ignore[attr-defined]
    mapper.note = note  # type: ignore[attr-defined]
    return mapper


def _precision(dtype: str) -> Mapper:
    def mapper(value: Any, tr: Translation, old: str = "") -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"train.{old} must be true or false, got {value!r}.")
        if value:
            _set(tr, "mixed_precision", dtype, old)

    return mapper


def _bool_to(key: str, true_value: Any) -> Mapper:
    def mapper(value: Any, tr: Translation, old: str = "") -> None:
        if value:
            _set(tr, key, true_value, old)

    return mapper


def _neftune(value: Any, tr: Translation, old: str = "") -> None:
    if value is not None:
        _section(tr, "neftune", "noise_alpha", value)


# The switches of Liger's patch functions that [liger] has as keys of its own (the rest: [liger] extra).
_LIGER_SWITCHES = ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy")


def _use_liger_kernel(value: Any, tr: Translation, old: str = "") -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"train.use_liger_kernel must be true or false, got {value!r}.")
    if value or "liger" in tr.sections:  # false alone is HF's default: no section, nothing needed
        _section(tr, "liger", "enabled", value)


def _liger_kernel_config(value: Any, tr: Translation, old: str = "") -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError(
            f"train.liger_kernel_config must be a table of Liger's patch arguments (e.g. "
            f"{{ rope = true, fused_linear_cross_entropy = true }}), got {value!r}."
        )
    # As HF: the config alone (without use_liger_kernel = true) patches nothing.
    tr.sections.setdefault("liger", {}).setdefault("enabled", False)
    for key, v in value.items():
        if key in _LIGER_SWITCHES:
            _section(tr, "liger", key, v)
        else:
            tr.sections["liger"].setdefault("extra", {})[key] = v


def _deepspeed(value: Any, tr: Translation, old: str = "") -> None:
    if value is None:
        return
    if isinstance(value, str):
        _section(tr, "deepspeed", "config", value)
    elif isinstance(value, dict):
        _section(tr, "deepspeed", "extra", dict(value))
    else:
        raise ConfigError(f"train.deepspeed must be a DeepSpeed JSON file or a table, got {value!r}.")


# HF's `fsdp` option words and the [fsdp] keys they set.
_FSDP_WORDS = {
    "full_shard": ("reshard_after_forward", True),
    "shard_grad_op": ("reshard_after_forward", False),
    "offload": ("cpu_offload", True),
    "auto_wrap": None,  # corelooper always wraps (by [fsdp] wrap or the model's _no_split_modules)
}
# HF's fsdp_config keys and their [fsdp] names.
_FSDP_CONFIG = {
    "transformer_layer_cls_to_wrap": "wrap",
    "activation_checkpointing": "activation_checkpointing",
    "reshard_after_forward": "reshard_after_forward",
    "cpu_offload": "cpu_offload",
}


def _fsdp(value: Any, tr: Translation, old: str = "") -> None:
    if value in (None, "", False, []):
        return
    words = value.split() if isinstance(value, str) else list(value) if isinstance(value, list) else []
    if value is not True and not words:
        raise ConfigError(f"train.fsdp must be HF's option string (e.g. 'full_shard auto_wrap'), got {value!r}.")
    tr.sections.setdefault("fsdp", {})
    for word in words:
        if word not in _FSDP_WORDS:
            raise ConfigError(
                f"train.fsdp option {word!r} is not supported: corelooper-fsdp is FSDP2 ({', '.join(_FSDP_WORDS)}"
                "); hybrid sharding and no_shard have no FSDP2 equivalent here. See the [fsdp] section."
            )
        if _FSDP_WORDS[word]:
            _section(tr, "fsdp", *_FSDP_WORDS[word])


def _fsdp_config(value: Any, tr: Translation, old: str = "") -> None:
    if not value:
        return
    if not isinstance(value, dict):
        raise ConfigError(f"train.fsdp_config must be a table (HF reads a JSON file; write its keys here), got {value!r}.")
    for key, v in value.items():
        name = _FSDP_CONFIG.get(key.removeprefix("fsdp_"))
        if name is None:
            raise ConfigError(
                f"train.fsdp_config.{key} is not supported; the [fsdp] section has: wrap, "
                "reshard_after_forward, cpu_offload, param_dtype, reduce_dtype, activation_checkpointing, "
                "sharded_state."
            )
        _section(tr, "fsdp", name, list(v) if name == "wrap" and isinstance(v, list | tuple) else v)


def _sampling_from_group_by_length(value: Any, tr: Translation, old: str = "") -> None:
    if value:
        _set(tr, "train_sampling_strategy", "group_by_length", old)


def _logging_dir(value: Any, tr: Translation, old: str = "") -> None:
    if value:
        _section(tr, "tensorboard", "log_dir", value)


def _accept(value: Any, tr: Translation, old: str = "") -> None:
    """Accepted as a no-op: HF's Trainer does not read it either, or it is always on here."""


MAPPED: dict[str, tuple[Mapper, str]] = {
    # name: (mapper, what it becomes; 4.x names say so and get a FutureWarning)
    "bf16": (_precision("bf16"), 'mixed_precision = "bf16"'),
    "fp16": (_precision("fp16"), 'mixed_precision = "fp16"'),
    "neftune_noise_alpha": (_neftune, "[neftune] noise_alpha (the corelooper-neftune plugin)"),
    "use_liger_kernel": (_use_liger_kernel, "[liger] enabled (the corelooper-liger plugin)"),
    "liger_kernel_config": (_liger_kernel_config, "[liger] keys (the corelooper-liger plugin)"),
    "deepspeed": (_deepspeed, "[deepspeed] config (the corelooper-deepspeed plugin)"),
    "fsdp": (_fsdp, "the [fsdp] section (the corelooper-fsdp plugin, FSDP2)"),
    "fsdp_config": (_fsdp_config, "[fsdp] keys (the corelooper-fsdp plugin)"),
    "activation_checkpointing": (_renamed("gradient_checkpointing"), "gradient_checkpointing"),
    "do_train": (_accept, "nothing: HF's Trainer does not read it either (use `corelooper run`)"),
    "do_eval": (_accept, "nothing: HF's Trainer does not read it either (use `corelooper eval`)"),
    "do_predict": (_accept, "nothing: HF's Trainer does not read it either (use `corelooper predict`)"),
    "restore_callback_states_from_checkpoint": (
        _accept, "nothing: plugin state registered for checkpointing is always restored"),
    "enable_jit_checkpoint": (_accept, "nothing: a SIGTERM/SIGINT always writes a checkpoint (exit 143/130)"),
    "log_on_each_node": (_accept, "nothing: only global rank 0 logs"),
    # Transformers 4.x names (removed or renamed in 5.x)
    "evaluation_strategy": (_renamed("eval_strategy"), "eval_strategy"),
    "warmup_ratio": (_renamed("warmup_steps"), "warmup_steps (a float < 1 is a ratio)"),
    "group_by_length": (_sampling_from_group_by_length, 'train_sampling_strategy = "group_by_length"'),
    "no_cuda": (_renamed("use_cpu"), "use_cpu"),
    "per_gpu_train_batch_size": (_renamed("per_device_train_batch_size"), "per_device_train_batch_size"),
    "per_gpu_eval_batch_size": (_renamed("per_device_eval_batch_size"), "per_device_eval_batch_size"),
    "logging_dir": (_logging_dir, "[tensorboard] log_dir"),
    "include_tokens_per_second": (_accept, "nothing: tokens_per_second is always logged for token batches"),
    "torchdynamo": (_renamed("torch_compile_backend"), "torch_compile_backend"),
    # other tools' names
    "lr": (_renamed("learning_rate"), "learning_rate"),
    "batch_size": (_renamed("per_device_train_batch_size"), "per_device_train_batch_size"),
    "epochs": (_renamed("num_train_epochs"), "num_train_epochs"),
}
FOUR_X = frozenset({
    "evaluation_strategy", "warmup_ratio", "group_by_length", "no_cuda", "per_gpu_train_batch_size",
    "per_gpu_eval_batch_size", "logging_dir", "include_tokens_per_second", "torchdynamo",
})
NO_OP_MAPPED = frozenset(k for k, (m, _) in MAPPED.items() if m is _accept)
# Names from other tools: refused with the corelooper name (a user of them must learn the HF name).
OTHER_TOOLS = frozenset({"lr", "batch_size", "epochs"})


@dataclass(frozen=True)
class Unsupported:
    why: str
    """The corelooper way to do it, or why it is not supported."""
    accepts: tuple = ()
    """Values that are no-ops here (HF's default, where that is corelooper's behaviour)."""


_HUB = Unsupported(
    "Hub upload is not built in: upload output_dir after training (`hf upload REPO runs/x`) or in an "
    "on_save plugin.", (False, None, "every_save", "huggingface"))
_TRACKIO = Unsupported("trackio has no corelooper plugin; logging plugins: tensorboard, wandb (train.report_to).",
                       (None,))
_DL = "the loader is rebuilt each epoch from seeded indices, so a resume is exact"

# HF's AcceleratorConfig() as TrainingArguments.to_dict() writes it: what corelooper's Accelerator does.
_HF_ACCELERATOR_DEFAULTS = {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                            "use_seedable_sampler": True, "non_blocking": False,
                            "gradient_accumulation_kwargs": None}
# HF fields that take a dict or its JSON text (HF parses the text in TrainingArguments).
_JSON_DICT_FIELDS = frozenset({"lr_scheduler_kwargs", "accelerator_config", "fsdp_config", "deepspeed",
                               "gradient_checkpointing_kwargs", "liger_kernel_config", "optim_args"})

UNSUPPORTED: dict[str, Unsupported] = {
    "optim_target_modules": Unsupported(
        "GaLore/APOLLO optimizers are not built in: provide one with a create_optimizer plugin.", (None,)),
    "average_tokens_across_devices": Unsupported(
        "corelooper always normalises the loss by the token count summed over all processes, so results do "
        "not depend on the number of processes.", (True,)),
    "bf16_full_eval": Unsupported("evaluation runs in train.mixed_precision; the model is not cast for it.",
                                  (False,)),
    "fp16_full_eval": Unsupported("evaluation runs in train.mixed_precision; the model is not cast for it.",
                                  (False,)),
    "activation_checkpointing_kwargs": Unsupported(
        "gradient_checkpointing_kwargs are not supported: corelooper enables it with use_reentrant=False; "
        "call model.gradient_checkpointing_enable(...) in model.factory for other options.", (None, {})),
    "gradient_checkpointing_kwargs": Unsupported(
        "not supported: corelooper enables it with use_reentrant=False; call "
        "model.gradient_checkpointing_enable(...) in model.factory for other options.", (None, {})),
    "use_cache": Unsupported(
        "corelooper leaves model.config.use_cache as the model has it (turned off with "
        "gradient_checkpointing); set it in model.factory.", (False,)),
    "torch_empty_cache_steps": Unsupported(
        "not supported: emptying the CUDA cache every N steps only slows training; against fragmentation "
        "use PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.", (None,)),
    "log_level": Unsupported("corelooper's console is quiet by design; set Python logging levels yourself "
                             "(logging.getLogger('transformers')).", ("passive",)),
    "log_level_replica": Unsupported("only rank 0 speaks; other ranks print nothing.", ("warning", "passive")),
    "project": Unsupported("trackio has no corelooper plugin; for W&B use [wandb] project.",
                           ("huggingface",)),
    "trackio_space_id": _TRACKIO,
    "trackio_bucket_id": _TRACKIO,
    "trackio_static_space_id": _TRACKIO,
    "prediction_loss_only": Unsupported(
        "evaluation keeps the model outputs only when metrics are computed: give no compute_metrics "
        "and only the loss is computed (what prediction_loss_only = true does).", (False,)),
    "eval_do_concat_batches": Unsupported(
        "predictions are always concatenated (shorter ones padded with -100).", (True,)),
    "eval_use_gather_object": Unsupported(
        "not supported: predictions are tensors, gathered across processes with padding.", (False,)),
    "include_for_metrics": Unsupported(
        "compute_metrics receives predictions and label_ids; to use inputs or losses, collect them in an "
        "on_prediction_step plugin (it receives the batch and the outputs).", ([], None)),
    "include_inputs_for_metrics": Unsupported(
        "4.x name of include_for_metrics: collect inputs in an on_prediction_step plugin.", (False,)),
    "batch_eval_metrics": Unsupported(
        "accumulate metrics batch by batch in an on_prediction_step plugin (it receives batch and outputs) "
        "and report them from on_evaluate.", (False,)),
    "save_only_model": Unsupported(
        "not supported: a checkpoint always holds what an exact resume needs (optimizer, scheduler, RNG); "
        "the final model alone is output_dir/model.safetensors.", (False,)),
    "save_safetensors": Unsupported("weights are always written as safetensors.", (True,)),
    "save_on_each_node": Unsupported(
        "rank 0 writes checkpoints: in multi-node runs output_dir must be on a shared filesystem.", (False,)),
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
        "call torch.use_deterministic_algorithms(True) in model.factory.", (False,)),
    "accelerator_config": Unsupported(
        "corelooper builds its own Accelerator; to change it, return your own backend from a "
        "create_backend plugin.", (None, {}, _HF_ACCELERATOR_DEFAULTS)),
    "parallelism_config": Unsupported(
        "use --nproc N (data parallel), an [fsdp] section (corelooper-fsdp) or a [deepspeed] section.",
        (None,)),
    "dataloader_persistent_workers": Unsupported(f"not supported: {_DL}.", (False,)),
    "dataloader_prefetch_factor": Unsupported(f"not supported: {_DL}; torch's default (2) is used.", (None,)),
    "dataloader_multiprocessing_context": Unsupported(
        "not supported: workers start with the platform's default method.", (None,)),
    "dataloader_in_order": Unsupported("batches are always yielded in order.", (True,)),
    "label_names": Unsupported(
        "labels are batch['labels'] (or the last element of a tuple sample): rename the column in the "
        "dataset or the collator, or implement compute_loss.", (None, ["labels"])),
    "ddp_backend": Unsupported(
        "the process group uses gloo on CPU and nccl on GPU; another backend needs a create_backend plugin.",
        (None,)),
    "debug": Unsupported("HF's debug options (underflow_overflow, tpu_metrics_debug) are not supported.",
                         ("", [], None)),
    "skip_memory_metrics": Unsupported("memory metrics are not logged.", (True,)),
    "local_rank": Unsupported("set by the launcher (torchrun / `corelooper run --nproc N`).", (-1,)),
    "half_precision_backend": Unsupported("4.x: mixed precision is train.mixed_precision.", ("auto",)),
    "fp16_opt_level": Unsupported("4.x apex option: not supported (use mixed_precision = \"fp16\").", ("O1",)),
    "fp16_backend": Unsupported("4.x: mixed precision is train.mixed_precision.", ("auto",)),
    "use_mps_device": Unsupported("4.x: the device is chosen by accelerate (use_cpu to force the CPU).",
                                  (False,)),
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
            spec = UNSUPPORTED[key]
            if any(_same(value, ok) for ok in spec.accepts):
                continue
            raise ConfigError(f"train.{key} = {value!r}: {spec.why}")
        if key in MAPPED:
            mapper, what = MAPPED[key]
            if key in OTHER_TOOLS:
                raise ConfigError(f"Unknown key train.{key}. Did you mean {what}? (the HF name)")
            mapper(value, tr, old=key)
            if key in FOUR_X and value is not None:  # None: HF's "unset" (a 5.x to_dict() has them)
                note = f"train.{key} is a Transformers 4.x name, read as {what}."
                tr.notes.append(note)
                warnings.warn(note, HFNameNote, stacklevel=4)
            continue
        tr.train.setdefault(key, value)  # unknown: the caller names it with a hint
    return tr


def _json_dict(key: str, value: Any) -> Any:
    """A dict field given as JSON text (``'{"num_cycles": 2}'``), read as HF reads it."""
    if key not in _JSON_DICT_FIELDS or not isinstance(value, str) or not value.lstrip().startswith("{"):
        return value
    import json

    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"train.{key} = {value!r} is not valid JSON ({e}): write a table instead.") from None


def hf_names() -> list[str]:
    """Every HF name this module knows (candidates for "did you mean")."""
    return [*MAPPED, *UNSUPPORTED]


def hf_hint(key: str) -> str | None:
    """What an HF name becomes here, for error messages (None: not an HF name)."""
    if key in MAPPED:
        return MAPPED[key][1]
    if key in UNSUPPORTED:
        return UNSUPPORTED[key].why
    return None
