"""The loop's side of checkpoints: what a ``Loop`` puts into one and takes back out.

``corelooper.checkpoints.checkpoint`` writes and reads with explicit arguments; this module gathers them
from the public Loop API (model, optimizer, scheduler, state, the registered plugin states, the
log window, the loader's position) and fires ``on_save`` / ``on_load_checkpoint``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..errors import CheckpointError
from . import checkpoint, resume_settings, run_dir

logger = logging.getLogger("corelooper.checkpoints")


def run_parts(loop) -> checkpoint.RunParts:
    """The Loop's objects a checkpoint holds the state of."""
    return checkpoint.RunParts(
        loop.model, loop.backend, loop.optimizer, loop.scheduler, loop.config, loop.state
    )


def save(loop) -> Path:
    """Write ``checkpoint-{global_step}`` of the run and fire ``on_save``."""
    window = loop.log_window.state_dict()  # an unlogged window: one host sync, at save time
    path = checkpoint.save_checkpoint(
        Path(loop.args.output_dir),
        run_parts(loop),
        plugin_states=checkpoint.collect_plugin_states(loop.plugins.stateful.items()),
        extra_process_state={"log_window": window} if window else {},
        data_state=checkpoint.loader_state(loop.train_loader),
    )
    loop.events.fire("on_save", checkpoint_dir=path)
    return path


def resume(loop, directory: Path) -> None:
    """Restore everything the run saved in ``directory``, then fire ``on_load_checkpoint``."""
    restored = checkpoint.load_checkpoint(directory, run_parts(loop))
    saved = restored.loop_state.to_dict()
    # A plugin rewrites the position in this run's micro-batches (saved on another world size).
    position, _ = loop.plugins.call_provider("resume_position", loop=loop, state=saved, directory=directory)
    if position is None:
        _check_world_size(loop, saved, directory)
    else:
        restored.loop_state.micro_batches_in_epoch = position["micro_batches_in_epoch"]
    restored.apply(loop.state)
    checkpoint.apply_plugin_states(loop.plugins.stateful.items(), restored.plugin_states, directory)
    loop.log_window.load_state_dict(restored.extra_process_state.get("log_window"))
    restore_loader(loop, directory)
    loop.events.fire("on_load_checkpoint", checkpoint_dir=directory)


def _check_world_size(loop, saved: dict, directory: Path) -> None:
    """No plugin adapted the position: one saved on another world size would be wrong here."""
    world, now = saved.get("world_size", loop.state.world_size), loop.state.world_size
    if world != now and not loop.args.ignore_data_skip:
        raise CheckpointError(
            f"Checkpoint {directory} was saved on {world} processes and this run has {now}; its "
            "position in the epoch counts the micro-batches of that world size, and no loaded plugin "
            f"adapts it to this one (the `resume_position` hook). Resume on {world} processes, install "
            "or enable a plugin that resumes on another world size (`corelooper plugins`), or set "
            "train.ignore_data_skip = true to start the epoch's data from its beginning."
        )


def restore_loader(loop, directory: Path) -> None:
    """The training loader's position (torchdata's ``StatefulDataLoader`` protocol): a loader
    with ``load_state_dict`` gets what its ``state_dict()`` saved on this rank
    (``data_state_{rank}.json``; rank 0's on a rank the saving run did not have)."""
    loader = loop.train_loader
    if not callable(getattr(loader, "load_state_dict", None)):
        return
    if loop.args.ignore_data_skip:
        logger.warning(
            "train.ignore_data_skip = true: the training stream starts again from its beginning, "
            "so the samples seen before the checkpoint are seen again."
        )
        return
    own = Path(directory) / f"data_state_{loop.backend.process_index}.json"
    path = own if own.is_file() else Path(directory) / "data_state_0.json"
    if not path.is_file():
        logger.warning(
            "Checkpoint %s has no data position (%s): the training stream starts again from its beginning.",
            directory,
            own.name,
        )
        return
    try:
        state = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{str(path)!r} is unreadable (truncated or corrupt?): {e}") from None
    loader.load_state_dict(state)


def finish(loop) -> None:
    """The final model in ``output_dir``: the best checkpoint's weights when asked for."""
    a, s = loop.args, loop.state
    if a.load_best_model_at_end and s.best_model_checkpoint:
        checkpoint.load_weights(Path(s.best_model_checkpoint), model=loop.model, backend=loop.backend)
        if loop.backend.is_main_process:  # as HF's "Loading best model from ... (score: ...)"
            logger.warning(
                "the final model is the best checkpoint's, %s (%s = %.6g)",
                Path(s.best_model_checkpoint).name,
                a.metric_for_best_model or "eval_loss",
                s.best_metric,
            )
    checkpoint.save_model(
        Path(a.output_dir),
        model=loop.model,
        backend=loop.backend,
        max_shard_size=a.save_max_shard_size,
        finished=s.to_dict(),
    )
    if a.save_total_limit == 1 and s.best_model_checkpoint and loop.backend.is_main_process:
        run_dir.keep_only_best(Path(a.output_dir), s.best_model_checkpoint)  # HF 5.x, once training is over


def finished_run(loop, asked, resume_dir: Path | None) -> bool:
    """Whether ``latest``/``auto`` (``asked``, else the config's) finds the run's final state at this
    plan's last step (``run_dir.finished_state``; also past the newest checkpoint, or with none): then
    ``loop.state`` becomes it, no checkpoint loaded. Else a resume says which steps train again."""
    s, output_dir = loop.state, Path(loop.args.output_dir)
    latest = str(asked or loop.args.resume_from_checkpoint) in ("latest", "auto")
    saved = run_dir.finished_state(output_dir) if latest else None
    if saved is None or saved["global_step"] < s.max_steps:  # as HF: an early stop, a longer plan resume
        if saved and resume_dir is not None and (step := run_dir.step_of(resume_dir)) < saved["global_step"]:
            logger.warning(
                "the run ended at step %d, but its newest checkpoint is %s: steps %d-%d are trained again",
                saved["global_step"],
                resume_dir.name,
                step + 1,
                saved["global_step"],
            )
        return False
    resume_settings.check_same_model(loop.config, output_dir)  # the right folder (its config.toml)
    for key in checkpoint.RESTORED_FIELDS:
        setattr(s, key, saved.get(key, getattr(s, key)))
    return True
