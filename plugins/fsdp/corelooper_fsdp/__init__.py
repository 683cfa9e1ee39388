"""corelooper-fsdp: an FSDP2 backend (``torch.distributed.fsdp.fully_shard``).

Inert unless the config has an ``[fsdp]`` section: installed, it is loaded in every run, but
``create_backend`` answers only when asked for FSDP (otherwise the builtin DDP backend runs).
"""

from __future__ import annotations

from corelooper import hookimpl

__version__ = "0.2.0"

DEFAULTS = {
    # Module class names sharded as one unit each (e.g. ["LlamaDecoderLayer"]). Empty: a
    # transformers model's _no_split_modules, else every child of an nn.ModuleList.
    "wrap": [],
    # Free the gathered parameters after each unit's forward (ZeRO-3 like; false: ZeRO-2 like).
    "reshard_after_forward": True,
    # Keep sharded parameters, gradients and optimizer state in CPU memory (GPU training).
    "cpu_offload": False,
    # Parameter dtype for compute: "" follows train.mixed_precision; "bf16", "fp16" or "fp32".
    "param_dtype": "",
    # Dtype of gradient reduce-scatter: fp32 keeps gradient sums exact under bf16 compute.
    "reduce_dtype": "fp32",
    # Recompute each wrapped unit's forward during backward instead of keeping activations.
    "activation_checkpointing": False,
    # Also write the sharded torch.distributed.checkpoint state (model + optimizer) in every
    # checkpoint; resume reads it (fast, no gather). model.safetensors is always written.
    "sharded_state": True,
}


@hookimpl
def corelooper_configure(config, plugins):
    plugins.section_or_inactive(config, "fsdp")  # `corelooper plugins --config` says why


@hookimpl
def corelooper_config_sections():
    return {"fsdp": dict(DEFAULTS)}


@hookimpl
def create_backend(loop):
    if "fsdp" not in loop.config.sections:
        return None
    from .backend import FSDPBackend

    return FSDPBackend.from_loop(loop)


# HF's `fsdp` option words and the [fsdp] keys they set.
_FSDP_WORDS = {
    "full_shard": ("reshard_after_forward", True),
    "shard_grad_op": ("reshard_after_forward", False),
    "offload": ("cpu_offload", True),
    "auto_wrap": None,  # always wrapped here (by [fsdp] wrap or the model's _no_split_modules)
}
# HF's fsdp_config keys and their [fsdp] names.
_FSDP_CONFIG = {
    "transformer_layer_cls_to_wrap": "wrap",
    "activation_checkpointing": "activation_checkpointing",
    "reshard_after_forward": "reshard_after_forward",
    "cpu_offload": "cpu_offload",
}


def _hf_fsdp(value, train):
    """HF's ``fsdp`` option string -> ``[fsdp]`` keys."""
    from corelooper.errors import ConfigError

    if value in (None, "", False, []):
        return None
    words = value.split() if isinstance(value, str) else list(value) if isinstance(value, list) else []
    if value is not True and not words:
        raise ConfigError(
            f"train.fsdp must be HF's option string (e.g. 'full_shard auto_wrap'), got {value!r}."
        )
    out = {}
    for word in words:
        if word not in _FSDP_WORDS:
            raise ConfigError(
                f"train.fsdp option {word!r} is not supported: corelooper-fsdp is FSDP2 ({', '.join(_FSDP_WORDS)}"
                "); hybrid sharding and no_shard have no FSDP2 equivalent here. See the [fsdp] section."
            )
        if _FSDP_WORDS[word]:
            key, setting = _FSDP_WORDS[word]
            out[key] = setting
    return {"fsdp": out}


_NO_XLA = ((False,), "XLA (TPU) FSDP is not supported: corelooper-fsdp runs torch's FSDP2.")
# HF fsdp_config keys whose value is what corelooper-fsdp does anyway: (accepted values, why not others).
_HF_ACCEPTED = {
    "version": ((2,), "corelooper-fsdp is FSDP2 (torch's fully_shard): use version 2."),
    "min_num_params": ((0,), "wrapping by size is not supported: name the layer classes in wrap."),
    "xla": _NO_XLA,
    "xla_fsdp_v2": _NO_XLA,
    "xla_fsdp_grad_ckpt": _NO_XLA,
}


def _hf_fsdp_config(value, train):
    """HF's ``fsdp_config`` keys -> their ``[fsdp]`` names."""
    from corelooper.errors import ConfigError

    if not value:
        return None
    if not isinstance(value, dict):
        raise ConfigError(
            f"train.fsdp_config must be a table (HF reads a JSON file; write its keys here), got {value!r}."
        )
    out = {}
    for key, v in value.items():
        accepted = _HF_ACCEPTED.get(key.removeprefix("fsdp_"))
        if accepted is not None:  # HF's defaults (TrainingArguments.to_dict() writes them), or FSDP2
            if v not in accepted[0]:
                raise ConfigError(f"train.fsdp_config.{key} = {v!r}: {accepted[1]}")
            continue
        name = _FSDP_CONFIG.get(key.removeprefix("fsdp_"))
        if name is None:
            raise ConfigError(
                f"train.fsdp_config.{key} is not supported; the [fsdp] section has: wrap, "
                "reshard_after_forward, cpu_offload, param_dtype, reduce_dtype, activation_checkpointing, "
                "sharded_state."
            )
        out[name] = list(v) if name == "wrap" and isinstance(v, list | tuple) else v
    return {"fsdp": out}


@hookimpl
def corelooper_settings():
    return {"train": {"fsdp": _hf_fsdp, "fsdp_config": _hf_fsdp_config}}
