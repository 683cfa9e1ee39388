"""The ``corelooper predict`` and ``corelooper eval`` commands: a checkpoint's model on a data set."""

from __future__ import annotations

import json
from pathlib import Path

from corelooper.cli.predictions import write_predictions

# -- the predict / eval commands ------------------------------------------------------------------


def _loop_from_checkpoint(config, checkpoint: str, blocked: list[str]):
    from corelooper.checkpoints import checkpoint as ckpt
    from corelooper.loop import Loop

    loop = Loop(config=config, blocked_plugins=blocked)
    # "auto" would mean "none yet" when there is none; evaluating needs one: same as "latest"
    directory = ckpt.resolve("latest" if checkpoint == "auto" else checkpoint, Path(loop.args.output_dir),
                             for_training=False)
    loop.prepare_for_evaluation()
    ckpt.load_weights(directory, model=loop.model, backend=loop.backend)
    state = directory / "loop_state.json"
    if state.is_file():  # metrics logged by this evaluation carry the checkpoint's step
        try:
            loop.state.global_step = int(json.loads(state.read_text()).get("global_step", 0))
        except (ValueError, TypeError):
            pass
    return loop, directory


def _dataset(loop, split: str):
    from corelooper.build import build_dataset
    from corelooper.errors import DataError

    ref = getattr(loop.config.data, split, None)
    if split == "test" and not ref:
        split, ref = "eval", loop.config.data.eval
    if split == "eval" and loop.eval_dataset is not None:
        return loop.eval_dataset, "data.eval"
    if split == "train" and loop.train_dataset is not None:
        return loop.train_dataset, "data.train"
    if not ref:
        raise DataError(
            f"No data to predict on: set data.test (or data.eval) in the config to a data file or a "
            f"'module:callable' returning a dataset (asked for {split!r})."
        )
    return build_dataset(loop.plugins, loop.config, split), f"data.{split}"


def predict(config, checkpoint: str, output: str | None, blocked: list[str] = (), split: str = "test"):
    """``corelooper predict``: returns ``(path written or None, metrics)``; rank 0 writes."""
    loop, directory = _loop_from_checkpoint(config, checkpoint, list(blocked))
    with loop:  # corelooper_unconfigure once the predictions are out
        dataset, _ = _dataset(loop, split)
        preds, labels, metrics = loop.predict(dataset)
        path = Path(output) if output else Path(loop.args.output_dir) / "predictions.safetensors"
        if loop.backend.is_main_process:
            write_predictions(path, preds, labels, metrics)
        loop.backend.wait_for_everyone()
    return path, metrics, loop


def evaluate(config, checkpoint: str, blocked: list[str] = (), split: str = "eval"):
    """``corelooper eval``: the metrics of the checkpoint's model on ``data.eval``."""
    loop, directory = _loop_from_checkpoint(config, checkpoint, list(blocked))
    with loop:  # corelooper_unconfigure once the metrics are logged
        dataset, _ = _dataset(loop, split)
        return loop.evaluate(dataset), loop
