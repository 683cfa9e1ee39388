"""``corelooper lm predict``: a checkpoint's causal LM on the run's evaluation set, one JSON line
per sample (``predict.py``), optionally with generated text (``--generate``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from corelooper.cli.api import PluginOpt, SetOpt, TracebackOpt, fail, load_config, split_plugin_options

SPLITS = ("eval", "train")


def register(app) -> None:
    lm = typer.Typer(help="Causal-LM commands (corelooper-lm).", no_args_is_help=True)
    app.add_typer(lm, name="lm")

    @lm.command("predict")
    def predict(
        config: Annotated[Path, typer.Argument(metavar="CONFIG", help="The TOML config file.")],
        checkpoint: Annotated[
            str, typer.Option("--checkpoint", "-c", help="A checkpoint folder, a model folder, or 'latest'.")
        ] = "latest",
        output: Annotated[
            Path | None,
            typer.Option("--output", "-o", help="FILE.jsonl (default: output_dir/predictions.jsonl)."),
        ] = None,
        generate: Annotated[
            bool, typer.Option("--generate", help="Continue each sample's prompt with model.generate.")
        ] = False,
        max_new_tokens: Annotated[
            int, typer.Option("--max-new-tokens", help="Tokens generated per sample (with --generate).")
        ] = 64,
        split: Annotated[
            str, typer.Option("--split", help="eval (data.eval / eval_split) or train.")
        ] = "eval",
        set_: SetOpt = None,
        p: PluginOpt = None,
        traceback_: TracebackOpt = False,
    ) -> None:
        """One JSON line per sample of CONFIG's evaluation set: loss, predicted and target token ids
        (and, with --generate, the prompt and the generated text), from a checkpoint's model."""
        try:
            blocked, local = split_plugin_options(p)
            path, n = run(
                load_config(config, set_, local), blocked, checkpoint, output, split, generate, max_new_tokens
            )
            typer.echo(f"{n} samples written to {path}, one record each")
        except Exception as e:
            fail(e, traceback_)


def run(config, blocked, checkpoint: str, output, split: str, generate: bool, max_new_tokens: int):
    """``(path written, samples)``."""
    from corelooper.cli.api import write_records

    from corelooper.errors import ConfigError, DataError

    if split not in SPLITS:
        raise ConfigError(f"--split {split!r}: use one of {', '.join(SPLITS)}.")
    path = Path(output) if output else None
    if path is not None and path.suffix != ".jsonl":
        raise ConfigError(
            f"--output {str(path)!r}: corelooper lm predict writes JSON Lines, a file ending in .jsonl."
        )
    with _checkpoint_loop(config, blocked, checkpoint) as loop:
        dataset = loop.eval_dataset if split == "eval" else loop.train_dataset
        if dataset is None:
            raise DataError(
                f"No {split} data to predict on: set data.{split}"
                + (" (or data.eval_split)" if split == "eval" else "")
                + " in the config."
            )
        rows = causal_records(loop, dataset, {"generate": generate, "max_new_tokens": max_new_tokens})
        if rows is None:
            raise DataError(
                "corelooper lm predict needs a causal LM that generates (model.can_generate()) and "
                "tokenized samples (input_ids); use `corelooper predict` for other models."
            )
        path = path or Path(loop.args.output_dir) / "predictions.jsonl"
        return path, write_records(path, rows)


def causal_records(loop, dataset, options: dict):
    """The ``predict_records`` answer for a causal LM on tokenized samples (None for another
    model or data set): per-sample loss, tokens and, with ``options["generate"]``, text."""
    from corelooper.errors import ConfigError

    from .predict import is_causal_lm, records

    model = loop.backend.unwrap_model(loop.model)
    if not is_causal_lm(model, dataset):
        return None
    generate, max_new_tokens = options.get("generate", False), options.get("max_new_tokens", 64)
    if generate and max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: generating needs at least 1.")
    tok = _tokenizer(loop)
    ids = (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None))
    pad = next((i for i in ids if i is not None), 0)

    def on_batch(items) -> None:
        loop.events.fire(
            "on_prediction_step", batch={"input_ids": [it["input_ids"] for it in items]}, outputs=None
        )

    size = loop.args.per_device_eval_batch_size
    return records(model, dataset, size, pad, tok, max_new_tokens if generate else 0, on_batch)


def _checkpoint_loop(config, blocked, checkpoint: str):
    """A Loop with the checkpoint's weights (``corelooper predict``'s way to load them)."""
    import json

    from corelooper.checkpoints import checkpoint as ckpt
    from corelooper.loop import Loop

    loop = Loop(config=config, blocked_plugins=list(blocked))
    directory = ckpt.resolve(
        "latest" if checkpoint == "auto" else checkpoint, Path(loop.args.output_dir), for_training=False
    )
    loop.prepare_for_evaluation()
    ckpt.load_weights(directory, model=loop.model, backend=loop.backend)
    state = directory / "loop_state.json"
    if state.is_file():
        try:
            loop.state.global_step = int(json.loads(state.read_text()).get("global_step", 0))
        except (ValueError, TypeError):
            pass
    return loop


def _tokenizer(loop):
    """The run's tokenizer (``[model] tokenizer`` / ``name_or_path``), else the model folder's; None
    when there is none (the records then hold token ids only)."""
    try:
        from corelooper_hf.model import load_tokenizer

        tok = load_tokenizer(loop.config)
    except ImportError:
        tok = None
    source = getattr(getattr(loop.model, "config", None), "_name_or_path", None)
    if tok is None and source and Path(source).is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    return tok
