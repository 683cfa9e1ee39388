"""corelooper-slurm: ``corelooper slurm CONFIG --nodes N --gpus-per-node G`` writes and submits an
sbatch script that runs the config with one torchrun per node (c10d rendezvous on the first
node), and requeues itself on Slurm's warning signal after every rank has saved a checkpoint.

This module imports neither torch nor corelooper's loop: ``corelooper --help`` loads it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Annotated

import typer  # already imported by the CLI that calls the hook; cheap

__version__ = "0.2.0"


def corelooper_add_commands(app) -> None:
    @app.command()
    def slurm(
        config: Annotated[Path, typer.Argument(help="The TOML config file.")],
        nodes: Annotated[int, typer.Option("--nodes", "-N", help="Nodes to allocate.")] = 1,
        gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node (0: CPU).")] = 0,
        nproc_per_node: Annotated[
            int | None, typer.Option("--nproc-per-node", help="Ranks per node (default: GPUs per node, or 1).")
        ] = None,
        time: Annotated[str | None, typer.Option("--time", "-t", help="Time limit, e.g. 2-00:00:00.")] = None,
        partition: Annotated[str | None, typer.Option("--partition", help="Slurm partition.")] = None,
        account: Annotated[str | None, typer.Option("--account", "-A", help="Slurm account.")] = None,
        cpus_per_task: Annotated[int | None, typer.Option("--cpus-per-task", help="CPUs per node's task.")] = None,
        signal: Annotated[str, typer.Option("--signal", help="Warning signal that saves and requeues.")] = "USR1",
        grace: Annotated[int, typer.Option("--grace", help="Seconds between that signal and the end.")] = 120,
        port: Annotated[int, typer.Option("--port", help="Rendezvous port on the first node.")] = 29500,
        output: Annotated[str | None, typer.Option("--output", "-o", help="Job log (sbatch --output).")] = None,
        set_: Annotated[list[str] | None, typer.Option("--set", "-s", help="Config override (repeatable).")] = None,
        plugin: Annotated[list[str] | None, typer.Option("--plugin", "-p", help="As -p of `corelooper run` (no:NAME, module).")] = None,
        sbatch_arg: Annotated[list[str] | None, typer.Option("--sbatch-arg", help="Extra #SBATCH line.")] = None,
        script: Annotated[Path | None, typer.Option("--script", help="Also write the script here.")] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the script; submit nothing.")] = False,
    ) -> None:
        """Run CONFIG as a Slurm job: one torchrun per node; on SIGUSR1 save, requeue, resume."""
        from corelooper.errors import ConfigError, CorelooperError

        from .script import JobSpec, render

        try:
            if not config.is_file():
                raise ConfigError(f"Config file {str(config)!r} does not exist (or is not a file).")
            spec = JobSpec(
                config=config.resolve(), nodes=nodes, gpus_per_node=gpus_per_node,
                nproc_per_node=nproc_per_node, time=time, partition=partition, account=account,
                cpus_per_task=cpus_per_task, signal=signal, grace=grace, port=port, output=output,
                overrides=list(set_ or []), plugin_options=list(plugin or []),
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


def submit(text: str) -> str:
    """``sbatch --parsable`` with the script on stdin; returns the job id."""
    from corelooper.errors import CorelooperError

    try:
        proc = subprocess.run(["sbatch", "--parsable"], input=text, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise CorelooperError(
            "sbatch was not found on PATH: run `corelooper slurm` on a Slurm login node, or use "
            "--dry-run (and --script FILE) to write the script and submit it there."
        ) from None
    if proc.returncode != 0:
        raise CorelooperError(f"sbatch refused the job (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]
