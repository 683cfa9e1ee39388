"""corelooper-ray: ``corelooper ray CONFIG`` runs a config under Ray Train's ``TorchTrainer``.

``[ray]`` configures it (``num_workers``, ``use_gpu``, ``max_failures``, ...). Every worker runs
the same ``Loop`` as ``corelooper run`` under torchrun would (Ray sets up the process group);
each checkpoint is reported to Ray with the latest metrics, and after a worker failure Ray
restarts the group, which resumes from the last reported checkpoint.

This module imports neither ray nor torch: ``corelooper --help`` loads it. In ``corelooper run``
the ``[ray]`` section is only declared (so configs that carry one validate); nothing changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer  # already imported by the CLI that calls the hook; cheap

__version__ = "0.2.0"

SECTION = "ray"
DEFAULTS: dict[str, Any] = {
    "num_workers": 2,  # training processes (Ray actors), one per GPU when use_gpu
    "use_gpu": "auto",  # "auto": when the Ray cluster has GPUs; or true / false
    "resources_per_worker": {},  # e.g. { CPU = 8, GPU = 1 }; default: Ray's (1 CPU, 1 GPU with use_gpu)
    "max_failures": 0,  # worker-group restarts after a failure; -1: unlimited (Ray's FailureConfig)
    "address": "",  # Ray cluster to join ("auto", "ray://host:10001"); default: RAY_ADDRESS or a local one
    "storage_path": "",  # where Ray keeps reported checkpoints (a shared path, s3://...); default Ray's
    "name": "",  # Ray Train run name; default: the name of train.output_dir
    "num_cpus": 0,  # CPUs of a local cluster started here (0: all)
}


def corelooper_config_sections() -> dict[str, dict[str, Any]]:
    return {SECTION: dict(DEFAULTS)}


def corelooper_add_commands(app) -> None:
    @app.command()
    def ray(
        config: Annotated[Path, typer.Argument(metavar="CONFIG", help="The TOML config file.")],
        set_: Annotated[
            list[str] | None,
            typer.Option("--set", "-s", metavar="KEY=VALUE", help="Config override (repeatable)."),
        ] = None,
        p: Annotated[
            list[str] | None, typer.Option("-p", metavar="NAME", help="As -p of `corelooper run`.")
        ] = None,
        resume_from_checkpoint: Annotated[
            str | None,
            typer.Option(
                "--resume-from-checkpoint",
                metavar="latest|auto|PATH",
                help="Default: auto (see docs/clusters.md).",
            ),
        ] = None,
        traceback_: Annotated[bool, typer.Option("--traceback", help="Show the full traceback.")] = False,
    ) -> None:
        """Train CONFIG under Ray Train (TorchTrainer); [ray] sets workers and failure handling."""
        from corelooper.cli.api import fail, load_config, split_plugin_options

        try:
            blocked, local = split_plugin_options(p)
            cfg = load_config(config, set_, local)  # a bad config fails here, before Ray starts
            from .trainer import fit

            result = fit(cfg, blocked, resume_from_checkpoint)
        except Exception as e:
            fail(e, traceback_)
        typer.echo(f"corelooper-ray: finished; metrics {result.metrics}; checkpoint {result.checkpoint}")
