"""One loader for installed plugins, with pytest's rules (issue 50): a blocked name (``-p no:NAME``,
``Loop(blocked_plugins=...)``) or autoload off means the plugin is never imported; an import
error is one paragraph naming the distribution and the entry point (exit 3), never swallowed; a
plugin is imported once, however many parts of corelooper ask for it (the registry, the
``[train]`` names plugins answer to, the CLI's commands)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, run_cli

TOYS = Path(__file__).resolve().parent / "toys.py"

PLUGIN = """
import os
from pathlib import Path

IMPORTS = Path(os.environ["FAKEPLUG_IMPORTS"])
IMPORTS.write_text(IMPORTS.read_text() + "imported\\n" if IMPORTS.exists() else "imported\\n")
if os.environ.get("FAKEPLUG_BROKEN"):
    import fakeplug_missing_dependency  # noqa: F401

def corelooper_settings():
    if os.environ.get("FAKEPLUG_SETTINGS_RAISE"):
        raise KeyError("noise")
    return {"train": {"fake_noise": lambda value, train: {"fakeplug": {"noise": value}}}}

def corelooper_config_sections():
    return {"fakeplug": {"noise": 0.0}}
"""


@pytest.fixture
def fakeplug(tmp_path, monkeypatch, allow_plugins) -> Path:
    """An installed distribution ``fakeplug`` 0.1 (its .dist-info with a ``corelooper`` entry
    point, as pip writes it) whose module records each import in a file; returns that file."""
    site = tmp_path / "site"
    (site / "fakeplug-0.1.dist-info").mkdir(parents=True)
    (site / "fakeplug-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakeplug\nVersion: 0.1\n"
    )
    (site / "fakeplug-0.1.dist-info" / "entry_points.txt").write_text(
        "[corelooper]\nfakeplug = fakeplug_mod\n"
    )
    (site / "fakeplug_mod.py").write_text(PLUGIN)
    allow_plugins("fakeplug")
    imports = tmp_path / "imports.txt"
    monkeypatch.setenv("FAKEPLUG_IMPORTS", str(imports))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return imports


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_plugin_is_imported_once_for_its_train_names_and_the_registry(fakeplug):
    r = python(f"""
        import sys
        sys.path.insert(0, {str(TOYS.parent)!r})
        import toys
        from corelooper.loop import Loop
        loop = Loop(toys.mlp(), {{"train": {{"output_dir": "out", "fake_noise": 0.5}}}}, train_dataset=toys.Blobs(8))
        print(loop.config.section("fakeplug"))
    """)
    assert r.returncode == 0, r.stderr
    assert "'noise': 0.5" in r.stdout
    assert fakeplug.read_text() == "imported\n"  # declared_train_fields, then load_plugins: one import


@pytest.mark.parametrize(
    ("blocked", "plugins", "env"),
    [
        (["fakeplug"], {}, {}),  # Loop(blocked_plugins=...)
        ([], {"disable": ["fakeplug"]}, {}),  # [plugins] disable
        ([], {"enable": ["tensorboard"]}, {}),  # [plugins] enable leaves it out
        ([], {}, {"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"}),
    ],
    ids=["blocked", "disabled", "not enabled", "autoload off"],
)
def test_a_blocked_plugin_or_autoload_off_is_never_imported(fakeplug, blocked, plugins, env):
    """Not even for the [train] names plugins answer to (logging_dir: the other plugins are read)."""
    train = {"output_dir": "out", "logging_dir": "tb"} if not env else {"output_dir": "out"}
    r = python(
        f"""
        import sys
        sys.path.insert(0, {str(TOYS.parent)!r})
        import toys
        from corelooper.loop import Loop
        config = {{"train": {train!r}, "plugins": {plugins!r}}}
        loop = Loop(toys.mlp(), config, train_dataset=toys.Blobs(8), blocked_plugins={blocked!r})
        print(loop.plugins.skipped)
    """,
        FAKEPLUG_BROKEN="1",
        **env,
    )
    assert r.returncode == 0, r.stderr
    assert "'fakeplug'" in r.stdout and not fakeplug.exists()


def test_a_setting_of_a_blocked_plugin_says_it_is_not_loaded(fakeplug):
    r = python(
        f"""
        import sys
        sys.path.insert(0, {str(TOYS.parent)!r})
        import toys
        from corelooper.loop import Loop
        Loop(toys.mlp(), {{"train": {{"output_dir": "out", "fake_noise": 0.5}}}}, train_dataset=toys.Blobs(8),
             blocked_plugins=["fakeplug"])
    """,
    )
    assert r.returncode != 0 and not fakeplug.exists()
    assert "Unknown key train.fake_noise" in r.stderr, r.stderr


def test_a_settings_declaration_that_raises_names_the_plugin_and_the_hook(fakeplug):
    """Reading the ``[train]`` names plugins answer to (before any registry exists) blames the
    plugin whose ``corelooper_settings`` raised, as every other moment does."""
    r = python(
        """
        from corelooper import TrainArgs
        from corelooper.errors import PluginError
        try:
            TrainArgs(output_dir="out", fake_noise=0.5)
        except PluginError as e:
            print(e)
        """,
        FAKEPLUG_SETTINGS_RAISE="1",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "Plugin 'fakeplug' raised in hook 'corelooper_settings': KeyError: 'noise'"


@pytest.mark.slow
def test_an_import_error_is_one_paragraph_naming_the_distribution_and_entry_point(fakeplug, tmp_path):
    r = run_cli("--help", env={"FAKEPLUG_BROKEN": "1"})
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("corelooper: error: ")]
    assert line.startswith(
        "corelooper: error: Plugin 'fakeplug' (package fakeplug 0.1, entry point fakeplug = 'fakeplug_mod') "
        "failed to import: ModuleNotFoundError: No module named 'fakeplug_missing_dependency'"
    ), line
    assert "-p no:fakeplug" in line
    fakeplug.unlink()  # it was imported (and failed)
    # blocked on the command line (read before the plugins load) or autoload off: never imported
    config = tmp_path / "config.toml"
    config.write_text(
        textwrap.dedent(f"""
        [model]
        factory = "{TOYS}:mlp"
        [data]
        train = "{TOYS}:blobs_train"
        [train]
        output_dir = "{tmp_path / "out"}"
        max_steps = 1
    """)
    )
    r = run_cli("run", str(config), "-p", "no:fakeplug", env={"FAKEPLUG_BROKEN": "1"})
    assert r.returncode == 0, r.stderr
    r = run_cli("--help", env={"FAKEPLUG_BROKEN": "1", "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert r.returncode == 0, r.stderr
    assert not fakeplug.exists()


def test_the_command_line_blocks_are_read_before_the_plugins_load():
    from corelooper.cli.app import blocked_on_the_command_line

    argv = ["run", "c.toml", "-p", "no:wandb", "-pno:tensorboard", "-p", "my.module", "--set", "x=1"]
    assert blocked_on_the_command_line(argv) == ["wandb", "tensorboard"]
