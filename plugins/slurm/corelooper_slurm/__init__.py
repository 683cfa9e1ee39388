"""corelooper-slurm: ``corelooper slurm CONFIG --nodes N --gpus-per-node G`` writes and submits an
sbatch script that runs the config with one torchrun per node (c10d rendezvous on the first
node), and requeues itself on Slurm's warning signal after every rank has saved a checkpoint.
``srun corelooper run CONFIG`` in an allocation forms one run of the step's tasks (environment.py).

This module imports neither torch nor corelooper's loop: ``corelooper --help`` loads it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Annotated

import typer  # already imported by the CLI that calls the hook; cheap

__version__ = "0.2.0"


def corelooper_add_commands(app) -> None:
    # The CLI's start, before any command runs: `srun corelooper run ...` in an allocation makes
    # one distributed run of the step's tasks (environment.py), as torchrun's variables would.
    from .environment import adopt_srun_environment

    adopt_srun_environment()

    @app.command()
    def slurm(
        config: Annotated[Path, typer.Argument(metavar="CONFIG", help="The TOML config file.")],
        nodes: Annotated[int, typer.Option("--nodes", "-N", help="Nodes to allocate.")] = 1,
        gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node (0: CPU).")] = 0,
        nproc_per_node: Annotated[
            int | None,
            typer.Option("--nproc-per-node", help="Ranks per node (default: GPUs per node, or 1)."),
        ] = None,
        time: Annotated[str | None, typer.Option("--time", "-t", help="Time limit, e.g. 2-00:00:00.")] = None,
        partition: Annotated[str | None, typer.Option("--partition", help="Slurm partition.")] = None,
        account: Annotated[str | None, typer.Option("--account", "-A", help="Slurm account.")] = None,
        cpus_per_task: Annotated[
            int | None,
            typer.Option(
                "--cpus-per-task", help="CPUs for each node's ranks (default: the whole node, --exclusive)."
            ),
        ] = None,
        signal: Annotated[
            str, typer.Option("--signal", help="Warning signal that saves and requeues.")
        ] = "USR1",
        grace: Annotated[
            int | None,
            typer.Option(
                "--grace",
                help="Seconds between that signal and the end (default: 120, or 60 + 2 x the last "
                "checkpoint's measured save time when that is more).",
            ),
        ] = None,
        port: Annotated[
            int | None,
            typer.Option(
                "--port",
                help="Rendezvous port on the first node (default: the first free one from 15000 + job id "
                "% 10000).",
            ),
        ] = None,
        max_requeues: Annotated[
            int,
            typer.Option(
                "--max-requeues", help="Requeue at most this many times (each only after a newer checkpoint)."
            ),
        ] = 20,
        min_nodes: Annotated[
            int | None,
            typer.Option(
                "--min-nodes",
                help="Go on with this many nodes when others are lost: their survivors resume the newest "
                "checkpoint (default: --nodes, a lost node ends the job).",
            ),
        ] = None,
        max_restarts: Annotated[
            int | None,
            typer.Option(
                "--max-restarts",
                help="torchrun's restarts after a lost node or failed rank (default: 3 with "
                "--min-nodes below --nodes, else 0).",
            ),
        ] = None,
        output: Annotated[
            str | None, typer.Option("--output", "-o", help="Job log (sbatch --output).")
        ] = None,
        set_: Annotated[
            list[str] | None,
            typer.Option("--set", "-s", metavar="KEY=VALUE", help="Config override (repeatable)."),
        ] = None,
        plugin: Annotated[
            list[str] | None,
            typer.Option("--plugin", "-p", help="As -p of `corelooper run` (no:NAME, module)."),
        ] = None,
        sbatch_arg: Annotated[
            list[str] | None, typer.Option("--sbatch-arg", help="Extra #SBATCH line.")
        ] = None,
        script: Annotated[Path | None, typer.Option("--script", help="Also write the script here.")] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the script; submit nothing.")] = False,
    ) -> None:
        """Run CONFIG as a Slurm job: one torchrun per node; on SIGUSR1 save, requeue, resume."""
        from corelooper.errors import ConfigError, CorelooperError

        from .script import JobSpec, render

        try:
            if not config.is_file():
                raise ConfigError(f"Config file {str(config)!r} does not exist (or is not a file).")
            output_dir = resolve_output_dir(config, list(set_ or []))
            spec = JobSpec(
                config=config.resolve(),
                nodes=nodes,
                gpus_per_node=gpus_per_node,
                nproc_per_node=nproc_per_node,
                time=time,
                partition=partition,
                account=account,
                cpus_per_task=cpus_per_task,
                signal=signal,
                grace=grace or default_grace(output_dir),
                port=port,
                max_requeues=max_requeues,
                min_nodes=min_nodes,
                max_restarts=max_restarts,
                output=output,
                output_dir=output_dir,
                overrides=list(set_ or []),
                plugin_options=list(plugin or []),
                sbatch_args=list(sbatch_arg or []),
            )
            text = render(spec)
            if script is not None:
                script.write_text(text)
            if dry_run:
                typer.echo(text)
                return
            typer.echo(f"Submitted batch job {submit(text)}")
        except CorelooperError as e:
            typer.echo(f"corelooper: error: {e}", err=True)
            raise typer.Exit(e.exit_code) from None


def resolve_output_dir(config: Path, overrides: list[str]) -> Path:
    """``train.output_dir`` of the config with its overrides, absolute (the job runs in this
    folder: ``--chdir``)."""
    from corelooper.config import Config

    return (Path.cwd() / Config.load(config, overrides).train.output_dir).resolve()


SAVE_TIME_FILE = ".corelooper-slurm-save.json"


def default_grace(output_dir: Path) -> int:
    """120 s, or 60 s + twice the last checkpoint's measured save time when that is more (the
    signal must leave time for one step, the save and the ranks' exit)."""
    try:
        seconds = float(json.loads((output_dir / SAVE_TIME_FILE).read_text())["save_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return 120
    return max(120, math.ceil(60 + 2 * seconds))


# In a Slurm job, rank 0 measures each checkpoint save (from the end of the step that saves to
# the end of the save) and keeps the last one in output_dir, for the next submission's --grace.
_step_ended: list[float] = []


def on_step_end(state) -> None:
    if "SLURM_JOB_ID" in os.environ and state.is_world_process_zero:
        _step_ended[:] = [time.monotonic()]


def on_save(state, checkpoint_dir) -> None:
    if "SLURM_JOB_ID" not in os.environ or not state.is_world_process_zero or not _step_ended:
        return
    record = {
        "checkpoint": Path(checkpoint_dir).name,
        "save_seconds": round(time.monotonic() - _step_ended[0], 3),
    }
    with contextlib.suppress(OSError):  # a measurement only: never fail a run for it
        (Path(checkpoint_dir).parent / SAVE_TIME_FILE).write_text(json.dumps(record) + "\n")


def submit(text: str) -> str:
    """``sbatch --parsable`` with the script on stdin; returns the job id."""
    from corelooper.errors import CorelooperError

    try:
        proc = subprocess.run(
            ["sbatch", "--parsable"], input=text, capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError:
        raise CorelooperError(
            "sbatch was not found on PATH: run `corelooper slurm` on a Slurm login node, or use "
            "--dry-run (and --script FILE) to write the script and submit it there."
        ) from None
    if proc.returncode != 0:
        raise CorelooperError(f"sbatch refused the job (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]
