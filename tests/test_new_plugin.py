"""``corelooper new-plugin NAME``: the skeleton it writes installs, is found through its entry point,
and its own tests pass (run by pytest in a subprocess, with corelooper_testing's fixtures). The
tutorial package of docs/plugins.md is installed and tested in the same pip and pytest calls."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
from conftest import run_cli
from test_plugins_doc import write_tutorial

PIP = [sys.executable, "-m", "pip"]


@pytest.mark.slow
def test_new_plugin_package_and_the_docs_tutorial_install_and_pass_their_tests(tmp_path, allow_plugins):
    dest = tmp_path / "corelooper-grad-stats"
    made = run_cli("new-plugin", "grad_stats", "--dir", str(dest))
    assert made.returncode == 0, made.stderr
    # the printed next step is the README's: [test] brings pytest and corelooper-testing
    assert f"next: pip install -e '{dest}[test]' && python -m pytest {dest}" in made.stdout, made.stdout
    assert 'pip install -e ".[test]"' in (dest / "README.md").read_text()
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        "README.md",
        "corelooper_grad_stats/__init__.py",
        "pyproject.toml",
        "tests/test_grad_stats.py",
    ]
    assert (
        'grad_stats = "corelooper_grad_stats"' in (dest / "pyproject.toml").read_text()
    )  # a module: per-run objects come from corelooper_configure

    tutorial = tmp_path / "lossguard"
    write_tutorial(tutorial)

    # installed (not editable: a .pth file is read only in site folders) into a folder of this test,
    # never into the venv the other tests (and, under pytest-xdist, the other workers) load plugins from
    site = tmp_path / "site"
    install = subprocess.run(
        [
            *PIP,
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(dest),
            str(tutorial),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    eps = {
        ep.name: ep.value
        for dist in importlib.metadata.distributions(path=[str(site)])
        for ep in dist.entry_points
        if ep.group == "corelooper"
    }
    assert eps == {"grad_stats": "corelooper_grad_stats", "lossguard": "corelooper_lossguard"}
    allow_plugins(*eps)  # installed by this test: they count as installed (the root conftest.py)
    tests = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-v",
            str(dest / "tests"),
            str(tutorial / "tests"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
        },
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert tests.stdout.count("test_grad_stats.py::") == 4 and tests.stdout.count("test_lossguard.py::") == 2
    assert "6 passed" in tests.stdout
    names = {ep.name for ep in importlib.metadata.entry_points(group="corelooper")}
    assert "grad_stats" not in names and "lossguard" not in names  # nothing leaked into this venv


def test_new_plugin_refuses_bad_names_and_non_empty_folders(tmp_path):
    bad = run_cli("new-plugin", "Grad-Stats", "--dir", str(tmp_path / "x"))
    assert bad.returncode != 0
    assert "Plugin name 'Grad-Stats' is not usable" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists()

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    busy = run_cli("new-plugin", "ok", "--dir", str(tmp_path / "busy"))
    assert busy.returncode != 0 and "already exists and is not an empty folder" in busy.stderr
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]
