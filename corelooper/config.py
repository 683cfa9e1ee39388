"""Typed configuration: TOML in, validated dataclasses out, resolved TOML back to disk.

Sections: ``[model]``, ``[data]``, ``[train]`` (Hugging Face ``TrainingArguments`` names), ``[plugins]``,
and one section per plugin (declared by its ``corelooper_config_sections`` hook and validated against it).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import math
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import tomli_w

from . import blocking
from .errors import ConfigError, import_failure
from .hf.args import OTHER_TOOLS, Translation, hf_hint, hf_names, translate
from .metric import greater_is_better

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class ModelConfig:
    factory: str = ""
    """``module:callable`` (or ``path/to/file.py:callable``) returning an ``nn.Module``."""
    args: dict = field(default_factory=dict)
    """Keyword arguments for the factory (or extra ``from_pretrained`` arguments)."""
    name_or_path: str | None = None
    """A Hugging Face model folder (relative paths: to the current folder, else the config's), loaded with
    ``from_pretrained`` of the auto class ``task`` names (by the plugin that answers ``create_model``)."""
    task: str = "causal_lm"
    """causal_lm, seq2seq_lm, masked_lm, sequence_classification, token_classification,
    question_answering, image_classification, base, or an auto class name."""
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    """Weights' dtype for ``name_or_path`` (default: float32; "auto": as saved)."""
    attn_implementation: str | None = None
    """"sdpa", "eager", "flash_attention_2", ... (default: transformers' choice)."""
    trust_remote_code: bool = False
    """Run the model folder's own Python code (off: it is arbitrary code)."""
    tokenizer: str | None = None
    """The tokenizer's folder (default: ``name_or_path``)."""


@dataclass(frozen=True)
class DataConfig:
    train: str | list | None = None
    """``module:callable`` returning the training dataset, or data files (read by the plugin that answers
    ``create_dataset``): a path (.jsonl, .json, .parquet, .csv, .arrow, a ``save_to_disk`` folder), a glob
    of shards, or a mixture ``[{ path = "a.jsonl", weight = 0.7 }, { path = "b.jsonl", weight = 0.3 }]``."""
    eval: str | list | None = None
    """Like ``train``; or leave it unset and hold out ``eval_split`` of the training data."""
    eval_split: float = 0.0
    """Share (0 < x < 1) or number (>= 1) of training samples held out for evaluation (seeded)."""
    test: str | None = None
    """``module:callable`` returning the dataset of ``corelooper predict`` (default: ``eval``)."""
    collator: str | None = None
    """Optional ``module:callable`` turning a list of samples into a batch."""
    args: dict = field(default_factory=dict)
    """Keyword arguments passed to the dataset factories."""


@dataclass(frozen=True)
class PluginsConfig:
    enable: list[str] | None = None
    """Allow-list of installed plugins to load (``None``: all installed plugins)."""
    disable: list[str] = field(default_factory=list)
    """Installed plugins not to load for this project (like ``-p no:NAME``)."""
    local: list[str] = field(default_factory=list)
    """Modules (``pkg.module`` or ``path/to/file.py``) registered as plugins for this project."""


@dataclass(frozen=True, init=False)
class TrainArgs:
    """Training settings; names and meanings follow HF ``TrainingArguments`` (5.x).

    ``TrainArgs(output_dir=..., **kwargs)`` validates like the ``[train]`` table of a config file (same
    messages: unknown keys get a hint, HF names are mapped or refused, see ``corelooper/hf/args.py``) and
    is read-only afterwards; ``dataclasses.replace`` makes a changed copy, validated again.
    """

    output_dir: str = "runs/corelooper"
    overwrite_output_dir: bool = False
    """Start over in an output_dir with checkpoints (deletes them); corelooper refuses it otherwise (4.x)."""
    run_name: str | None = None
    seed: int = 42
    data_seed: int | None = None
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    auto_find_batch_size: bool = False
    """On out-of-memory, halve the micro-batch and double the accumulation (same effective
    batch); needs a plugin that answers to it (``corelooper plugins`` lists the installed ones)."""
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    on_nonfinite: Literal["stop", "skip_step", "ignore"] = "stop"
    """A NaN/Inf loss or gradient norm: stop the run, skip the step, or carry on."""
    max_skipped_steps: int = 10
    """With on_nonfinite = "skip_step": stop after this many skipped steps in a row."""
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "constant",
        "constant_with_warmup",
        "cosine_with_restarts",
        "polynomial",
        "inverse_sqrt",
        "cosine_with_min_lr",
        "warmup_stable_decay",
        "reduce_lr_on_plateau",
    ] = "linear"
    lr_scheduler_kwargs: dict = field(default_factory=dict)
    """Options of the schedule, e.g. ``{ num_cycles = 2 }`` (corelooper/hf/schedules.py)."""
    optim: str = "adamw_torch_fused"
    """adamw_torch_fused (HF's default; plain AdamW where the device has no fused kernel),
    adamw_torch, sgd, adafactor, rmsprop, adagrad, or a plugin's name."""
    optim_args: str | dict | None = None
    """Optimizer options: HF's ``"momentum=0.9,nesterov=True"`` or a table."""
    lr_multipliers: dict = field(default_factory=dict)
    """``{ "regex" = factor }``: LR times factor for parameters whose name matches (first wins)."""
    label_smoothing_factor: float = 0.0
    batch_eval_metrics: bool = False
    eval_accumulation_steps: int | None = None
    ignore_data_skip: bool = False
    warmup_steps: float = 0
    """A float < 1 is a ratio of the run (HF 5.x; the 4.x ``warmup_ratio`` is read as this)."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """HF's ``bf16 = true`` / ``fp16 = true`` are read as this."""
    loss_type: Literal["auto", "cross_entropy", "causal_lm", "mse"] = "auto"
    """``auto``: causal-LM shift when ``labels`` has the shape of ``input_ids``, MSE for float
    labels, cross-entropy otherwise."""
    logging_strategy: Literal["no", "steps", "epoch"] = "steps"
    logging_steps: int | float = 500
    logging_first_step: bool = False
    logging_nan_inf_filter: bool = False
    """HF's default is true (a non-finite loss is logged as the mean of the window's others); corelooper
    logs the true loss: true is accepted with a note, and has no effect (``on_nonfinite`` handles those)."""
    include_num_input_tokens_seen: Literal["all", "non_padding", "no"] | bool = "all"
    """What ``state.num_input_tokens_seen`` counts (and logs): ``"all"`` (``input_ids.numel()``),
    ``"non_padding"`` (``attention_mask.sum()``; without a mask, ids != the collator's ``pad_token_id``),
    ``"no"``. HF's default is ``"no"``; corelooper counts from tensor shapes (no device sync): free."""
    report_to: str | list[str] = "all"
    """Logging plugins to feed: ``"all"`` (every installed one), ``"none"``, or names
    (the ``report_to`` names logging plugins declare); the plugin manager turns the others off."""
    eval_strategy: Literal["no", "steps", "epoch"] = "no"
    eval_steps: int | float | None = None
    eval_delay: float = 0
    eval_on_start: bool = False
    save_strategy: Literal["no", "steps", "epoch", "best"] = "steps"
    save_steps: int | float = 500
    save_total_limit: int | None = None
    save_max_shard_size: int | str = "5GB"
    """Shard weights above this size, as HF ``save_pretrained``: bytes, or "5GB", "500MiB"."""
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    dataloader_num_workers: int = 0
    dataloader_drop_last: bool = False
    dataloader_pin_memory: bool = True
    # DDP options of the builtin backend (torch's defaults when unset), as HF.
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    resume_from_checkpoint: str | None = None
    """A checkpoint folder, "latest" (the newest complete one in output_dir), or "auto": the newest
    one when there is one, else start fresh (one command for a job and its requeues)."""
    disable_tqdm: bool = False
    use_cpu: bool = False
    ddp_timeout: int = 1800
    """Seconds a collective may wait (HF's); a diagnosis plugin's hang timeout may end a hang sooner."""
    # Language-model options (read by the language-model plugins and hf/model_options.py).
    train_sampling_strategy: Literal["random", "sequential", "group_by_length"] = "random"
    """Training order: a seeded permutation per epoch, the dataset's order, or similar lengths
    batched together (seeded, resumable; the 4.x ``group_by_length = true``)."""
    length_column_name: str = "length"
    remove_unused_columns: bool = True
    gradient_checkpointing: bool = False
    use_cache: bool = False
    """``model.config.use_cache`` while training (HF 5.x's default, false: no KV cache in training)."""
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    tf32: bool | None = None
    peak_flops: float | None = None
    """Peak FLOP/s of one device (989e12: an H100 in bf16): a plugin that counts FLOPs then logs ``mfu``."""

    def __init__(self, output_dir: str | None = None, /, **kwargs: Any) -> None:
        if output_dir is not None:
            kwargs["output_dir"] = output_dir
        # `TrainArgs(**other.__dict__)` copies: what other's HF names became comes along
        carried = {k: kwargs.pop(k, {}) for k in ("_sections", "_notes", "_plugin_values")}
        values, tr = _train_values(kwargs)
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, values.get(f.name, default))
        object.__setattr__(self, "_sections", {**carried["_sections"], **tr.sections})
        object.__setattr__(self, "_notes", (*carried["_notes"], *tr.notes))
        object.__setattr__(self, "_plugin_values", {**carried["_plugin_values"], **tr.plugin_values})
        for key, value in check_train_args(self).items():  # derived defaults, set before freezing
            object.__setattr__(self, key, value)

    @classmethod
    def from_hf(cls, args: Any, **changes: Any) -> TrainArgs:
        """An HF ``TrainingArguments`` (or its ``to_dict()``) as it is, validated like ``[train]``."""
        values = args.to_dict() if hasattr(args, "to_dict") else dict(args)
        return cls(**{**values, **changes})

    @property
    def notes(self) -> tuple[str, ...]:
        """What HF (4.x) names were read as, one line each."""
        return self._notes

    @property
    def plugin_sections(self) -> dict[str, dict[str, Any]]:
        """Plugin-section values given as HF ``[train]`` names that plugins answer to."""
        return {k: dict(v) for k, v in self._sections.items()}

    @property
    def plugin_values(self) -> dict[str, Any]:
        """The HF ``[train]`` names that plugins translated, as written (``corelooper_settings``)."""
        return dict(self._plugin_values)

    @property
    def group_by_length(self) -> bool:
        return self.train_sampling_strategy == "group_by_length"

    @property
    def tokens_seen_mode(self) -> str:
        """``include_num_input_tokens_seen`` as HF normalises it (true: "all", false: "no")."""
        v = self.include_num_input_tokens_seen
        return ("all" if v else "no") if isinstance(v, bool) else v

    def reports_to(self, name: str) -> bool:
        """Whether the logging plugin ``name`` is wanted by ``report_to``."""
        wanted = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        return "none" not in wanted and ("all" in wanted or name in wanted)


@functools.cache
def _train_fields() -> tuple[dict[str, Any], set[str]]:
    return typing.get_type_hints(TrainArgs), {f.name for f in dataclasses.fields(TrainArgs)}


def _not_loaded(key: str) -> str:
    """For an unknown ``[train]`` key: the installed plugins blocked for this run (a blocked plugin
    is never imported, so its own keys are unknown without it)."""
    from . import _BLOCKED, installed_entry_points

    names = sorted(ep.name for ep in installed_entry_points() if ep.name in _BLOCKED[-1])
    why = f"; {names} are installed but not loaded for this run (-p no:NAME, [plugins] disable)"
    return f" (no loaded plugin declares it{why}: load the one it belongs to, or remove it)" if names else ""


def _train_values(raw: dict[str, Any]) -> tuple[dict[str, Any], Translation]:
    """HF names translated, unknown keys named with a hint, types checked, ints made floats."""
    hints, names = _train_fields()
    tr = translate(raw, names)
    values = {}
    for key, value in tr.train.items():
        if key not in names:
            hint = _did_you_mean(key, sorted(names) + hf_names())
            if "Known keys" in hint:  # no close name: list corelooper's, not every HF one
                hint = _did_you_mean(key, sorted(names))
            raise ConfigError(f"Unknown key train.{key}{_not_loaded(key)}.{hint}")
        if value is None and key == "max_grad_norm":  # not "unset": never the default's 1.0
            raise ConfigError(
                "train.max_grad_norm = None: HF's Trainer fails on it at the first step. Use "
                "0 for no clipping (the gradient norm is still computed and logged) or a "
                "positive norm such as 1.0."
            )
        if value is not None or _matches(None, hints[key]):  # HF passes None for "unset": the default
            values[key] = _checked("train", key, value, hints[key])
    if "report_to" in values and not isinstance(values["report_to"], str):
        values["report_to"] = list(values["report_to"])
    if values.get("logging_nan_inf_filter"):  # HF's default: every HF script passes it
        tr.notes.append(
            "train.logging_nan_inf_filter = true (HF's default) has no effect: corelooper logs "
            "the true loss; a non-finite step is handled by train.on_nonfinite (stop, or "
            "skip_step)."
        )
    return values, tr


@dataclass(frozen=True)
class Config:
    """The whole run's configuration, validated when built and read-only afterwards."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainArgs = field(default_factory=TrainArgs)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Plugin sections, as written (defaults are merged in by ``section``); read-only."""
    source: Path | None = None
    """The file this config came from (relative factory paths resolve against its folder)."""
    _defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, repr=False)

    CORE = ("model", "data", "train", "plugins")

    def __post_init__(self) -> None:
        sections = {k: dict(v) for k, v in self.sections.items()}
        for name, values in self.train.plugin_sections.items():  # an HF name -> its plugin's section
            given = sections.setdefault(name, {})
            for key, value in values.items():
                if key in given and given[key] != value:
                    raise ConfigError(
                        f"[{name}] {key} = {given[key]!r} contradicts the HF name in [train] "
                        f"that sets it to {value!r}: set only one."
                    )
                given[key] = value
        object.__setattr__(self, "sections", _read_only(sections))
        object.__setattr__(self, "_defaults", _read_only(self._defaults))

    def section(self, name: str) -> dict[str, Any]:
        """A plugin section with its declared defaults filled in (a copy)."""
        return {**self._defaults.get(name, {}), **self.sections.get(name, {})}

    def replace(self, part: str, **changes: Any) -> Config:
        """A copy with ``part`` ("model", "data", "train", "plugins") changed, validated again."""
        if part not in self.CORE:
            raise ValueError(f"part must be one of {self.CORE}, not {part!r}")
        return dataclasses.replace(self, **{part: dataclasses.replace(getattr(self, part), **changes)})

    def to_dict(self) -> dict[str, Any]:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in self.CORE}
        return {**out, **{name: self.section(name) for name in sorted(self.sections)}}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: Path | None = None) -> Config:
        data = dict(data)
        kwargs: dict[str, Any] = {}
        plugins = data.get("plugins") if isinstance(data.get("plugins"), dict) else {}
        with blocking(plugins.get("disable") or (), plugins.get("enable")):  # none imported for [train]
            core = (ModelConfig, DataConfig, TrainArgs, PluginsConfig)
            for name, klass in zip(cls.CORE, core, strict=True):
                raw = data.pop(name, {})
                if not isinstance(raw, dict):
                    raise ConfigError(f"[{name}] must be a table of keys, got {raw!r}.")
                kwargs[name] = TrainArgs(**raw) if klass is TrainArgs else build_dataclass(klass, raw, name)
        for name, raw in data.items():
            if not isinstance(raw, dict):
                raise ConfigError(
                    f"Top-level key {name!r} = {raw!r} is not a section. Keys belong in a "
                    f"section such as [train].{_did_you_mean(name, list(cls.CORE))}"
                )
        cfg = cls(**kwargs, sections={k: dict(v) for k, v in data.items()}, source=source)
        check_model_and_data(cfg.model, cfg.data)
        return cfg

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] = ()) -> Config:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file {str(path)!r} does not exist (or is not a file).")
        try:  # a byte-order mark (Windows editors write one) is skipped, as editors and TOML tools do
            data = tomllib.loads(path.read_bytes().decode("utf-8-sig"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            utf16 = isinstance(e, UnicodeDecodeError) and e.object[:2] in (b"\xff\xfe", b"\xfe\xff")
            why = "it is UTF-16 (as PowerShell's `>` writes); save it as UTF-8" if utf16 else e
            raise ConfigError(f"Config file {str(path)!r} is not valid TOML: {why}.") from None
        except OSError as e:
            why = f"{e.strerror} (errno {e.errno})"
            raise ConfigError(f"Config file {str(path)!r} cannot be read: {why}.") from None
        for item in overrides:
            apply_override(data, item)
        return cls.from_dict(data, source=path.resolve())

    def with_defaults(self, declared: dict[str, dict[str, Any]]) -> Config:
        """A copy whose plugin sections are checked against, and filled from, what the loaded
        plugins declare (``corelooper_config_sections``). ``self`` is not changed."""
        defaults = {k: dict(v) for k, v in declared.items() if k not in self.CORE}
        for name, values in self.sections.items():
            if name not in defaults:
                continue
            for key, value in values.items():
                if key not in defaults[name]:
                    raise ConfigError(f"Unknown key {name}.{key}.{_did_you_mean(key, list(defaults[name]))}")
                default = defaults[name][key]
                if default is not None and not _matches(value, type(default)):
                    raise ConfigError(
                        f"{name}.{key} must be of type {type(default).__name__} "
                        f"(like its default {default!r}), got {value!r}."
                    )
        return dataclasses.replace(self, _defaults=defaults)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(dumps_toml(self.to_dict()))


class ReadOnlyDict(dict):
    """A dict that refuses changes (a ``MappingProxyType`` could not be pickled or deep-copied,
    and an HPO study or a spawned worker copies configs)."""

    def _refuse(self, *args, **kwargs):
        raise TypeError(
            "the config is read-only after validation: use Config.replace(...) or "
            "dataclasses.replace(...) for a changed copy"
        )

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):
        return (ReadOnlyDict, (dict(self),))


def _read_only(sections: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Mapping[str, Any]]:
    return ReadOnlyDict({k: ReadOnlyDict(v) for k, v in sections.items()})


# --- Validation helpers ---


def _did_you_mean(key: str, options: list[str]) -> str:
    if key in OTHER_TOOLS:
        return f" Did you mean {OTHER_TOOLS[key]}?"
    # Long names share many letters by chance (a 9-letter name ~ seed: 0.62): ask for more of them.
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6 if len(key) <= 6 else 0.75)
    if close:
        about = hf_hint(close[0])  # a misspelt HF name: say what it is here
        return f" Did you mean {close[0]!r}?" + (f" (HF's name; here: {about})" if about else "")
    return f" Known keys: {', '.join(sorted(options))}." if options else ""


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, (list, tuple)) and all(_matches(v, item) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, Mapping)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "unset"
    if origin is list:
        return "a list of " + _describe(typing.get_args(tp)[0]) + "s"
    return getattr(tp, "__name__", str(tp))


def _checked(section: str, key: str, value: Any, tp: Any) -> Any:
    """``value`` if it is of type ``tp`` (an int made a float for a float field), else a ConfigError."""
    if not _matches(value, tp):
        raise ConfigError(f"{section}.{key} must be {_describe(tp)}, got {value!r} ({type(value).__name__}).")
    return float(value) if tp is float and isinstance(value, int) else value


def build_dataclass(klass: type, raw: dict[str, Any], section: str):
    hints = typing.get_type_hints(klass)  # the dataclass's fields
    values = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"Unknown key {section}.{key}.{_did_you_mean(key, list(hints))}")
        values[key] = _checked(section, key, value, hints[key])
    return klass(**values)


def check_model_and_data(m: ModelConfig, d: DataConfig) -> None:
    """Cross-field checks of [model] and [data], named by key path."""
    if m.factory and m.name_or_path:
        raise ConfigError(
            f"Set model.factory ({m.factory!r}) or model.name_or_path ({m.name_or_path!r}), not both."
        )
    if d.eval_split < 0 or (d.eval_split >= 1 and not float(d.eval_split).is_integer()):
        raise ConfigError(
            f"data.eval_split = {d.eval_split!r}: use a share 0 < x < 1 or a whole number of samples."
        )
    if d.eval_split and d.eval:
        raise ConfigError("Set data.eval or data.eval_split, not both.")
    for key in ("train", "eval"):
        if getattr(d, key) == []:
            raise ConfigError(f"data.{key} is an empty list: name at least one data file.")


# Float settings that can only produce NaN (or no training) when not finite.
_FINITE = (
    "learning_rate",
    "weight_decay",
    "max_grad_norm",
    "num_train_epochs",
    "warmup_steps",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "label_smoothing_factor",
    "eval_delay",
    "peak_flops",
    "logging_steps",
    "eval_steps",
    "save_steps",
)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5e9, ``"500MiB"`` -> 500 * 2**20, ints pass through (bytes)."""
    m = None if isinstance(size, int) else _SIZE_RE.match(str(size))
    if isinstance(size, int) and size > 0:
        return size
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(
            f"train.save_max_shard_size = {size!r} is not a size: use bytes (an int > 0) or a "
            "string like '5GB', '500MB', '2GiB'."
        )
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def resolve_interval(steps: int | float, max_steps: int) -> int:
    """HF's rule for logging/eval/save_steps: a float < 1 is ``ceil(steps * max_steps)``."""
    return max(1, math.ceil(steps * max_steps)) if steps < 1 else int(steps)


def check_train_args(a: TrainArgs) -> dict[str, Any]:
    """Cross-field checks, named by key path; returns the derived defaults (HF's rules), which
    ``TrainArgs`` sets while it is built (``a`` is not changed)."""
    for key in _FINITE:
        v = getattr(a, key)
        if v is not None and not math.isfinite(v):
            raise ConfigError(
                f"train.{key} = {v!r} is not a finite number: training could only produce NaN. "
                "Give a finite value."
            )
    _check_counts(a)
    for key in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "max_skipped_steps",
    ):
        v = getattr(a, key)
        if v is not None and v <= 0:
            raise ConfigError(f"train.{key} must be > 0, got {v!r}.")
    for key in (
        "learning_rate",
        "weight_decay",
        "max_grad_norm",
        "warmup_steps",
        "adam_epsilon",
        "eval_delay",
    ):
        if getattr(a, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(a, key)!r}.")
    for key in ("adam_beta1", "adam_beta2", "label_smoothing_factor"):
        if not 0.0 <= getattr(a, key) < 1.0:
            raise ConfigError(f"train.{key} must be in [0, 1), got {getattr(a, key)!r}.")
    for key in ("save_total_limit", "eval_accumulation_steps"):
        v = getattr(a, key)
        if v is not None and v < 1:
            raise ConfigError(f"train.{key} must be >= 1 (or unset), got {v}.")
    if a.max_steps <= 0 and a.num_train_epochs <= 0:
        raise ConfigError("Set train.num_train_epochs > 0 or train.max_steps > 0: nothing to train.")
    for key in ("warmup_steps", "logging_steps", "eval_steps", "save_steps"):
        v = getattr(a, key)
        if v is not None and v >= 1 and not float(v).is_integer():
            raise ConfigError(f"train.{key} = {v!r}: use an int number of steps or a ratio < 1.")
    return _best_model(a)


def _check_counts(a: TrainArgs) -> None:
    """Integers whose wrong values torch or the loop would only report mid-run (or never)."""
    if a.max_steps != -1 and a.max_steps <= 0:
        raise ConfigError(
            f"train.max_steps = {a.max_steps}: use a number of optimizer steps > 0, or -1 "
            "(HF's default) to train for train.num_train_epochs."
        )
    for key in ("seed", "data_seed"):
        v = getattr(a, key)
        if v is not None and not 0 <= v < 2**32:
            raise ConfigError(f"train.{key} = {v}: a seed is an int in [0, 2**32 - 1] (numpy's range).")
    if a.dataloader_num_workers < 0:
        raise ConfigError(
            f"train.dataloader_num_workers = {a.dataloader_num_workers}: use 0 (load in the "
            "training process) or the number of worker processes (> 0)."
        )
    parse_size(a.save_max_shard_size)


def _best_model(a: TrainArgs) -> dict[str, Any]:
    """Checks of what picks the best model; returns HF's defaults of its metric and direction."""
    needs_metric = a.load_best_model_at_end or a.save_strategy == "best"
    if needs_metric and a.eval_strategy == "no":
        raise ConfigError(
            "train.load_best_model_at_end / save_strategy = 'best' need evaluations: set "
            "train.eval_strategy to 'steps' or 'epoch'."
        )
    if a.load_best_model_at_end and a.save_strategy != "best":
        if a.save_strategy != a.eval_strategy:
            raise ConfigError(
                f"train.load_best_model_at_end needs train.save_strategy ({a.save_strategy!r}) "
                f"to match train.eval_strategy ({a.eval_strategy!r}), so that every evaluated "
                "model is saved."
            )
        eval_steps = a.eval_steps or a.logging_steps
        ratios = a.save_steps < 1 or eval_steps < 1  # checked once max_steps is known
        if a.save_strategy == "steps" and not ratios and a.save_steps % eval_steps:
            raise ConfigError(
                f"train.load_best_model_at_end needs train.save_steps ({a.save_steps}) to be a "
                f"multiple of train.eval_steps ({eval_steps})."
            )
    if a.lr_scheduler_type == "reduce_lr_on_plateau":
        if a.eval_strategy == "no":
            raise ConfigError(
                "train.lr_scheduler_type = 'reduce_lr_on_plateau' is driven by the evaluation "
                "metric: set train.eval_strategy to 'steps' or 'epoch' (and give eval data)."
            )
        needs_metric = True
    out: dict[str, Any] = {}
    metric = a.metric_for_best_model
    if needs_metric and metric is None:
        metric = out["metric_for_best_model"] = "loss"
    if metric is not None and a.greater_is_better is None:
        out["greater_is_better"] = greater_is_better(metric)
    return out


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply ``section.key=value`` (value parsed as TOML, else taken as a string)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.learning_rate=3e-4.")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: the key needs a section, e.g. train.{parts[-1]}=...")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {p!r} is not a section.")
    node[parts[-1]] = value


# --- Importing ``module:callable`` references ---


def import_object(ref: str, key: str, base: Path | None = None) -> Any:
    """Import ``pkg.module:attr`` or ``path/to/file.py:attr``; errors name the config key."""
    if ":" not in ref:
        raise ConfigError(f"{key} = {ref!r}: expected 'module:callable', e.g. 'mypkg.model:build'.")
    module_ref, attr = ref.rsplit(":", 1)
    obj = module = import_module(module_ref, key, base)
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            raise ConfigError(
                f"{key} = {ref!r}: module {module_ref!r} has no attribute {part!r}."
                f"{_did_you_mean(part, names)}"
            )
        obj = getattr(obj, part)
    return obj


def _package_root(folder: Path) -> Path:
    """The folder above the package chain ``folder`` belongs to (where ``import a.b`` works)."""
    while (folder / "__init__.py").exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def import_module(ref: str, key: str, base: Path | None = None, failed=ConfigError) -> types.ModuleType:
    # The current folder, the config's folder, and the root of the package the config lives in
    # (so `examples.digits.model:build` resolves wherever the command is run from).
    for root in [str(Path.cwd())] + ([str(base), str(_package_root(base))] if base else []):
        if root not in sys.path:
            sys.path.insert(0, root)
    try:
        if ref.endswith(".py") or "/" in ref:
            path = base / ref if base is not None and (base / ref).exists() else Path(ref)
            if not path.exists():
                raise ConfigError(f"{key}: file {ref!r} does not exist.")
            name = "corelooper_local_" + path.stem
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(ref)
    except ConfigError:
        raise
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and f"{ref}.".startswith(f"{e.name}."):  # not there
            raise ConfigError(
                f"{key}: cannot import {ref!r} ({e}). Check the spelling, and that the module is "
                "installed or lies under the current folder."
            ) from None
        # the module is there and failed (a syntax error, what it imports, what it runs): where
        raise failed(
            f"{key}: importing {ref!r} failed: {import_failure(e)}. Fix it, or remove it from {key}."
        ) from e


def _plain(v: Any) -> Any:
    """A value tomli_w can write: None left out (TOML has no null), paths as strings, tuples as lists."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items() if x is not None}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v) if isinstance(v, Path) else v


def dumps_toml(data: Mapping[str, Mapping[str, Any]]) -> str:
    return tomli_w.dumps(_plain(data))


def as_config(config: Config | TrainArgs | dict | None) -> Config:
    """What ``Loop(config=...)`` accepts, as a ``Config``."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, TrainArgs):  # validated when it was built, as the [train] table is
        return Config(train=config)
    if isinstance(config, dict):
        return Config.from_dict(config)
    raise TypeError(f"config must be a Config, TrainArgs or dict, not {type(config).__name__}")
