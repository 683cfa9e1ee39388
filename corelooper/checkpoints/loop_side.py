"""The loop's side of checkpoints: what a ``Loop`` puts into one and takes back out.

``corelooper.checkpoints.checkpoint`` writes and reads with explicit arguments; this module gathers them
from the public Loop API (model, optimizer, scheduler, state, the registered plugin states, the
log window, the loader's position) and fires ``on_save`` / ``on_load_checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

from . import checkpoint, elastic


def save(loop) -> Path:
    """Write ``checkpoint-{global_step}`` of the run and fire ``on_save``."""
    window = loop.log_window.state_dict()  # an unlogged window: one host sync, at save time
    path = checkpoint.save_checkpoint(
        Path(loop.args.output_dir), model=loop.model, backend=loop.backend, optimizer=loop.optimizer,
        scheduler=loop.scheduler, config=loop.config, state=loop.state,
        plugin_states=checkpoint.collect_plugin_states(loop.plugins.stateful.items()),
        extra_process_state={"log_window": window} if window else {},
        data_state=checkpoint.loader_state(loop.train_loader),
    )
    loop.events.fire("on_save", checkpoint_dir=path)
    return path


def resume(loop, directory: Path) -> None:
    """Restore everything the run saved in ``directory``, then fire ``on_load_checkpoint``."""
    from ..data import streaming

    restored = checkpoint.load_checkpoint(
        directory, model=loop.model, backend=loop.backend, optimizer=loop.optimizer,
        scheduler=loop.scheduler, config=loop.config, state=loop.state,
    )
    # Saved on another world size: the same position, in this run's micro-batches (elastic.py).
    position = elastic.adapt(loop, restored.loop_state.to_dict(), str(directory))
    restored.loop_state.micro_batches_in_epoch = position["micro_batches_in_epoch"]
    restored.apply(loop.state)
    checkpoint.apply_plugin_states(loop.plugins.stateful.items(), restored.plugin_states, directory)
    loop.log_window.load_state_dict(restored.extra_process_state.get("log_window"))
    streaming.load_data_state(loop, directory)  # a streaming loader's position (or a warning)
    loop.events.fire("on_load_checkpoint", checkpoint_dir=directory)


def finish(loop) -> None:
    """The final model in ``output_dir``: the best checkpoint's weights when asked for."""
    a, s = loop.args, loop.state
    if a.load_best_model_at_end and s.best_model_checkpoint:
        checkpoint.load_weights(Path(s.best_model_checkpoint), model=loop.model, backend=loop.backend)
    checkpoint.save_model(Path(a.output_dir), model=loop.model, backend=loop.backend,
                          max_shard_size=a.save_max_shard_size)
    if a.save_total_limit == 1 and s.best_model_checkpoint and loop.backend.is_main_process:
        from .run_dir import keep_only_best

        keep_only_best(Path(a.output_dir), s.best_model_checkpoint)  # HF 5.x, once training is over
