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
    from corelooper.builtin.console import quiet_library

    # DeepSpeed's notices and logs (errors pass; filters, not levels: it resets its logger's level
    # when imported). Shown with --verbose.
    quiet_library("deepspeed", ("DeepSpeed", "deepspeed"))
    plugins.section_or_inactive(config, "deepspeed")  # `corelooper plugins --config` says why


@hookimpl
def corelooper_config_sections():
    return {"deepspeed": {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEFAULTS.items()}}


@hookimpl
def create_backend(loop):
    if "deepspeed" not in loop.config.sections:
        return None
    from .backend import DeepSpeedBackend

    return DeepSpeedBackend.from_loop(loop)


def _hf_deepspeed(value, train):
    """HF's ``deepspeed`` (a JSON file, or its keys as a table) -> ``[deepspeed]``."""
    from corelooper.errors import ConfigError

    if value is None:
        return None
    if isinstance(value, str):
        return {"deepspeed": {"config": value}}
    if isinstance(value, dict):
        return {"deepspeed": {"extra": dict(value)}}
    raise ConfigError(f"train.deepspeed must be a DeepSpeed JSON file or a table, got {value!r}.")


@hookimpl
def corelooper_settings():
    return {"train": {"deepspeed": _hf_deepspeed}}
