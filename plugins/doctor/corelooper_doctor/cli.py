"""The ``corelooper doctor`` subcommand (added through ``corelooper_add_commands``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def add_commands(app) -> None:
    @app.command("doctor")
    def doctor(
        run_dir: Annotated[
            Path, typer.Argument(help="A run folder (output_dir): finished, crashed or hung.")
        ],
        plot: Annotated[bool, typer.Option("--plot", help="Also write RUN_DIR/doctor/doctor.png.")] = False,
        replay: Annotated[
            str | None,
            typer.Option(
                "--replay",
                help="Re-run a saved non-finite step (e.g. step-7) with the run's config and saved weights.",
            ),
        ] = None,
        traceback_: Annotated[bool, typer.Option("--traceback")] = False,
    ) -> None:
        """Post-mortem of a run: non-finite steps and the module blamed, spikes, memory, time split, hangs, advice."""
        from corelooper.cli.api import fail

        try:
            _doctor(run_dir, plot, replay)
        except Exception as e:
            fail(e, traceback_)


def _doctor(run_dir: Path, plot: bool, replay: str | None) -> None:
    from corelooper.errors import DataError

    from . import postmortem

    if not run_dir.is_dir():
        raise DataError(f"{str(run_dir)!r} is not a folder: pass a run's output_dir.")
    if replay:
        _replay(run_dir, replay)
        return
    info = postmortem.collect(run_dir)
    typer.echo(postmortem.render(run_dir, info))
    if plot:
        path = postmortem.plot(run_dir, info, run_dir / "doctor" / "doctor.png")
        typer.echo(f"plot written to {path}")


def _replay(run_dir: Path, step: str) -> None:
    import json

    from corelooper import Loop
    from corelooper.config import Config
    from corelooper.errors import DataError

    from .replay import replay

    step_dir = run_dir / "doctor" / step
    config_path = run_dir / "config.toml"
    if not step_dir.is_dir() or not config_path.is_file():
        raise DataError(
            f"--replay {step}: needs {step_dir} (a saved non-finite step) and {config_path} "
            "(the run's resolved config); list the saved steps with `corelooper doctor RUN_DIR`."
        )
    config = Config.load(config_path, ["doctor.hang_timeout=0.0"])  # no watchdog for a replay
    if not config.model.factory:
        raise DataError(
            f"--replay {step}: {config_path} names no [model] factory (the run built its model in "
            "Python); replay it there: corelooper_doctor.replay.replay(step_dir, loop)."
        )
    report = replay(step_dir, Loop(config=config))
    typer.echo(json.dumps(report.get("blame"), indent=1, default=str))
