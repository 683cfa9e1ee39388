"""What every test of this repository runs with, tests/ and plugins/*/tests alike: the plugins it
sees are the first-party ones and those it installs itself, never one the user installed.

A plugin package installed into the same environment (a global ``compute_loss``, an ``on_log``
that writes files) would answer in the tests' runs as in the user's. So the session sets
``CORELOOPER_PLUGIN_ALLOWLIST`` (docs/plugins.md) to the distributions of plugins/*/pyproject.toml:
corelooper then sees no other installed plugin, in this process and in every process a test starts
(CLI runs, torchrun ranks, Slurm and Ray jobs inherit the environment). A test that installs a
plugin of its own adds it with the ``allow_plugins`` fixture, as tests/conftest.py's
``thirdparty_plugin`` does.

This module is never imported by name: ``from conftest import ...`` in tests/ is tests/conftest.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corelooper import PLUGIN_ALLOWLIST_ENV

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent


def first_party_distributions() -> list[str]:
    """The distribution names of plugins/*/pyproject.toml (corelooper-hf, corelooper-lm, ...)."""
    return [
        tomllib.loads(p.read_text())["project"]["name"] for p in sorted(ROOT.glob("plugins/*/pyproject.toml"))
    ]


_before = os.environ.get(PLUGIN_ALLOWLIST_ENV)


def pytest_configure(config):
    os.environ[PLUGIN_ALLOWLIST_ENV] = ",".join(first_party_distributions())


def pytest_unconfigure(config):
    if _before is None:
        os.environ.pop(PLUGIN_ALLOWLIST_ENV, None)
    else:
        os.environ[PLUGIN_ALLOWLIST_ENV] = _before


@pytest.fixture
def allow_plugins(monkeypatch):
    """``allow_plugins("corelooper-mine", ...)``: plugins this test installed itself (distribution
    or entry-point names) count as installed for the rest of the test, here and in the processes
    it starts."""

    def allow(*names: str) -> None:
        current = os.environ.get(PLUGIN_ALLOWLIST_ENV, "")
        monkeypatch.setenv(PLUGIN_ALLOWLIST_ENV, ",".join(filter(None, [current, *names])))

    return allow
