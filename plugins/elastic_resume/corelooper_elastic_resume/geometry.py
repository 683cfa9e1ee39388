"""Elastic resume: continue a run saved on N processes on M processes, sample-exactly.

The *global batch* of an optimizer step is ``per_device_train_batch_size x
gradient_accumulation_steps x world_size`` samples, and the default data pipeline orders samples
globally (``data.BatchLoader``: one permutation per epoch, cut into global micro-batches of
``per_device x world_size``). A run is therefore defined by its global batch and its global
position in the epoch (samples consumed), not by the per-rank split. On resume with another
world size:

1. ``settle`` (the ``resume_config`` hook, in ``Loop.__init__``, before any plugin is configured:
   the config is final from then on) keeps the saved
   global batch: same per-device batch and a new ``gradient_accumulation_steps`` when that
   divides exactly, else the largest smaller per-device batch that does (a smaller micro-batch
   never needs more memory); it says so in one line. When the world size does not divide the
   global batch it refuses, naming the process counts that would work;
2. ``adapt`` (the ``resume_position`` hook, while the checkpoint loads) rewrites the saved position, per-rank micro-batches,
   as samples consumed in the epoch, then as micro-batches of the new geometry: no sample is
   repeated and none skipped.

Streams (``IterableDataset``) resume the same way when read globally (``train.stream_split =
"global"``, which the default ``"auto"`` picks for every stream that does not split itself):
every rank reads one global order and takes its slice of each global micro-batch, and the
checkpointed position is the samples of the stream's epoch consumed (``corelooper_streaming``),
which any world size and number of dataloader workers continues. A stream split by shards
(``"shards"``, or ``"auto"`` for a dataset that splits itself) keeps a position per process x
worker and cannot be re-split: resuming it on another world size is refused, naming what works.

Gradients are the same because the loss is normalised by the global number of loss items
(``num_items_in_batch`` summed over micro-batches and ranks), whatever the split. Model and
optimizer state are whole on rank 0 for DDP (``optimizer.pt``), so any M loads them; sharded
backends re-shard on load (``Backend.load_training_state``): an FSDP2 backend through
``torch.distributed.checkpoint`` (its plugin tests 2 -> 1 -> 2 processes), ZeRO as far as its
plugin does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from corelooper.errors import ConfigError


@dataclass(frozen=True)
class Geometry:
    world_size: int
    per_device: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.per_device * self.accumulation

    @property
    def micro_batch(self) -> int:
        """Samples in one micro-batch across all ranks (one slice of the epoch's order)."""
        return self.world_size * self.per_device

    def describe(self) -> str:
        return (
            f"{self.per_device} per device x {self.accumulation} accumulation x "
            f"{self.world_size} processes = {self.global_batch}"
        )


def saved_geometry(state: dict[str, Any]) -> Geometry | None:
    """The geometry a checkpoint's ``loop_state.json`` was written with (None: an old format)."""
    try:
        return Geometry(
            int(state["world_size"]),
            int(state["train_batch_size"]),
            int(state["gradient_accumulation_steps"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


def plan(saved: Geometry, world_size: int, per_device: int) -> Geometry:
    """The geometry on ``world_size`` processes that keeps ``saved.global_batch``.

    ``per_device`` is the configured micro-batch: kept when an exact accumulation exists, else
    lowered to the largest size that divides (never raised: it could run out of memory).
    """
    total = saved.global_batch
    if total % world_size:
        working = [n for n in range(1, total + 1) if total % n == 0]
        raise ConfigError(
            f"Cannot resume exactly on {world_size} processes: the checkpoint's global batch is "
            f"{saved.describe()} samples, and {total} is not divisible by {world_size}. Resume "
            f"on a number of processes that divides it ({', '.join(map(str, working))}), or start "
            "a new run (another train.output_dir) with the batch size you want."
        )
    per_rank = total // world_size
    for size in range(min(per_device, per_rank), 0, -1):
        if per_rank % size == 0:
            return Geometry(world_size, size, per_rank // size)
    raise AssertionError("unreachable: size 1 always divides")


def settle(config, plugins, directory, world_size: int, dataset, announce: bool):
    """The run's config for resuming ``directory`` on ``world_size`` processes: on another
    world size than it was saved on, a copy with the geometry that keeps the checkpoint's global
    batch (one line says so); else ``config`` itself.

    Called (``resume_config``) by ``Loop.__init__`` after the config is validated and before any
    plugin is configured, so the config every plugin sees is final, and by ``Loop.train`` for its
    ``resume_from_checkpoint`` argument (``announce`` False: the core refuses another geometry). ``dataset`` is the training data
    (called only when needed: it may be built from the config). A missing or unreadable
    ``loop_state.json`` is left to the checkpoint's own verification, which names the file.
    """
    new = planned_geometry(config, plugins, directory, world_size, dataset)
    if new is None:
        return config
    saved = saved_geometry(_read_state(directory))
    if announce:
        print(
            f"corelooper: {directory} was saved with {saved.describe()}; on "  # the step: the console's line
            f"{new.world_size} processes: {new.describe()} (global batch kept)",
            flush=True,
        )
        data = dataset()
        if not _is_iterable(data):  # a stream's length is unknown (docs/clusters.md says what differs)
            _warn_if_epoch_end_differs(len(data), saved, new, config.train)
    if (new.per_device, new.accumulation) == (
        config.train.per_device_train_batch_size,
        config.train.gradient_accumulation_steps,
    ):
        return config  # the configured geometry already keeps the global batch
    return config.replace(
        "train", per_device_train_batch_size=new.per_device, gradient_accumulation_steps=new.accumulation
    )


def planned_geometry(config, plugins, directory, world_size: int, dataset) -> Geometry | None:
    """The geometry that resuming ``directory`` needs, or None when the configured one is used."""
    state = _read_state(directory)
    saved = saved_geometry(state) if state is not None else None
    args = config.train
    now = Geometry(world_size, args.per_device_train_batch_size, args.gradient_accumulation_steps)
    if saved is None or saved.world_size == now.world_size:
        return None
    data = dataset()
    if data is None:
        return None
    stream = _is_iterable(data)
    if stream and not _can_resplit_stream(config, plugins, data, world_size, saved, directory):
        return None  # ignore_data_skip: the stream restarts, the configured geometry is used
    if not stream:
        _check_order_independent_of_geometry(args, world_size, saved, str(directory))
    return now if now.global_batch == saved.global_batch else plan(saved, now.world_size, now.per_device)


def _read_state(directory) -> dict[str, Any] | None:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(directory) / "loop_state.json").read_text())
    except (OSError, ValueError):
        return None


def steps_per_epoch(n: int, geometry: Geometry, drop_last: bool) -> int:
    """Optimizer steps in an epoch of ``n`` samples, as the loader and ``plan_steps`` count them:
    micro-batches of ``per_device x world_size`` samples (a short last one padded, or dropped
    with ``drop_last``), ``accumulation`` of them per step."""
    import math

    per_micro = geometry.per_device * geometry.world_size
    micro = n // per_micro if drop_last else math.ceil(n / per_micro)
    return math.ceil(micro / geometry.accumulation)


def _warn_if_epoch_end_differs(n: int, saved: Geometry, new: Geometry, args) -> None:
    """Full global batches are the same samples on any world size; a last, short one of an
    epoch is padded (or dropped, ``dataloader_drop_last``) per micro-batch across ranks. With
    ``drop_last`` the steps of an epoch, and so the plan, can change: the warning names it."""
    if not n % saved.global_batch:
        return
    import math
    import warnings

    drop = bool(getattr(args, "dataloader_drop_last", False))
    before, after = steps_per_epoch(n, saved, drop), steps_per_epoch(n, new, drop)
    why = (
        f"the training set ({n} samples) is not a whole number of global batches of {saved.global_batch}, "
        f"and an epoch has {_micro(n, saved, drop)} on {saved.world_size} processes, "
        f"{_micro(n, new, drop)} on {new.world_size}"
    )
    if before == after:
        warnings.warn(
            f"Resuming on {new.world_size} processes (saved on {saved.world_size}): {why}. The plan is "
            f"unchanged ({after} steps per epoch) and every full step continues exactly, but the last, "
            "short step of each epoch is padded or dropped per micro-batch, which differs on another "
            "world size.",
            stacklevel=3,
        )
        return
    epochs = getattr(args, "num_train_epochs", 1)
    total_before, total_after = (
        (args.max_steps, args.max_steps)
        if args.max_steps > 0
        else (math.ceil(epochs * s) for s in (before, after))
    )
    total = f"{total_before} -> {total_after} steps, " if total_before != total_after else ""
    warnings.warn(
        f"Resuming on {new.world_size} processes changes the plan: {total}{before} -> {after} steps per "
        f"epoch. The global batch is kept ({saved.global_batch} samples per step), but {why}: with "
        "train.dataloader_drop_last the short micro-batches are dropped, so an epoch holds another number "
        f"of steps. Every full step continues exactly; to keep the plan, resume on {saved.world_size} "
        f"processes{f' or set train.max_steps = {total_before}' if total else ''}.",
        stacklevel=3,
    )


def _micro(n: int, geometry: Geometry, drop: bool) -> str:
    per_micro = geometry.per_device * geometry.world_size
    whole, rest = divmod(n, per_micro)
    short = "" if not rest else (" (the short one dropped)" if drop else f" (the last one of {rest}, padded)")
    return f"{whole + (0 if drop or not rest else 1)} micro-batches of {per_micro} samples{short}"


def adapt(loop, state: dict[str, Any], where: str = "the checkpoint") -> dict[str, Any]:
    """While loading a checkpoint: ``state`` (its loop state) with the position in the epoch
    rewritten for this geometry (samples consumed, in this run's micro-batches).

    With the same global batch as saved (``settle`` ran), no sample is repeated or
    skipped. With another one (the batch was changed on purpose) training continues with a
    warning that it is not the run an uninterrupted one would have been.
    """
    saved, now = saved_geometry(state), current_geometry(loop)
    if saved is None or saved == now:
        return state
    loader = getattr(loop, "train_loader", None)
    own_position = callable(getattr(loader, "load_state_dict", None))  # a stream's loader
    if saved.global_batch != now.global_batch or (
        own_position and getattr(loader, "split", None) != "global"
    ):
        _warn_not_exact(saved, now)  # a stream split by shards: refused in settle, or restarted
        return state
    if own_position:
        return state  # a global stream position: the loader's load_state_dict continues it
    position = state.get("micro_batches_in_epoch", 0) * saved.micro_batch  # samples consumed
    if position % now.micro_batch:
        raise ConfigError(
            f"Cannot resume {where} exactly with {now.describe()}: it stopped after {position} "
            f"samples of the epoch, not a whole number of micro-batches of {now.micro_batch}. "
            f"Resume with train.per_device_train_batch_size = {saved.per_device} on "
            f"{saved.world_size} processes."
        )
    if loop.state.is_world_process_zero:
        print(
            f"corelooper: continuing after sample {position} of epoch {_epoch_index(state)} "
            "(no sample repeated or skipped)",
            flush=True,
        )
    return {**state, "micro_batches_in_epoch": position // now.micro_batch}


def _epoch_index(state: dict[str, Any]) -> int:
    """The epoch a checkpoint stopped in (as ``Loop._train_loop`` computes its start epoch)."""
    per_epoch = state.get("steps_per_epoch") or 0
    return round(state.get("epoch", 0) - state.get("step_in_epoch", 0) / per_epoch) if per_epoch else 0


def current_geometry(loop) -> Geometry:
    a = loop.args
    return Geometry(loop.state.world_size, a.per_device_train_batch_size, a.gradient_accumulation_steps)


def _is_iterable(dataset) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


def _check_order_independent_of_geometry(args, world_size: int, saved: Geometry, where: str) -> None:
    """group_by_length groups samples in mega-batches of one global micro-batch: another
    micro-batch size is another order, so the rest of the epoch would repeat or skip samples."""
    if getattr(args, "group_by_length", False):
        raise ConfigError(
            f"Cannot resume {where} on {world_size} processes with train.group_by_length "
            f"= true: the sample order depends on the micro-batch across ranks ({saved.micro_batch} "
            f"when saved). Resume on {saved.world_size} processes, or set train.group_by_length = "
            "false for a new run."
        )


def _can_resplit_stream(config, plugins, dataset, world_size: int, saved: Geometry, directory) -> bool:
    """A stream split by shards keeps one position per process x worker: another world size
    cannot continue it. True when the stream's global position continues on this world size."""
    if _other_loader(plugins):
        return False  # a plugin's loader: its load_state_dict decides (adapt warns)
    from corelooper_streaming.loader import choose_split, saved_split

    a, requested = config.train, config.section("streaming").get("split", "auto")  # train.stream_split
    split, on_disk = choose_split(dataset, requested, a.dataloader_num_workers), saved_split(directory)
    if split.mode == "global" and on_disk != "shards" or on_disk == "global":
        return True  # a global position (a split that differs is refused as the data state loads)
    if a.ignore_data_skip:
        return False
    if split.mode == "global":  # this run would read globally, the checkpoint's is in shards
        why = "as the run that saved it split its stream"
        fix = (
            f"New runs of this configuration read their stream globally ({split.why}) and resume on "
            "any number of processes."
        )
    else:
        why = split.why
        fix = f"New runs read their stream globally, and resume on any number of processes, if you {split.to_global}."
    raise ConfigError(
        f"Cannot resume {directory} on {world_size} processes: it was saved on "
        f"{saved.world_size}, and its training stream is split into shards (train.stream_split = "
        f'"shards", {why}), one per process x dataloader worker, each with its own position; a stream '
        f"cannot be re-split. Resume on {saved.world_size} processes with the same "
        "train.dataloader_num_workers, or set train.ignore_data_skip = true to restart the stream "
        f"from its beginning (samples seen again). {fix}"
    )


def _other_loader(plugins) -> bool:
    """Whether a plugin other than the builtin and corelooper-streaming loads the training data."""
    from corelooper.plugins import BUILTIN

    try:
        import corelooper_streaming
    except ImportError:  # then another plugin loads the stream: its load_state_dict decides
        return True

    known = (plugins.pm.get_plugin(BUILTIN), corelooper_streaming)
    return any(all(i.plugin is not k for k in known) for i in plugins.hook.train_dataloader.get_hookimpls())


def _warn_not_exact(saved: Geometry, now: Geometry) -> None:
    import warnings

    warnings.warn(
        f"Resuming with a different batch ({saved.describe()} when saved, {now.describe()} now): "
        "training continues from the checkpoint, but not with the batches an uninterrupted run "
        "would have seen.",
        stacklevel=3,
    )
