"""``corelooper new-plugin NAME``: write a working plugin package (no cookiecutter needed).

The skeleton is a complete package: ``pyproject.toml`` with the entry point, the plugin module
(a config section, an event hook, state kept across a resume), a README, and tests that run a
real tiny training with ``corelooper_testing``'s fixtures. ``pip install -e 'DIR[test]' && python -m pytest DIR``
passes as written.
"""

from __future__ import annotations

import re
from pathlib import Path

from corelooper.errors import CorelooperError

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A corelooper plugin: {name}."
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["corelooper>={core_version},<{next_minor}"]  # the hook contract of this minor version

[project.optional-dependencies]
test = ["pytest>=8", "corelooper-testing>=0.2,<0.3"]

# corelooper finds the plugin through this entry point: installed means loaded.
[project.entry-points.corelooper]
{name} = "{module}"

[tool.setuptools]
packages = ["{module}"]
"""

MODULE = '''\
"""{dist}: a corelooper plugin.

It remembers the lowest training loss seen, keeps it across a resume, and declares a
``[{name}]`` config section. Replace the hooks with yours: ``corelooper hooks`` lists every hook
with its arguments.
"""

from __future__ import annotations

from typing import Any

SECTION = "{name}"


# The config keys this plugin owns, with their defaults: unknown keys are rejected.
def corelooper_config_sections() -> dict[str, dict[str, Any]]:
    return {{SECTION: {{"enabled": True}}}}


# Once per run: register this run's own object (never share one between two Loops).
def corelooper_configure(config, plugins) -> None:
    if not config.section(SECTION)["enabled"]:
        plugins.set_inactive(SECTION, "[{name}] enabled = false")  # `corelooper plugins` shows it
        return
    tracker = {klass}()
    plugins.register(tracker, f"{{SECTION}}.run")
    plugins.register_for_checkpointing(SECTION, tracker)  # saved in plugins.json, restored on resume


class {klass}:
    def __init__(self) -> None:
        self.lowest_loss: float | None = None

    # Events take any subset of their arguments, by name.
    def on_log(self, logs) -> None:
        if "loss" in logs and (self.lowest_loss is None or logs["loss"] < self.lowest_loss):
            self.lowest_loss = logs["loss"]

    def state_dict(self) -> dict[str, Any]:
        return {{"lowest_loss": self.lowest_loss}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lowest_loss = state.get("lowest_loss")
'''

TEST = '''\
"""Tests for {dist}, with corelooper_testing's fixtures (a real tiny training on CPU)."""

import json

import pytest

import {module} as plugin
from corelooper.errors import ConfigError


def tracker(loop):
    return loop.plugins.get("{name}.run")


def test_remembers_the_lowest_training_loss(run_loop, hook_recorder):
    loop = run_loop([plugin, hook_recorder])
    losses = [c["logs"]["loss"] for c in hook_recorder.calls_of("on_log") if "loss" in c["logs"]]
    assert len(losses) == 4 and tracker(loop).lowest_loss == min(losses)


def test_state_is_saved_in_checkpoints_and_restored_on_resume(run_loop, tmp_path):
    run_loop([plugin])
    saved = json.loads((tmp_path / "run" / "checkpoint-4" / "plugins.json").read_text())
    assert saved["{name}"]["lowest_loss"] > 0
    loop = run_loop([plugin], resume=str(tmp_path / "run" / "checkpoint-4"), output_dir=tmp_path / "run")
    assert loop.state.global_step == 8
    assert tracker(loop).lowest_loss <= saved["{name}"]["lowest_loss"]


def test_unknown_config_keys_are_rejected(make_loop):
    with pytest.raises(ConfigError, match="Did you mean 'enabled'"):
        make_loop([plugin], sections={{"{name}": {{"enable": True}}}})


def test_can_be_switched_off(run_loop):
    loop = run_loop([plugin], sections={{"{name}": {{"enabled": False}}}})
    assert tracker(loop) is None and "{name}" in loop.plugins.inactive
'''

README = """\
# {dist}

A [corelooper](https://pypi.org/project/corelooper/) plugin.

```bash
pip install -e ".[test]"   # installed = loaded in every corelooper run; [test] brings corelooper-testing
corelooper plugins          # shows it, its hooks and its [{name}] keys
pytest tests                # runs a tiny real training with the plugin registered
```

Config:

```toml
[{name}]
enabled = true
```

Turn it off for one project with `[plugins] disable = ["{name}"]`, or for one run with `-p no:{name}`.
"""


def write_plugin(name: str, dest: Path | None = None) -> Path:
    """Write the package for plugin ``name`` into ``dest`` (default ``./corelooper-NAME``)."""
    if not _NAME.match(name):
        raise CorelooperError(
            f"Plugin name {name!r} is not usable: use lowercase letters, digits and underscores, "
            "starting with a letter (it is the entry-point name, the config section and part of "
            "the module name), e.g. `corelooper new-plugin grad_stats`."
        )
    from corelooper import __version__

    dist = "corelooper-" + name.replace("_", "-")
    module = "corelooper_" + name
    klass = "".join(part.capitalize() for part in name.split("_")) + "Plugin"
    dest = Path(dest) if dest is not None else Path(dist)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise CorelooperError(
            f"{str(dest)!r} already exists and is not an empty folder: choose another with --dir."
        )
    major, minor = (int(x) for x in __version__.split(".")[:2])
    values = dict(
        name=name,
        dist=dist,
        module=module,
        klass=klass,
        core_version=f"{major}.{minor}",
        next_minor=f"{major}.{minor + 1}",
    )
    files = {
        "pyproject.toml": PYPROJECT,
        f"{module}/__init__.py": MODULE,
        f"tests/test_{name}.py": TEST,
        "README.md": README,
    }
    for rel, template in files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**values))
    return dest
