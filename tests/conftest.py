"""Shared fixtures for the core tests. Keep this small and generic."""

from __future__ import annotations

import os
import shutil
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


@pytest.fixture(scope="session")
def _thirdparty_site(tmp_path_factory) -> Path:
    """tests/third_party_plugin, really pip-installed, into a folder of this test session only.

    The package is built from a copy (building writes build/ and *.egg-info next to the sources)
    and installed with ``pip install --target``: its code and its ``.dist-info`` with the
    entry points land in that folder, not in the venv of the user or of CI.
    """
    tmp = tmp_path_factory.mktemp("thirdparty")
    src = tmp / "src"
    shutil.copytree(TESTS / "third_party_plugin", src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    site = tmp / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"installing tests/third_party_plugin failed:\n{proc.stderr[-3000:]}"
    return site


@pytest.fixture
def thirdparty_plugin(_thirdparty_site, monkeypatch, allow_plugins) -> Path:
    """Make the third-party test plugin installed for one test: found through its entry points
    in this process (sys.path) and in the CLI subprocesses the test starts (PYTHONPATH), and
    allowed as the first-party ones are (the root conftest.py: no other installed plugin counts)."""
    allow_plugins("corelooper-thirdparty-example")
    monkeypatch.syspath_prepend(str(_thirdparty_site))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(_thirdparty_site), os.environ.get("PYTHONPATH")]))
    )
    return _thirdparty_site
