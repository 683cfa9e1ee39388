"""``corelooper hpo``: the subcommand this plugin adds through ``corelooper_add_commands``.

Only typer and the CLI's helpers are imported here; Optuna, torch and the loop load when the
command runs, so ``corelooper --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# At module level: typer resolves the (postponed) annotations in this module's globals.
from corelooper.cli.api import PluginOpt, SetOpt, TracebackOpt, fail, load_config, split_plugin_options


def add_hpo_command(app: typer.Typer) -> None:
    @app.command()
    def hpo(
        config: Annotated[Path, typer.Argument(help="The TOML config file, with an [optuna] section.")],
        trials: Annotated[
            int | None,
            typer.Option("--trials", "-n", help="Total trials of the study (default: optuna.n_trials)."),
        ] = None,
        set_: SetOpt = None,
        p: PluginOpt = None,
        traceback_: TracebackOpt = False,
    ) -> None:
        """Hyper-parameter search with Optuna (from corelooper-optuna): one run per trial, pruning,
        a resumable SQLite study."""
        try:
            from .search import run_study

            blocked, local = split_plugin_options(p)
            run_study(load_config(config, set_, local), trials=trials, blocked=blocked, echo=typer.echo)
        except Exception as e:
            fail(e, traceback_)
