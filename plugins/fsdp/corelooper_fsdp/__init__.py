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
    if "fsdp" not in config.sections:  # `corelooper plugins --config` says so
        plugins.set_inactive("fsdp", "no [fsdp] section")


@hookimpl
def corelooper_config_sections():
    return {"fsdp": dict(DEFAULTS)}


@hookimpl
def create_backend(loop):
    if "fsdp" not in loop.config.sections:
        return None
    from .backend import FSDPBackend

    return FSDPBackend.from_loop(loop)
