"""corelooper-deepspeed: DeepSpeed ZeRO stages 1, 2, 3 (and offload) as a corelooper backend.

Inert unless the config has a ``[deepspeed]`` section: installed, it is loaded in every run,
but ``create_backend`` answers only then (and deepspeed itself is imported only then).
"""

from __future__ import annotations

from corelooper import hookimpl

__version__ = "0.2.0"

DEFAULTS = {
    # A DeepSpeed JSON config file (relative to the corelooper config). Its keys win over the
    # ones below; "auto" values are filled from [train]; values that contradict [train]
    # (batch size, accumulation, clipping, precision) are refused with a message.
    "config": "",
    # ZeRO stage: 0 (plain data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
    "zero_stage": 2,
    # "none" or "cpu" ("nvme" via the JSON file): optimizer state in CPU memory (ZeRO-Offload).
    "offload_optimizer": "none",
    # "none" or "cpu": parameters in CPU memory (ZeRO-3 only).
    "offload_param": "none",
    # DeepSpeed's shared-memory CPU collectives need a g++ build (35-60 s on first use); gloo
    # gives the same numbers. true: build and use them.
    "cpu_shm_comm": False,
    # More DeepSpeed config keys, merged as given (e.g. {zero_optimization = {overlap_comm = true}}).
    "extra": {},
}


@hookimpl
def corelooper_configure(config, plugins):
    if "deepspeed" not in config.sections:  # `corelooper plugins --config` says so
        plugins.set_inactive("deepspeed", "no [deepspeed] section")


@hookimpl
def corelooper_config_sections():
    return {"deepspeed": {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}}


@hookimpl
def create_backend(loop):
    if "deepspeed" not in loop.config.sections:
        return None
    from .backend import DeepSpeedBackend

    return DeepSpeedBackend.from_loop(loop)
