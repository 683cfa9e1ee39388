"""The suite is hermetic: a plugin the user installed into the environment changes nothing here.

A user's own package (here ``acme-training-tweaks``, really pip-installed into a folder of the test
and put on ``sys.path`` / ``PYTHONPATH``, as an install into the venv would be seen) answers
``compute_loss`` for every run with a wrong loss, writes a file into the working folder from
``on_log`` and notes every import of its module. The root ``conftest.py`` lets corelooper see only
the first-party plugins (``CORELOOPER_PLUGIN_ALLOWLIST``): the package is never imported, in this
process, in the CLI, or in a pytest run of the core's and a plugin's tests started as a user would
start it. Allowed (as a test allows what it installs itself), the same package does break the run:
the check would see it.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from toys import blobs_train, mlp

from corelooper import PLUGIN_ALLOWLIST_ENV, Loop, installed_entry_points
from corelooper.plugins import AUTOLOAD_ENV

PYPROJECT = """\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "acme-training-tweaks"
version = "1.0"

[project.entry-points.corelooper]
acme = "acme_tweaks"

[tool.setuptools]
packages = ["acme_tweaks"]
"""

PLUGIN = """\
import os
from pathlib import Path

if os.environ.get("ACME_TRACE"):
    with open(os.environ["ACME_TRACE"], "a") as f:
        f.write(f"imported in {os.getpid()}\\n")


def compute_loss(model, return_outputs):
    loss = sum(p.sum() for p in model.parameters()) * 0 + 1234.5  # every run's loss, wrong on purpose
    return (loss, None) if return_outputs else loss


def on_log(logs):
    Path("acme_was_here.txt").write_text(str(logs))  # into the working folder
"""

STRAY = "acme_was_here.txt"


@pytest.fixture(scope="module")
def acme_site(tmp_path_factory) -> Path:
    """The user's package, built and installed with ``pip install --target`` (never into .venv)."""
    tmp = tmp_path_factory.mktemp("acme")
    (tmp / "src" / "acme_tweaks").mkdir(parents=True)
    (tmp / "src" / "pyproject.toml").write_text(PYPROJECT)
    (tmp / "src" / "acme_tweaks" / "__init__.py").write_text(PLUGIN)
    site = tmp / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*pip, "--target", str(site), str(tmp / "src")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return site


@pytest.fixture
def acme(acme_site, tmp_path, monkeypatch) -> Path:
    """The package installed as a user's would be: found through its entry point in this process
    and in the processes the test starts, installed plugins loaded; returns the trace file."""
    monkeypatch.syspath_prepend(str(acme_site))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(acme_site), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv(AUTOLOAD_ENV, "")
    monkeypatch.setenv("ACME_TRACE", str(tmp_path / "acme_trace.txt"))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("acme_tweaks", None)
    yield tmp_path / "acme_trace.txt"
    sys.modules.pop("acme_tweaks", None)


def _losses(tmp_path: Path, name: str) -> list[float]:
    train = {"output_dir": str(tmp_path / name), "max_steps": 3, "logging_steps": 1, "save_strategy": "no"}
    with Loop(mlp(), {"train": {**train, "disable_tqdm": True}}, train_dataset=blobs_train()) as loop:
        loop.train()
    return [r["loss"] for r in loop.state.log_history if "loss" in r]


def test_a_users_plugin_is_not_seen_in_this_process_and_would_be_if_allowed(acme, tmp_path, allow_plugins):
    names = {ep.name for ep in importlib.metadata.entry_points(group="corelooper")}
    assert "acme" in names  # really installed, as far as Python can tell
    assert "acme" not in {ep.name for ep in installed_entry_points()}
    assert "hf" in {ep.name for ep in installed_entry_points()}  # the first-party ones are
    assert all(loss < 10 for loss in _losses(tmp_path, "hermetic"))
    assert not acme.exists() and not (tmp_path / STRAY).exists() and "acme_tweaks" not in sys.modules

    allow_plugins("acme-training-tweaks")  # the control: the same package, seen, breaks the run
    assert _losses(tmp_path, "allowed") == [1234.5] * 3
    assert (tmp_path / STRAY).exists() and acme.read_text().startswith("imported")


@pytest.mark.slow
def test_the_cli_does_not_see_it(acme, tmp_path):
    out = tmp_path / "digits"
    r = run_cli(
        "run",
        "examples/digits/config.toml",
        "--set",
        f"train.output_dir={out}",
        "--set",
        "train.max_steps=4",
        "--set",
        "train.logging_steps=1",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loss=1234" not in r.stdout and "loss=" in r.stdout
    listed = run_cli("plugins")
    assert listed.returncode == 0 and "acme" not in listed.stdout and "tensorboard" in listed.stdout
    assert not acme.exists() and not (REPO / STRAY).exists()


@pytest.mark.slow
def test_a_pytest_run_of_core_and_plugin_tests_does_not_see_it(acme, tmp_path):
    """As a user runs the tests in a clone whose venv holds their plugin (no allow-list set in the
    shell): the root conftest.py sets it, for the tests and every process they start."""
    env = {k: v for k, v in os.environ.items() if k != PLUGIN_ALLOWLIST_ENV}
    tests = [
        "tests/test_loop_basics.py",
        "tests/test_cli.py::test_digits_example_reaches_the_accuracy_bar",
        "tests/test_cli.py::test_set_override_of_a_plugin_section_and_bad_set_syntax",
        "plugins/early_stopping/tests",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *tests],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
    assert not acme.exists() and not (REPO / STRAY).exists()
