"""Fixtures of the doctor's tests (not a conftest.py: pytest collects tests/ and plugins/*/tests
together, and two conftest modules would shadow each other). Each test module imports them."""

import pytest


@pytest.fixture(autouse=True)
def _only_named_plugins(monkeypatch):
    """Each test registers corelooper_doctor itself; installed plugins stay out."""
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
