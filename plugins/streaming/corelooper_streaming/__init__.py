"""corelooper-streaming: training and evaluation on a torch ``IterableDataset`` (a stream),
split over processes and dataloader workers, with an exact resume (``corelooper_streaming.loader``).

The plugin answers the ``train_dataloader`` / ``eval_dataloader`` providers for an
``IterableDataset`` with a ``StreamingLoader`` and returns None for a map-style dataset (the
builtin ``BatchLoader`` answers then). ``[train] stream_split`` ("auto", "shards", "global") is
the plugin's setting (``[streaming] split``). The loader's position goes into every checkpoint
through the core's loader contract: its ``state_dict()`` is saved per rank
(``data_state_{rank}.json``) and ``load_state_dict(state)`` gets it back on resume.
"""

from __future__ import annotations

from corelooper import hookimpl
from corelooper.errors import ConfigError

__version__ = "0.2.0"

SECTION = "streaming"
SPLITS = ("auto", "shards", "global")


@hookimpl
def corelooper_config_sections():
    return {SECTION: {"split": "auto"}}


def _split(value, train):
    if value not in SPLITS:
        raise ConfigError(f'train.stream_split must be "auto", "shards" or "global", not {value!r}.')
    return None if value == "auto" else {SECTION: {"split": value}}


@hookimpl
def corelooper_settings():
    """``[train] stream_split`` -> ``[streaming] split``."""
    return {"train": {"stream_split": _split}}


def _is_iterable(dataset) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


def _loader(loop, dataset, batch_size: int, cycle: bool, split: str = "shards"):
    from .loader import StreamingLoader

    a = loop.args
    return StreamingLoader(
        dataset,
        batch_size,
        loop.data_collator,
        rank=loop.backend.process_index,
        num_replicas=loop.backend.num_processes,
        num_workers=a.dataloader_num_workers,
        drop_last=a.dataloader_drop_last,
        cycle=cycle,
        split=split,
        pin_memory=a.dataloader_pin_memory and loop.backend.device.type == "cuda",
    )


@hookimpl
def train_dataloader(loop, dataset):
    if not _is_iterable(dataset):
        return None
    split = loop.config.section(SECTION)["split"]
    return _loader(loop, dataset, loop.args.per_device_train_batch_size, cycle=True, split=split)


@hookimpl
def eval_dataloader(loop, dataset):
    if not _is_iterable(dataset):
        return None
    return _loader(loop, dataset, loop.args.per_device_eval_batch_size, cycle=False)
