"""corelooper-neftune: NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction
Finetuning"), as HF Trainer's ``neftune_noise_alpha``.

Inert unless the config has a ``[neftune]`` section. From ``on_train_begin`` to ``on_train_end``
(or ``on_exception``) a forward hook on the input embedding adds uniform noise in
``[-a, a]`` with ``a = noise_alpha / sqrt(seq_len * hidden)`` to its output — only while the
module is in training mode, so evaluation inside training sees clean embeddings. The hook is
removed when training ends: a model saved or used afterwards is unchanged.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from corelooper import hookimpl
from corelooper.errors import ConfigError

__version__ = "0.2.0"

if TYPE_CHECKING:
    import torch

SECTION = "neftune"
_HANDLE = "_neftune_handle"


@hookimpl
def corelooper_config_sections():
    return {SECTION: {"noise_alpha": 5.0, "module": ""}}


def input_embeddings(model: torch.nn.Module, name: str = "") -> torch.nn.Module:
    """The module whose output gets the noise: ``module`` by name, the HF input embeddings, or
    the model's first ``nn.Embedding``."""
    if name:
        try:
            return model.get_submodule(name)
        except AttributeError:
            raise ConfigError(
                f"neftune.module = {name!r}: {type(model).__name__} has no such submodule."
            ) from None
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except NotImplementedError:
            emb = None
        if emb is not None:
            return emb
    import torch  # lazily: `corelooper --help` loads this module

    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return m
    raise ConfigError(
        f"[neftune]: {type(model).__name__} has no input embedding (no get_input_embeddings() and "
        "no nn.Embedding). Name the module with neftune.module = 'path.to.embedding'."
    )


def neftune_hook(noise_alpha: float):
    import torch

    def hook(module, inputs, output):
        if module.training:
            dims = output.size(1) * output.size(2)
            mag = noise_alpha / math.sqrt(dims)
            output = output + torch.zeros_like(output).uniform_(-mag, mag)
        return output

    return hook


def activate(model: torch.nn.Module, noise_alpha: float, name: str = ""):
    if noise_alpha <= 0:
        raise ConfigError(f"neftune.noise_alpha must be > 0, got {noise_alpha!r}.")
    return input_embeddings(model, name).register_forward_hook(neftune_hook(noise_alpha))


def _deactivate(loop) -> None:
    handle = loop.__dict__.pop(_HANDLE, None)
    if handle is not None:
        handle.remove()


@hookimpl
def on_train_begin(loop):
    if SECTION not in loop.config.sections:
        return
    _deactivate(loop)
    cfg = loop.config.section(SECTION)
    model = loop.backend.unwrap_model(loop.model)
    loop.__dict__[_HANDLE] = activate(model, float(cfg["noise_alpha"]), cfg["module"])


@hookimpl
def on_train_end(loop):
    _deactivate(loop)


@hookimpl
def on_exception(loop):
    _deactivate(loop)
