"""The layers stay apart: the core (``corelooper/``, ``cli/``) and its tests (``tests/``) import no
plugin package, plugins add their CLI commands through ``corelooper_add_commands``, and
``corelooper --help`` — which loads every installed plugin — imports none of the heavy libraries."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

from corelooper import installed_entry_points

REPO = Path(__file__).resolve().parents[1]
HEAVY = {
    "torch",
    "transformers",
    "accelerate",
    "optuna",
    "deepspeed",
    "peft",
    "wandb",
    "tensorboard",
    "safetensors",
    "numpy",
    "datasets",
    "sklearn",
    "matplotlib",
    "liger_kernel",
    "triton",
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, at any depth (function-level imports count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_core_and_cli_import_no_plugin_package():
    files = [*(REPO / "corelooper").rglob("*.py"), *(REPO / "cli").rglob("*.py")]
    assert len(files) > 20
    bad = [
        f"{f.relative_to(REPO)}:{line} imports {mod}"
        for f in files
        for line, mod in _imports(f)
        if mod.split(".")[0].startswith("corelooper_")
    ]
    assert bad == []


def _dynamic_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``importlib.import_module("...")``, ``__import__("...")`` and
    ``pytest.importorskip("...")`` with the module written out."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__", "importorskip") and isinstance(
                node.args[0].value, str
            ):
                found.append((node.lineno, node.args[0].value))
    return found


def test_core_tests_import_no_plugin_package():
    """tests/ is the core's suite: it passes with the core alone. A test of a plugin, or of several
    plugins together, is in a plugin's tests/ folder (tests/third_party_plugin is the plugin
    package the tests install, not a test)."""
    files = [f for f in (REPO / "tests").rglob("*.py") if "third_party_plugin" not in f.parts]
    assert len(files) > 50
    bad = [
        f"{f.relative_to(REPO)}:{line} imports {mod}"
        for f in files
        for line, mod in [*_imports(f), *_dynamic_imports(f)]
        if mod.split(".")[0].startswith("corelooper_")
    ]
    assert bad == []


def test_the_ast_check_sees_function_level_imports(tmp_path):
    # the check above must not pass just because it looks only at the top of a module
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from corelooper_optuna.search import run_study\n    import corelooper_peft\n"
    )
    assert [m for _, m in _imports(probe)] == ["corelooper_optuna.search", "corelooper_peft"]
    probe.write_text(
        "import importlib\nimportlib.import_module('corelooper_lm.packing')\n__import__('corelooper_sft')\n"
    )
    assert [m for _, m in _dynamic_imports(probe)] == ["corelooper_lm.packing", "corelooper_sft"]


def test_help_with_every_plugin_loaded_imports_no_heavy_library():
    code = (
        "import json, sys\n"
        "from corelooper.cli.app import main\n"
        "sys.argv = ['corelooper', '--help']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "mods = sorted(sys.modules)\n"
        "print(json.dumps({'exit': code, 'modules': mods}), file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    report = json.loads(r.stderr.strip().splitlines()[-1])
    assert report["exit"] == 0
    eps = installed_entry_points()  # the plugins corelooper sees (the suite's: the first-party ones)
    loaded = {m.split(".")[0] for m in report["modules"]}
    installed = {ep.value.split(":")[0].split(".")[0] for ep in eps}
    assert {"corelooper_optuna", "corelooper_deepspeed", "corelooper_peft", "corelooper_wandb"} <= installed
    assert installed <= loaded  # every installed plugin really was imported for --help
    assert sorted(loaded & HEAVY) == []
    assert "hpo" in r.stdout  # the command corelooper-optuna adds


def test_hpo_command_comes_from_the_optuna_plugin():
    script = Path(sys.executable).parent / "corelooper"
    r = subprocess.run([str(script), "hpo", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Usage: corelooper hpo [OPTIONS]")
    for option in ("--trials", "--set", "-p", "--traceback"):
        assert option in r.stdout
    # without plugins loaded (autoload off), the core has no such command
    off = subprocess.run(
        [str(script), "hpo", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"},
    )
    assert off.returncode == 2 and "No such command 'hpo'" in off.stderr


def test_the_test_only_plugin_is_not_in_the_environment(thirdparty_plugin):
    # scripts/setup does not install tests/third_party_plugin; the fixture installs it elsewhere
    found = importlib.metadata.distribution("corelooper-thirdparty-example")
    assert Path(str(found.locate_file(""))).resolve().is_relative_to(thirdparty_plugin.resolve())
    site = subprocess.run(
        [sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout.strip()
    assert not list(Path(site).glob("corelooper_thirdparty_example*")), f"installed in {site}"
    assert (
        "third_party_plugin" not in (REPO / "scripts" / "setup").read_text().split("NOT installed here")[-1]
    )


def _core_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import of corelooper in a file, at any depth; ``name`` is
    None for ``import corelooper.x`` and a module written out in ``import_module("...")``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module, a.name) for a in node.names]
    found += [(line, mod, None) for line, mod in _dynamic_imports(path)]
    return [(n, m, a) for n, m, a in found if m == "corelooper" or m.startswith("corelooper.")]


def private_imports(path: Path) -> list[str]:
    """The imports in ``path`` that are not corelooper's public API (docs/plugins.md): a name or
    module with a leading ``_``, or anything of ``corelooper.cli`` but ``corelooper.cli.api``'s
    ``__all__``."""
    from corelooper.cli import api

    bad = []
    for line, module, name in _core_imports(path):
        parts = [*module.split("."), *([name] if name else [])]
        if parts[1:2] == ["cli"]:
            public = parts[2:3] == ["api"] and (len(parts) == 3 or parts[3] in api.__all__)
        else:
            public = not any(p.startswith("_") for p in parts)
        if not public:
            bad.append(
                f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{line} "
                f"imports {module}{f'.{name}' if name else ''}"
            )
    return bad


def test_plugins_import_only_the_public_api():
    """Plugins use the hooks, the public Loop API, the public names of the core modules and, of the
    command line, only ``corelooper.cli.api`` (docs/plugins.md, "The public API")."""
    files = [f for f in (REPO / "plugins").glob("*/corelooper_*/**/*.py")]
    assert len(files) > 40
    assert [bad for f in files for bad in private_imports(f)] == []


def test_the_public_cli_api_is_documented():
    from corelooper.cli import api

    section = (REPO / "docs" / "plugins.md").read_text().split("## The public API", 1)[1].split("\n## ")[0]
    assert [name for name in api.__all__ if f"`{name}" not in section] == []
    assert all(callable(getattr(api, name)) or name.endswith("Opt") for name in api.__all__)


def test_the_public_api_check_sees_a_private_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from corelooper.cli.api import fail, read_metrics\n"
        "from corelooper.errors import ConfigError\n"
        "def command():\n"
        "    from corelooper.cli.app import fail\n"
        "    from corelooper.cli.api import say_stopped\n"
        "    import corelooper.cli.launch\n"
        "    from corelooper.loop import _private\n"
        "    from corelooper import cli\n"
    )
    assert private_imports(probe) == [
        "probe.py:4 imports corelooper.cli.app.fail",
        "probe.py:5 imports corelooper.cli.api.say_stopped",
        "probe.py:6 imports corelooper.cli.launch",
        "probe.py:7 imports corelooper.loop._private",
        "probe.py:8 imports corelooper.cli",
    ]
