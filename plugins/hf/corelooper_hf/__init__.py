"""corelooper-hf: Hugging Face model folders and data files, named in the config.

* ``[model] name_or_path = "path/to/model"``: ``from_pretrained`` of the auto class that
  ``[model] task`` names (``corelooper_hf.model``), answering the ``create_model`` provider;
* ``[data] train = "data/train.jsonl"`` (a path, a glob of shards, a ``save_to_disk`` folder, a
  mixture) and ``eval_split``: read with the ``datasets`` library, memory-mapped
  (``corelooper_hf.files``), answering the ``create_dataset`` provider.

* ``train.report_to = ["mlflow"]`` (every Hugging Face integration but tensorboard and wandb,
  which are corelooper plugins) and ``[hf] callbacks = ["mypkg.cb:MyCallback"]``: HF's
  ``TrainerCallback``s in a ``corelooper run``, through a ``CallbackBridge``
  (``corelooper_hf.reporting``, also the entry point ``hf_integrations`` that declares the names);

* ``from corelooper_hf import Trainer``: ``transformers.Trainer``'s constructor and public API on
  corelooper (``corelooper_hf.trainer``), with HF's callbacks, ``report_to`` and subclass overrides.

A config that names a ``module:callable`` factory instead is left to the builtin (this plugin
returns None), so installing it changes nothing for such runs.

Every data path is checked when the run is configured (``corelooper_configure``), before the
model is loaded: a wrong path fails in seconds, naming the key and where it looked.
"""

from __future__ import annotations

from pathlib import Path  # typer reads the command's annotations in this module's namespace

from corelooper import hookimpl

__version__ = "0.2.0"


def __getattr__(name: str):
    # Lazy: `corelooper --help` loads this plugin and must not import transformers or torch.
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'corelooper_hf' has no attribute {name!r}")


@hookimpl
def corelooper_config_sections():
    # "module:Class" or { ref = "module:Class", args = { ... } }: HF TrainerCallbacks (reporting.py)
    return {"hf": {"callbacks": []}}


@hookimpl
def corelooper_configure(config, plugins):
    from .files import check_paths
    from .reporting import configure

    check_paths(config)
    configure(config, plugins)


@hookimpl
def create_model(config):
    if config.model.factory or not config.model.name_or_path:
        return None
    from .model import load_pretrained

    return load_pretrained(config)


@hookimpl
def create_dataset(config, split):
    from .files import is_data_ref, load_split

    base = config.source.parent if config.source else None
    ref = getattr(config.data, split, None)
    if is_data_ref(ref, base) or (split == "eval" and config.data.eval_split):
        return load_split(config, split)
    return None


@hookimpl
def corelooper_add_commands(app):
    """``corelooper hf-export-config ARGS.json``: a TrainingArguments JSON as a corelooper config."""
    import typer

    @app.command("hf-export-config")
    def hf_export_config(
        source: Path = typer.Argument(
            ..., help="training_args.json (written by save_model) or args.to_json_string()"
        ),
        output: Path = typer.Option(Path("config.toml"), "--output", "-o", help="The config to write."),
    ) -> None:
        """Write a corelooper config for an HF Trainer's TrainingArguments (the ones that differ
        from HF's defaults, under [train]) with a [model]/[data] skeleton to fill in."""
        from corelooper.errors import CorelooperError

        from .trainer.export import export_from_json

        try:
            written = export_from_json(source, output)
        except CorelooperError as e:
            typer.echo(f"corelooper: error: {e}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"wrote {written}: fill in [model] and [data], then `corelooper run {written}`")
