"""``corelooper``: run, inspect plugins and hooks.

Start-up is kept cheap: torch and the loop are imported only by the commands that train.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from corelooper.cli.api import (
    PluginOpt,
    SetOpt,
    TracebackOpt,
    exit_if_distributed,
    fail,
    load_config,
    say_stopped,
    split_plugin_options,
)

app = typer.Typer(
    name="corelooper",
    help="Train PyTorch models with a small loop whose every part is a pluggy hook.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Also show third-party warnings, banners, launcher logs, and every log key on the console (plugins' namespaced details, e.g. doctor/...).",
    ),
]


def _version_callback(value: bool) -> None:
    if value:
        from corelooper import __version__

        typer.echo(f"corelooper {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """corelooper: the Hugging Face Trainer, rebuilt the way pytest is built."""


@app.command()
def run(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="The TOML config file.")],
    set_: SetOpt = None,
    p: PluginOpt = None,
    resume_from_checkpoint: Annotated[
        str | None,
        typer.Option(
            "--resume-from-checkpoint",
            metavar="latest|auto|PATH",
            help="'latest', a checkpoint folder, or 'auto' (latest if any, else start fresh).",
        ),
    ] = None,
    traceback_: TracebackOpt = False,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc", metavar="N", help="Start N local processes (torchrun); each runs this command."
        ),
    ] = None,
    profile_plugins: Annotated[
        bool, typer.Option("--profile-plugins", help="Print the time spent in each plugin's hooks.")
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Train (and evaluate) the model described by CONFIG.

    Exit status: 0 done; 2-6 a reported error (config, plugin, data, checkpoint or I/O,
    training); 143 / 130 stopped by SIGTERM / SIGINT after saving a checkpoint (resume it with
    --resume-from-checkpoint latest); 75 / 76 stopped by SIGTERM / SIGINT outside training
    (start-up): no checkpoint written by that stop.
    """
    from corelooper.cli.launch import watch_launcher
    from corelooper.cli.quiet import quiet_third_party
    from corelooper.cli.signals import StartupStop, install_startup_handlers, pending_stop

    install_startup_handlers()  # before any work: a signal at start-up exits 75/76, no traceback
    watch_launcher()  # a worker dies with its launcher (kill -9 leaves no orphans)
    quiet_third_party(verbose)
    preempted_exit = 0
    try:
        blocked, local = split_plugin_options(p)
        cfg = load_config(config, set_, local)
        if nproc is not None:  # checked above once, then run by every child without --nproc
            from corelooper.cli.launch import child_argv, launch

            return launch(nproc, child_argv(config, set_, p, resume_from_checkpoint, traceback_, verbose))
        preempted_exit = _train(cfg, blocked, resume_from_checkpoint, profile_plugins)
        if pending_stop() is not None:  # a stop signal whose exception a library swallowed
            raise pending_stop()
    except StartupStop as e:
        say_stopped(e)
    except KeyboardInterrupt:  # SIGINT in a thread without our handler: nothing was saved
        if os.environ.get("RANK", "0") == "0":  # Ctrl-C reaches every rank: one says it
            typer.echo("corelooper: interrupted, no checkpoint written by this stop", err=True)
        raise typer.Exit(76) from None
    except Exception as e:
        fail(e, traceback_)
    exit_if_distributed(preempted_exit)  # a rank of several processes ends here
    if preempted_exit:
        raise typer.Exit(preempted_exit)


class _TrainBegan:
    """Whether ``on_train_begin`` fired (a finished run resumed returns before it)."""

    began = False
    name = "cli"  # its plugin name (profiling.CLI_PLUGIN: not profiled)

    def on_train_begin(self) -> None:
        from corelooper.cli.signals import pending_stop

        if pending_stop() is not None:  # a stop signal at start-up whose exception a library swallowed
            raise pending_stop()
        self.began = True


def _train(cfg, blocked: list[str], resume: str | None, profile_plugins: bool) -> int:
    """Build the Loop, train, evaluate; returns the exit code of a preemption (else 0)."""
    from corelooper.loop import Loop

    if resume:  # in the config: the Loop settles an elastic resume's geometry before plugins see it
        cfg = cfg.replace("train", resume_from_checkpoint=resume)
    from corelooper.cli.progress import EvalProgress
    from corelooper.cli.providers import RunBanner

    began, banner = _TrainBegan(), RunBanner()
    loop = Loop(config=cfg, blocked_plugins=blocked, plugins=[began, EvalProgress(), banner])
    with loop:  # corelooper_unconfigure: loggers close their runs after the last evaluation
        preempted_exit = _train_and_evaluate(loop, began, profile_plugins)
        banner.stop()  # (on_train_begin stops it: here where training never began)
    loop.backend.end()
    return preempted_exit


def _train_and_evaluate(loop, began: _TrainBegan, profile_plugins: bool) -> int:
    profiler = None
    if profile_plugins:
        from corelooper.cli.profiling import PluginProfiler

        profiler = PluginProfiler(loop.plugins)
    state = loop.train()
    if not began.began:  # resumed at its last step: train() returned before anything was written
        if state.is_world_process_zero:
            typer.echo(
                f"corelooper: {loop.args.output_dir} already finished at step {state.global_step}: "
                "nothing to do."
            )
        return 0
    preempted_exit = 0
    if state.preempted:  # SIGTERM/SIGINT: a checkpoint was saved; exit 143 / 130 (128 + signal)
        if state.is_world_process_zero:
            typer.echo(
                f"corelooper: stopped at step {state.global_step}; checkpoint saved in "
                f"{loop.args.output_dir}. Resume with --resume-from-checkpoint latest.",
                err=True,
            )
        preempted_exit = 128 + (state.stop_signal or 15)
    elif loop.eval_dataset is not None and loop.args.eval_strategy == "no":
        loop.evaluate()
    if profiler is not None and loop.state.is_world_process_zero:
        profiler.stop()
        typer.echo(profiler.report())
    return preempted_exit


@app.command()
def plugins(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Show what is active for this config.")
    ] = None,
    set_: SetOpt = None,
    p: PluginOpt = None,
    traceback_: TracebackOpt = False,
) -> None:
    """List plugins: version, hooks, config keys, and which provider wins each provider hook."""
    try:
        from corelooper.cli.providers import describe

        from corelooper.config import Config
        from corelooper.hookspecs import PROVIDERS
        from corelooper.plugins import load_plugins

        blocked, local = split_plugin_options(p)
        cfg = load_config(config, set_, local) if config else Config().replace("plugins", local=local)
        pl = load_plugins(cfg, blocked=blocked)
        cfg = pl.config  # with the plugins' defaults: the values this run would use
        typer.echo(f"plugins{' for ' + str(config) if config else ''}:")
        runs = [info for info in pl.info.values() if info.kind == "run"]
        for info in pl.info.values():
            if info.kind == "run":
                continue  # shown under the plugin that registered it
            version = f" {info.version}" if info.version else ""
            dist = f" ({info.dist}{version})" if info.dist else ""
            # A loaded plugin may still do nothing for this config (wandb without [wandb], ...).
            why = pl.inactive.get(info.name)
            status = f"inactive for {'this' if config else 'an empty'} config: {why}" if why else "active"
            typer.echo(f"  {info.name}{dist} [{info.kind}, {status}]")
            typer.echo(f"    hooks: {', '.join(info.hooks) or '-'}")
            for run in (r for r in runs if r.name.split(".")[0] == info.name):
                typer.echo(f"    per-run {run.name}: {', '.join(run.hooks) or '-'}")
            for section in info.sections:
                shown = ", ".join(f"{k}={v!r}" for k, v in cfg.section(section).items()) or "-"
                where = "" if section in cfg.sections or not config else " (not in this config: defaults)"
                typer.echo(f"    config [{section}]{where}: {shown}")
        for name, why in pl.skipped.items():
            typer.echo(f"  {name} [installed, inactive: {why}]")
        typer.echo("providers (in the order they answer: the first answer wins):")
        for hook in PROVIDERS:
            typer.echo(f"  {describe(pl, hook)}")
    except Exception as e:
        fail(e, traceback_)


@app.command()
def hooks() -> None:
    """Every hook, with when it fires and what it may return."""
    import inspect

    from corelooper import hookspecs
    from corelooper.dispatch import returns

    names = [*hookspecs.DECLARATIONS, *hookspecs.TRANSFORMS, *hookspecs.PROVIDERS, *hookspecs.EVENTS]
    for name in names:
        fn = getattr(hookspecs, name)
        opts = getattr(fn, "corelooper_spec", {}) or {}
        kind = (
            "provider, firstresult"
            if opts.get("firstresult")
            else (
                "event"
                if name.startswith("on_")
                else "transform"
                if name in hookspecs.TRANSFORMS
                else "declaration"
            )
        )
        sig = str(inspect.signature(fn)).split(" ->")[0].replace("'", "")  # postponed annotations
        typer.echo(f"{name}{sig}  [{kind}]")
        if name in hookspecs.PROVIDERS:  # its return annotation's type: what every answer is checked against
            typer.echo(f"    returns: {returns(name).__doc__}, or None (the next provider answers)")
        typer.echo("    " + inspect.getdoc(fn).replace("\n", "\n    ") + "\n")


CheckpointOpt = Annotated[
    str,
    typer.Option(
        "--checkpoint", help="A checkpoint folder, an output_dir with model.safetensors, or 'latest'."
    ),
]


@app.command()
def predict(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="The TOML config file.")],
    checkpoint: CheckpointOpt,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            help="FILE.jsonl or FILE.safetensors (default: output_dir/predictions.jsonl for one record "
            "per sample, else output_dir/predictions.safetensors).",
        ),
    ] = None,
    generate: Annotated[
        bool,
        typer.Option(
            "--generate", help="Continue each sample's prompt and add the text (a causal LM's records)."
        ),
    ] = False,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="Tokens generated per sample (with --generate).")
    ] = 64,
    set_: SetOpt = None,
    p: PluginOpt = None,
    traceback_: TracebackOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Predict on data.test (else data.eval) with a checkpoint's weights, in dataset order: one record
    per sample where a plugin knows the model (a causal LM: loss, tokens, text), else its outputs.

    The training run's files (metrics.jsonl, tensorboard/) are left as they were."""

    def action(cfg, blocked):
        from corelooper.cli.evaluate import predict as run_predict

        options = {"generate": generate, "max_new_tokens": max_new_tokens}
        path, metrics, loop = run_predict(cfg, checkpoint, output, blocked, options=options)
        return loop, [f"predictions written to {path}"] + ([metrics] if metrics else [])

    _on_checkpoint(config, set_, p, traceback_, verbose, action)


@app.command("eval")
def eval_(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="The TOML config file.")],
    checkpoint: CheckpointOpt,
    set_: SetOpt = None,
    p: PluginOpt = None,
    traceback_: TracebackOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Evaluate a checkpoint's weights on data.eval; print the metrics as JSON.

    The training run's files (metrics.jsonl, tensorboard/) are left as they were."""

    def action(cfg, blocked):
        from corelooper.cli.evaluate import evaluate

        metrics, loop = evaluate(cfg, checkpoint, blocked)
        return loop, [metrics]

    _on_checkpoint(config, set_, p, traceback_, verbose, action)


def _on_checkpoint(config: Path, set_, p, traceback_: bool, verbose: bool, action) -> None:
    """What ``predict`` and ``eval`` share: quiet start, config, errors; rank 0 prints
    ``action``'s lines (a dict as one JSON line)."""
    from corelooper.cli.quiet import quiet_third_party

    quiet_third_party(verbose)
    try:
        blocked, local = split_plugin_options(p)
        loop, lines = action(load_config(config, set_, local), blocked)
        if loop.state.is_world_process_zero:
            import json

            for line in lines:
                typer.echo(json.dumps(line) if isinstance(line, dict) else line)
        loop.backend.end()  # the process group down before the interpreter exits
    except Exception as e:
        fail(e, traceback_)
    exit_if_distributed()


@app.command()
def verify(
    path: Annotated[Path, typer.Argument(help="A run folder (output_dir) or one checkpoint-N folder.")],
    traceback_: TracebackOpt = False,
) -> None:
    """Check checkpoints by content (every file's size and checksum); say which one `latest` resumes.

    Exit status: 0 every checkpoint verifies; 5 one or more do not (each named with its bad file).
    """
    try:
        from corelooper.checkpoints import manifest
        from corelooper.checkpoints import run_dir as output_dir

        if not path.is_dir():
            from corelooper.errors import CheckpointError

            raise CheckpointError(f"{str(path)!r} is not a run folder or a checkpoint folder.")
        one = (path / manifest.MANIFEST).exists() or output_dir.PREFIX in path.name
        found = [path] if one else output_dir.list_checkpoints(path)
        bad = {ckpt: why for ckpt in found if (why := manifest.problem(ckpt)) is not None}
        good = [ckpt for ckpt in found if ckpt not in bad]
        for ckpt in found:  # the same line for a checkpoint alone as in its run folder's list
            typer.echo(f"{ckpt.name}: {'FAILED: ' + bad[ckpt] if ckpt in bad else 'ok'}")
        finished = [p.name for p in output_dir.final_model_files(path)]
        final = f"the final model: {finished[0]}" if finished else ""
        if finished and not one and (state := output_dir.finished_state(path)):
            final += f" (step {state['global_step']})"
        if not one and found:
            typer.echo(f"latest: {good[-1].name if good else 'none (no complete checkpoint)'}")
            if final:
                typer.echo(final)
        elif not one:  # a run saved without checkpoints (save_strategy = "no"): nothing failed
            typer.echo(f"no checkpoints; {final or 'no final model'}")
        if bad or not (found or finished):  # (no good checkpoint among those found: some are bad)
            raise typer.Exit(5)
    except typer.Exit:
        raise
    except Exception as e:
        fail(e, traceback_)


@app.command()
def plot(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run folders (output_dir) holding metrics.jsonl.")],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="The PNG to write (default: metrics.png in the current folder)."),
    ] = None,
    traceback_: TracebackOpt = False,
) -> None:
    """Plot loss, learning rate, grad norm and eval metrics of one or more runs into a PNG."""
    try:
        from corelooper.cli.plot import plot_runs

        path = plot_runs(run_dirs, output)
        typer.echo(f"plot written to {path}")
    except Exception as e:
        fail(e, traceback_)


@app.command("new-plugin")
def new_plugin(
    name: Annotated[
        str, typer.Argument(help="The plugin's name: entry point and config section (e.g. grad_stats).")
    ],
    dir_: Annotated[
        Path | None, typer.Option("--dir", help="Where to write it (default: ./corelooper-NAME).")
    ] = None,
    traceback_: TracebackOpt = False,
) -> None:
    """Write a working plugin package: pyproject with entry point, module, README, passing tests."""
    try:
        from corelooper.cli.scaffold import write_plugin

        path = write_plugin(name, dir_)
        typer.echo(
            f"wrote {path}/\nnext: pip install -e '{path}[test]' && python -m pytest {path}"
            "   # [test] brings pytest and corelooper-testing"
        )
    except Exception as e:
        fail(e, traceback_)


def add_plugin_commands(app) -> None:
    """Let every installed plugin add CLI subcommands (``corelooper_add_commands``).

    Only entry points are loaded (no builtin, no config), through the one loader: a blocked name
    (``-p no:NAME`` on the command line) or autoload off imports nothing; an import error is its
    one paragraph (exit 3), as in pytest. Plugin modules import torch lazily, so
    ``corelooper --help`` stays fast.
    """
    from corelooper import hookspecs, load_installed
    from corelooper.plugins import HookManager, installed_entry_points

    pm = HookManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for ep in installed_entry_points():
        obj = load_installed(ep)
        if obj is not None and callable(getattr(obj, "corelooper_add_commands", None)):
            pm.register(obj, name=ep.name)
    pm.hook.corelooper_add_commands(app=app)


def blocked_on_the_command_line(argv: list[str]) -> list[str]:
    """The names of ``-p no:NAME`` in ``argv``, read before the plugins load (pytest's early
    parse of ``-p``): a blocked plugin is never imported."""
    pairs = zip(argv, [*argv[1:], ""], strict=True)
    values = [b if a == "-p" else a[2:] if a.startswith("-p") else "" for a, b in pairs]
    return [v[3:] for v in values if v.startswith("no:")]


def main() -> None:
    from corelooper.cli.quiet import quiet_on_closed_pipes
    from corelooper.cli.signals import StartupStop, install_startup_handlers

    install_startup_handlers()  # first thing: a SIGTERM while plugins import exits 75, not -15
    quiet_on_closed_pipes()  # `corelooper run ... | head`: the run goes on, quietly
    from corelooper import blocking
    from corelooper.errors import PluginError

    try:
        with blocking(blocked_on_the_command_line(sys.argv[1:])):
            add_plugin_commands(app)  # corelooper_add_commands: plugins' own subcommands
            app(prog_name="corelooper")
    except PluginError as e:  # an installed plugin that does not import: one paragraph, exit 3
        try:
            fail(e, "--traceback" in sys.argv)
        except typer.Exit as stop:
            sys.exit(stop.exit_code)
    except StartupStop as e:
        typer.echo(f"corelooper: {e}. Exit {e.exit_code}.", err=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    sys.exit(main())
