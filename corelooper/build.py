"""Building a run's model, datasets and collator from the config (``[model]``, ``[data]``)."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import Config, import_object
from .errors import CorelooperError, DataError


def config_dir(config: Config) -> Path | None:
    """The folder relative ``module:callable`` references resolve against."""
    return config.source.parent if config.source else None


def build_model(config: Config) -> torch.nn.Module:
    """The ``nn.Module`` that ``[model]`` describes: ``factory`` (a 'module:callable') or
    ``name_or_path`` (a Hugging Face model folder, corelooper/hf_model.py)."""
    ref = config.model.factory
    if not ref and config.model.name_or_path:
        from .hf.model import load_pretrained

        return load_pretrained(config)
    if not ref:
        raise CorelooperError(
            "No model: pass one to Loop(model=...), or set model.factory (a 'module:callable') or "
            "model.name_or_path (a Hugging Face model folder)."
        )
    factory = import_object(ref, "model.factory", config_dir(config))
    try:
        model = factory(**config.model.args)
    except Exception as e:
        raise CorelooperError(
            f"model.factory = {ref!r} raised {type(e).__name__}: {e} (called with "
            f"model.args = {config.model.args!r})."
        ) from e
    if not isinstance(model, torch.nn.Module):
        raise CorelooperError(f"model.factory = {ref!r} returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def build_dataset(config: Config, split: str):
    """The dataset of ``data.<split>`` (``None`` when the config names none): files by path
    (``data/train.jsonl``, a glob, a mixture, ``eval_split``: corelooper/hf_data.py, lazily
    read with the ``datasets`` library) or a ``module:callable`` returning a dataset."""
    ref = getattr(config.data, split, None)
    from .data.files import is_data_ref, load_split

    if is_data_ref(ref, config_dir(config)) or (split == "eval" and getattr(config.data, "eval_split", None)):
        return load_split(config, split)
    if not ref:
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
