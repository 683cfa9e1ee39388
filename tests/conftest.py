"""Shared fixtures for the core tests. Keep this small and generic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
CORELOOPER = [sys.executable, "-m", "corelooper"]


def run_cli(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 120):
    """Run the real ``corelooper`` CLI in a subprocess; returns the CompletedProcess."""
    full_env = {**os.environ, "PYTHONHASHSEED": "0", **(env or {})}
    return subprocess.run(
        [*CORELOOPER, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def cli():
    """``cli("run", "config.toml", "--set", ...)`` -> CompletedProcess (stdout, stderr, returncode)."""
    return run_cli


@pytest.fixture
def train_args(tmp_path):
    """Fast defaults for in-process Loop tests: no checkpoints, quiet console, output in tmp_path."""

    def make(**overrides):
        from corelooper.config import TrainArgs

        base = dict(output_dir=str(tmp_path / "out"), save_strategy="no", logging_steps=1,
                    max_grad_norm=0.0, disable_tqdm=True, learning_rate=1e-2)
        return TrainArgs(**{**base, **overrides})

    return make


@pytest.fixture(autouse=True)
def _keep_plugin_autoload_setting():
    """Tests that turn plugin autoload off for themselves must not turn it off for the next ones."""
    key = "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"
    before = os.environ.get(key)
    yield
    if before is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = before
