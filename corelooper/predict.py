"""The ``corelooper predict`` and ``corelooper eval`` commands: a checkpoint's model on a data set."""

from __future__ import annotations

import json
from pathlib import Path

from .outputs import write_predictions

# -- the predict / eval commands ------------------------------------------------------------------


def _loop_from_checkpoint(config, checkpoint: str, blocked: list[str]):
    from . import checkpoint as ckpt
    from .loop import Loop

    loop = Loop(config=config, blocked_plugins=blocked)
    directory = ckpt.resolve(checkpoint, Path(loop.args.output_dir))
    loop.prepare_for_evaluation()
    ckpt.load_weights(loop, directory)
    state = directory / "loop_state.json"
    if state.is_file():  # metrics logged by this evaluation carry the checkpoint's step
        try:
            loop.state.global_step = int(json.loads(state.read_text()).get("global_step", 0))
        except (ValueError, TypeError):
            pass
    return loop, directory


def _dataset(loop, split: str):
    from .build import config_dir
    from .config import import_object
    from .errors import DataError

    ref = getattr(loop.config.data, split, None)
    if split == "test" and not ref:
        split, ref = "eval", loop.config.data.eval
    if split == "eval" and loop.eval_dataset is not None:
        return loop.eval_dataset, "data.eval"
    if split == "train" and loop.train_dataset is not None:
        return loop.train_dataset, "data.train"
    if not ref:
        raise DataError(
            f"No data to predict on: set data.test (or data.eval) in the config to a 'module:callable' "
            f"returning a dataset (asked for {split!r})."
        )
    factory = import_object(ref, f"data.{split}", config_dir(loop.config))
    return factory(**loop.config.data.args), f"data.{split}"


def predict(config, checkpoint: str, output: str | None, blocked: list[str] = (), split: str = "test"):
    """``corelooper predict``: returns ``(path written or None, metrics)``; rank 0 writes."""
    loop, directory = _loop_from_checkpoint(config, checkpoint, list(blocked))
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
    dataset, _ = _dataset(loop, split)
    return loop.evaluate(dataset), loop
