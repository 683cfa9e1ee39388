"""The ``corelooper predict`` and ``corelooper eval`` commands: a checkpoint's model on a data set.

Both leave the training run's folder as it was: they call the ``evaluation_loop`` provider
directly instead of ``Loop.evaluate()``/``Loop.predict()``, so no ``on_log``/``on_predict``
reaches the run's loggers (``metrics.jsonl``, TensorBoard, W&B). Their results go to stdout
and to the predictions file they are given.
"""

from __future__ import annotations

import json
from pathlib import Path

from corelooper.cli.predictions import write_predictions, write_records


def _loop_from_checkpoint(config, checkpoint: str, blocked: list[str]):
    from corelooper.checkpoints import checkpoint as ckpt
    from corelooper.loop import Loop

    loop = Loop(config=config, blocked_plugins=blocked)
    # "auto" would mean "none yet" when there is none; evaluating needs one: same as "latest"
    directory = ckpt.resolve(
        "latest" if checkpoint == "auto" else checkpoint, Path(loop.args.output_dir), for_training=False
    )
    loop.prepare_for_evaluation()
    ckpt.load_weights(directory, model=loop.model, backend=loop.backend)
    state = directory / "loop_state.json"
    if state.is_file():  # metrics computed here carry the checkpoint's step
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
        return loop.eval_dataset
    if split == "train" and loop.train_dataset is not None:
        return loop.train_dataset
    if not ref:
        raise DataError(
            f"No data to predict on: set data.test (or data.eval) in the config to a data file or a "
            f"'module:callable' returning a dataset (asked for {split!r})."
        )
    return build_dataset(loop.plugins, loop.config, split)


def run_checkpoint(config, checkpoint: str, blocked, split: str, prefix: str, keep_outputs: bool):
    """The checkpoint's model over ``data.<split>``: ``(loop, metrics, predictions, label_ids)``.

    No logging event fires: the run's loggers are not fed (see the module docstring)."""
    loop, _ = _loop_from_checkpoint(config, checkpoint, list(blocked))
    with loop:  # corelooper_unconfigure once the outputs are out
        metrics, preds, labels = _evaluation(loop, _dataset(loop, split), prefix, keep_outputs)
    return loop, metrics, preds, labels


def _evaluation(loop, dataset, prefix: str, keep_outputs: bool):
    """The ``evaluation_loop`` provider's ``(metrics, predictions, label_ids)``, with a progress bar."""
    from corelooper.cli.progress import EvalProgress

    progress = EvalProgress(dataset)  # a bar on a terminal: no event ends this evaluation, so stop() does
    loop.plugins.register(progress, progress.name)
    try:
        return loop.plugins.call_provider(
            "evaluation_loop", loop=loop, dataset=dataset, metric_key_prefix=prefix, keep_outputs=keep_outputs
        )[0]
    finally:
        progress.stop()


def predict(config, checkpoint: str, output: str | None, blocked=(), split: str = "test", options=None):
    """``corelooper predict``: returns ``(path written, metrics, loop)``; rank 0 writes.

    One record per sample (JSON Lines) where a plugin answers ``predict_records`` for this model
    (a causal LM's: loss, predicted tokens, ``--generate``'s text); else the evaluation loop's
    outputs as they are (``write_predictions``)."""
    from corelooper.errors import ConfigError

    options = {"generate": False, "max_new_tokens": 64, **(options or {})}
    loop, _ = _loop_from_checkpoint(config, checkpoint, list(blocked))
    with loop:  # corelooper_unconfigure once the outputs are out
        dataset = _dataset(loop, split)
        records, _ = loop.plugins.call_provider(
            "predict_records", loop=loop, dataset=dataset, options=options
        )
        if records is not None:
            path = Path(output) if output else Path(loop.args.output_dir) / "predictions.jsonl"
            if path.suffix != ".jsonl":
                raise ConfigError(
                    f"--output {str(path)!r}: this model's predictions are one record per sample "
                    "(predict_records), written as JSON Lines: use a file ending in .jsonl."
                )
            if loop.backend.is_main_process:
                write_records(path, records)
            else:  # the same forwards on every process: a sharded model (ZeRO-3) gathers in lockstep
                for _ in records:
                    pass
            loop.backend.wait_for_everyone()
            return path, {}, loop
        if options["generate"]:
            raise ConfigError(
                "--generate: no loaded plugin writes per-sample predictions for this model (the hook "
                "predict_records; `corelooper plugins` lists the installed ones). Drop --generate to "
                "write the model's outputs as they are."
            )
        metrics, preds, labels = _evaluation(loop, dataset, "test", True)
    path = Path(output) if output else Path(loop.args.output_dir) / "predictions.safetensors"
    if loop.backend.is_main_process:
        write_predictions(path, preds, labels, metrics)
    loop.backend.wait_for_everyone()
    return path, metrics, loop


def evaluate(config, checkpoint: str, blocked=(), split: str = "eval"):
    """``corelooper eval``: ``(metrics, loop)`` of the checkpoint's model on ``data.eval``."""
    loop, metrics, _, _ = run_checkpoint(config, checkpoint, blocked, split, "eval", False)
    return metrics, loop
