"""Building a run's model, datasets and collator from the config (``[model]``, ``[data]``).

The ``create_model`` and ``create_dataset`` providers build them: the builtin answers for
``module:callable`` factories (``model_from_factory``, ``dataset_from_factory`` here); a
plugin answers for the other forms (a Hugging Face folder in ``model.name_or_path``, data files by
path). When nobody answers, the error names the setting and the hook.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import Config, import_object
from .errors import ConfigError, DataError


def config_dir(config: Config) -> Path | None:
    """The folder relative ``module:callable`` references resolve against."""
    return config.source.parent if config.source else None


def build_model(plugins, config: Config) -> torch.nn.Module:
    """The ``nn.Module`` that ``[model]`` describes, from the ``create_model`` provider."""
    model, _ = plugins.call_provider("create_model", config=config)
    if model is not None:
        return model
    if config.model.name_or_path:
        raise ConfigError(
            f"model.name_or_path = {config.model.name_or_path!r}: no installed plugin loads a model "
            "named this way (the create_model hook). Install the plugin that loads Hugging Face model "
            "folders (docs/plugins.md lists the first-party plugins), or set model.factory."
        )
    raise ConfigError(
        "No model: pass one to Loop(model=...), or set model.factory (a 'module:callable') or "
        "model.name_or_path (a Hugging Face model folder)."
    )


def model_from_factory(config: Config) -> torch.nn.Module | None:
    """``model.factory(**model.args)`` (the builtin ``create_model``); None without a factory."""
    ref = config.model.factory
    if not ref:
        return None
    factory = import_object(ref, "model.factory", config_dir(config))
    try:
        model = factory(**config.model.args)
    except Exception as e:
        raise ConfigError(
            f"model.factory = {ref!r} raised {type(e).__name__}: {e} (called with "
            f"model.args = {config.model.args!r})."
        ) from e
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model.factory = {ref!r} returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def build_dataset(plugins, config: Config, split: str):
    """The dataset of ``data.<split>`` from the ``create_dataset`` provider (None when the config
    names none)."""
    dataset, _ = plugins.call_provider("create_dataset", config=config, split=split)
    if dataset is not None:
        return dataset
    ref = getattr(config.data, split, None)
    if ref or (split == "eval" and config.data.eval_split):
        what = f"data.{split} = {ref!r}" if ref else f"data.eval_split = {config.data.eval_split!r}"
        raise ConfigError(
            f"{what}: no installed plugin reads data named this way (the create_dataset hook). Name a "
            "'module:callable' returning a dataset, or install the plugin that reads data files by "
            "path (docs/plugins.md lists the first-party plugins)."
        )
    return None


def dataset_from_factory(config: Config, split: str):
    """``data.<split>(**data.args)`` for a ``module:callable`` (the builtin ``create_dataset``);
    None for anything else."""
    ref = getattr(config.data, split, None)
    if not isinstance(ref, str) or ":" not in ref:
        return None
    key = f"data.{split}"
    factory = import_object(ref, key, config_dir(config))
    try:
        dataset = factory(**config.data.args)
    except Exception as e:
        raise DataError(f"{key} = {ref!r} raised {type(e).__name__}: {e}.") from e
    check_dataset(dataset, f"{key} = {ref!r}")
    return dataset


def build_collator(config: Config):
    ref = config.data.collator
    return import_object(ref, "data.collator", config_dir(config)) if ref else None


def check_dataset(dataset, what: str) -> None:
    """Fail early, naming the factory, when a dataset cannot be used by the default pipeline."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise DataError(
            f"{what} returned {type(dataset).__name__}, which is not a dataset: it needs "
            "__len__ and __getitem__ (a map-style torch Dataset), or must be an IterableDataset."
        )
    if len(dataset) == 0:
        raise DataError(f"{what} returned an empty dataset.")
    sample = dataset[0]
    if not (isinstance(sample, (dict, tuple, list)) or torch.is_tensor(sample)):
        raise DataError(
            f"{what}: sample 0 is a {type(sample).__name__}; samples must be dicts of tensors "
            "(e.g. {'input': ..., 'labels': ...}), tuples (inputs..., label) or tensors."
        )
