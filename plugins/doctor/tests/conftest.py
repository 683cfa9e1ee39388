import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # doctor_toys


@pytest.fixture(autouse=True)
def _only_named_plugins(monkeypatch):
    """Each test registers corelooper_doctor itself; installed plugins stay out."""
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
