"""``corelooper run`` in the test's own process, for a run that only sets a test up (the run
folder whose CLI behaviour the test then checks) or serves as its reference: no second
interpreter's start-up (~10 s on 2 cores, more where transformers is imported)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest


def train_here(config: Path, *, plugins: Sequence[str] = (), cwd: Path | None = None) -> None:
    """What ``corelooper run CONFIG -p PLUGIN ...`` does in ``cwd`` with plugin autoload off (the
    tests' CLI environment): the config as the CLI loads it, the CLI's ``Loop`` and its ``with``.
    The environment and the working folder are restored after (module fixtures call it too)."""
    from corelooper.cli.api import load_config

    from corelooper.loop import Loop

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
        if cwd is not None:
            mp.chdir(cwd)
        with Loop(config=load_config(config, None, list(plugins))) as loop:
            loop.train()
