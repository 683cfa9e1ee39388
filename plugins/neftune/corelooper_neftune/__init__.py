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


@hookimpl
def corelooper_configure(config, plugins):
    cfg = plugins.section_or_inactive(config, SECTION)
    if cfg is None:
        return
    plugins.register(NEFTune(float(cfg["noise_alpha"]), cfg["module"]), f"{SECTION}.run")


class NEFTune:
    """One run's noise hook: on from on_train_begin to on_train_end (or on_exception)."""

    def __init__(self, noise_alpha: float, module: str) -> None:
        self.noise_alpha, self.module = noise_alpha, module
        self.handle = None

    def on_train_begin(self, loop) -> None:
        self.remove()
        self.handle = activate(loop.backend.unwrap_model(loop.model), self.noise_alpha, self.module)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def on_train_end(self) -> None:
        self.remove()

    def on_exception(self) -> None:
        self.remove()


@hookimpl
def corelooper_settings():
    """HF's ``neftune_noise_alpha`` -> ``[neftune] noise_alpha``."""
    return {
        "train": {
            "neftune_noise_alpha": lambda value, train: (
                None if value is None else {SECTION: {"noise_alpha": value}}
            )
        }
    }
