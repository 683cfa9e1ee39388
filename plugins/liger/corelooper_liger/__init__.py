"""corelooper-liger: Liger kernels (Triton: RoPE, RMSNorm, SwiGLU, cross-entropy and the fused
linear cross-entropy that never materialises the logits) patched into a Hugging Face model, as
HF Trainer's ``use_liger_kernel`` / ``liger_kernel_config``.

Opt-in, as in HF: inert unless the config has a ``[liger]`` section (``train.use_liger_kernel =
true`` writes one). Then, when the loop is built (``on_init_end``, before the backend prepares the
model, as HF's Trainer patches before training), the model (a PEFT wrapper is looked through) goes
through ``liger_kernel.transformers._apply_liger_kernel_to_instance(model=..., **switches)``, the
call HF's Trainer makes. Switches left unset take Liger's default for the model type.

Where the kernels cannot run the plugin patches nothing and says why in one line (``corelooper
plugins --config``, and a warning when a run starts): liger-kernel not installed (the package to
install is named), ``train.use_cpu``, or no CUDA device. This module imports neither torch nor
liger-kernel at import time: ``corelooper --help`` loads every installed plugin.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging

from corelooper import hookimpl
from corelooper.errors import ConfigError

__version__ = "0.2.0"

SECTION = "liger"
#: The kernel switches of Liger's ``apply_liger_kernel_to_<model type>`` functions; ``None``: the
#: model type's own default (e.g. llama: all on except ``cross_entropy``).
SWITCHES = ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy")
RUN_PLUGIN_NAME = "liger.run"
INSTALL = "pip install liger-kernel (Linux with a CUDA GPU; it brings triton)"
logger = logging.getLogger("corelooper.liger")


@hookimpl
def corelooper_config_sections():
    return {SECTION: {"enabled": True, **dict.fromkeys(SWITCHES), "extra": {}}}


def kernel_kwargs(section: dict) -> dict:
    """The keyword arguments for Liger's patch function: the switches that are set, then ``extra``."""
    kwargs = {}
    for key in SWITCHES:
        value = section[key]
        if value is not None and not isinstance(value, bool):
            raise ConfigError(
                f"liger.{key} = {value!r}: must be true, false, or left out (Liger's default for the "
                "model type)."
            )
        if value is not None:
            kwargs[key] = value
    extra = dict(section["extra"] or {})
    clash = sorted(k for k in extra if k in SWITCHES or k == "model")
    if clash:
        raise ConfigError(
            f"[liger] extra sets {clash}, which are [liger] keys of their own (or the model itself): "
            "set them directly in [liger]. extra is for the other arguments of Liger's patch "
            "functions (e.g. layer_norm, geglu)."
        )
    kwargs.update(extra)
    if kwargs.get("cross_entropy") and kwargs.get("fused_linear_cross_entropy"):
        raise ConfigError(
            "[liger] cross_entropy = true and fused_linear_cross_entropy = true: Liger computes the "
            "loss one way or the other, not both. Keep fused_linear_cross_entropy (no logits in "
            "training, the memory-lean one) or cross_entropy (logits, then Liger's loss kernel)."
        )
    return kwargs


def check_loss_impl(config, kwargs: dict) -> None:
    """``[lm] loss = "chunked"`` (corelooper-lm) and Liger's fused linear cross-entropy are two ways
    to the same thing; with both, the chunked loss would run and Liger's kernel never would."""
    chunked = "lm" in config.sections and config.section("lm").get("loss") == "chunked"
    if chunked and kwargs.get("fused_linear_cross_entropy", True):
        raise ConfigError(
            "lm.loss = 'chunked' and Liger's fused linear cross-entropy both compute the loss "
            "from the hidden states without materialising the logits: with both, the chunked loss runs "
            "(it calls the model without labels) and Liger's kernel never does. Choose one: "
            "lm.loss = 'default' to use Liger's kernel, or [liger] fused_linear_cross_entropy "
            "= false to keep the chunked loss with Liger's other kernels (unset, it is on for most "
            "model types)."
        )


def unavailable_reason(train) -> str | None:
    """Why the kernels cannot run in this process (None: they can)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return f"liger-kernel is not installed: {INSTALL}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (liger-kernel needs it): pip install triton"
    if getattr(train, "use_cpu", False):
        return "train.use_cpu = true: Liger's Triton kernels run on CUDA GPUs only; the model is left as is"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU here: Liger's Triton kernels run on CUDA GPUs only; the model is left as is"
    return None


@hookimpl
def corelooper_configure(config, plugins):
    section = plugins.section_or_inactive(
        config, SECTION, "no [liger] section (or train.use_liger_kernel = true)"
    )
    if section is None:
        return
    kwargs = kernel_kwargs(section)
    if not section["enabled"]:
        plugins.set_inactive(SECTION, "[liger] enabled = false")
        return
    check_loss_impl(config, kwargs)
    reason = unavailable_reason(config.train)
    if reason:
        plugins.set_inactive(SECTION, reason)
        return
    plugins.register(LigerPatch(kwargs), RUN_PLUGIN_NAME)


@hookimpl(trylast=True)  # after the run's LigerPatch, which may find the device is not CUDA
def on_init_end(loop):
    """A run that asked for Liger but cannot have it says so once, when it starts."""
    why = loop.plugins.inactive.get(SECTION)
    asked = SECTION in loop.config.sections and loop.config.section(SECTION)["enabled"]
    if why and asked and loop.state.is_world_process_zero:
        logger.warning("corelooper-liger: Liger kernels not applied: %s.", why)


def supported_model_types() -> dict:
    """Liger's table of model types and their patch functions."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def apply(model, kwargs: dict) -> dict:
    """Patch ``model`` (a transformers ``PreTrainedModel``, or a PEFT model around one) in place,
    as HF's Trainer does with ``use_liger_kernel``; return the arguments Liger's patch function took.

    Triton runs nothing here: the patch swaps module methods (and, for some switches, functions
    of the model type's ``transformers`` module, for the whole process), so it works on any
    machine; the forward needs a CUDA GPU.
    """
    from transformers import PreTrainedModel

    from corelooper.data.columns import innermost_model

    base = innermost_model(model)
    if not isinstance(base, PreTrainedModel):
        raise ConfigError(
            f"[liger] patches Hugging Face transformers models; {type(base).__name__} is not one. Remove "
            "the [liger] section (or train.use_liger_kernel) for this model, or patch its modules in "
            "model.factory with liger_kernel.transformers's kernels."
        )
    model_type = getattr(base.config, "model_type", None)
    table = supported_model_types()
    if model_type not in table:
        raise ConfigError(
            f"[liger]: Liger has no kernels for model type {model_type!r} ({type(base).__name__}). It has "
            f"them for: {', '.join(sorted(table))}. Remove the [liger] section (or train.use_liger_kernel) "
            "for this model."
        )
    params = inspect.signature(table[model_type]).parameters
    ignored = sorted(k for k in kwargs if k not in params)
    if ignored:
        logger.warning("corelooper-liger: %s not switches of Liger's %s patch: ignored.", ignored, model_type)
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=base, **kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


class LigerPatch:
    """One run's patch: applied to ``loop.model`` when the loop is built (before the backend
    prepares it and before the optimizer is built)."""

    def __init__(self, kwargs: dict) -> None:
        self.kwargs = kwargs
        self.applied: dict | None = None

    def on_init_end(self, loop) -> None:
        device = loop.backend.device
        if device.type != "cuda":  # e.g. a backend that placed this run on the CPU
            reason = f"the run's device is {device}: Liger's Triton kernels run on CUDA GPUs only"
            loop.plugins.set_inactive(SECTION, reason)  # the module's on_init_end warns
            return
        self.applied = apply(loop.model, self.kwargs)
        if loop.state.is_world_process_zero:
            logger.info(
                "corelooper-liger: patched %s with Liger kernels %s",
                type(loop.model).__name__,
                self.applied or "(the model type's defaults)",
            )


# The switches of Liger's patch functions that [liger] has as keys of its own (the rest: [liger] extra).
_LIGER_SWITCHES = ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy")


def _hf_use_liger_kernel(value, train):
    if not isinstance(value, bool):
        raise ConfigError(f"train.use_liger_kernel must be true or false, got {value!r}.")
    if not value and train.get("liger_kernel_config") is None:
        return None  # false alone is HF's default: no section, nothing needed
    return {SECTION: {"enabled": value}}


def _hf_liger_kernel_config(value, train):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(
            f"train.liger_kernel_config must be a table of Liger's patch arguments (e.g. "
            f"{{ rope = true, fused_linear_cross_entropy = true }}), got {value!r}."
        )
    # As HF: the config alone (without use_liger_kernel = true) patches nothing.
    out = {"enabled": train.get("use_liger_kernel") is True}
    for key, v in value.items():
        if key in _LIGER_SWITCHES:
            out[key] = v
        else:
            out.setdefault("extra", {})[key] = v
    return {SECTION: out}


@hookimpl
def corelooper_settings():
    """HF's ``use_liger_kernel`` / ``liger_kernel_config`` -> ``[liger]``."""
    return {
        "train": {"use_liger_kernel": _hf_use_liger_kernel, "liger_kernel_config": _hf_liger_kernel_config}
    }
