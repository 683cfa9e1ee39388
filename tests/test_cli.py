"""The real ``corelooper`` CLI, run as a subprocess."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from corelooper import hookspecs
from corelooper.config import Config


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_digits_example_reaches_the_accuracy_bar(cli, tmp_path):
    out = tmp_path / "digits"
    r = cli(
        "run",
        "examples/digits/config.toml",
        "--set",
        f"train.output_dir={out}",
        "--set",
        "train.logging_steps=25",
        "-p",
        "no:tensorboard",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    records = read_jsonl(out / "metrics.jsonl")
    evals = [rec for rec in records if rec["event"] == "eval"]
    assert len(evals) == 10  # eval_strategy = "epoch", 10 epochs
    assert evals[-1]["eval_accuracy"] >= 0.95, evals[-1]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    logs = [rec for rec in records if rec["event"] == "log" and "loss" in rec]
    assert [rec["step"] for rec in logs][:3] == [25, 50, 75]  # the --set override took effect
    assert logs[-1]["loss"] < logs[0]["loss"]
    # the resolved config is written to output_dir, overrides included, and loads back
    resolved = Config.load(out / "config.toml")
    assert resolved.train.output_dir == str(out) and resolved.train.logging_steps == 25
    assert resolved.train.learning_rate == 3e-3 and resolved.model.args == {"hidden": 128, "dropout": 0.1}
    assert (out / "model.safetensors").is_file()
    assert "eval_accuracy" in r.stdout  # the console plugin printed the evaluations
    assert "[step 25/230] loss=" in r.stdout and "━" not in r.stdout  # plain lines: not a terminal


def test_help_lists_commands_and_does_not_import_torch():
    code = (
        "import sys\n"
        "from corelooper.cli.app import main\n"
        "sys.argv = ['corelooper', '--help']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    print('EXIT', e.code)\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    for command in ("run", "plugins", "hooks", "--version"):
        assert command in r.stdout
    assert "EXIT 0" in r.stdout and "TORCH False" in r.stdout


def test_run_help(cli):
    r = cli("run", "--help")
    assert r.returncode == 0
    for option in ("--set", "-p", "--resume-from-checkpoint", "--traceback", "CONFIG"):
        assert option in r.stdout


@pytest.mark.parametrize("command", ["run", "eval", "predict"])
def test_every_command_that_loads_a_model_has_verbose(cli, command):
    r = cli(command, "--help")
    assert r.returncode == 0 and "--verbose" in r.stdout, r.stdout


def test_version_from_the_installed_console_script():
    script = Path(sys.executable).parent / "corelooper"
    r = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert r.stdout.strip() == f"corelooper {importlib.metadata.version('corelooper')}"


def test_hooks_lists_every_hook_with_its_doc(cli):
    r = cli("hooks")
    assert r.returncode == 0, r.stderr
    for name in (*hookspecs.DECLARATIONS, *hookspecs.TRANSFORMS, *hookspecs.PROVIDERS, *hookspecs.EVENTS):
        doc_first_line = getattr(hookspecs, name).__doc__.strip().splitlines()[0].strip()
        assert f"\n{name}(" in "\n" + r.stdout, name
        assert doc_first_line in r.stdout, name
    assert (
        "compute_loss(loop: Loop, model: Module, batch: Batch, num_items_in_batch: Tensor | None, "
        "return_outputs: bool)  [provider, firstresult]"
    ) in r.stdout
    assert (
        "    returns: a scalar torch.Tensor (or (loss, outputs) when return_outputs is true), or None"
        in r.stdout
    )


@pytest.mark.slow
def test_set_override_of_a_plugin_section_and_bad_set_syntax(cli, tmp_path, thirdparty_plugin):
    config = tmp_path / "c.toml"
    config.write_text('[thirdparty]\nmarker = ""\n')
    r = cli("plugins", "--config", str(config), "--set", "thirdparty.optimizer=sgd")
    assert r.returncode == 0, r.stderr
    r = cli("plugins", "--config", str(config), "--set", "optimizer")
    assert r.returncode == 2 and "--set 'optimizer': expected KEY=VALUE" in r.stderr


@pytest.mark.slow
def test_progress_bar_on_a_terminal_plain_lines_otherwise(tmp_path):
    """The console plugin draws a rich progress bar when stdout is a terminal (a real pty here)."""
    import os
    import pty

    toys = REPO / "tests" / "toys.py"
    config = tmp_path / "c.toml"
    config.write_text(
        f'[model]\nfactory = "{toys}:mlp"\n[data]\ntrain = "{toys}:blobs_train"\n'
        f'[train]\noutput_dir = "{tmp_path / "out"}"\nmax_steps = 16\nsave_strategy = "no"\nlogging_steps = 8\n'
    )
    primary, secondary = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm", "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "corelooper", "run", str(config)],
        stdout=secondary,
        stderr=secondary,
        cwd=REPO,
        env=env,
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(primary)
    shown = b"".join(chunks).decode(errors="replace")
    assert "16/16" in shown and "━" in shown  # rich's bar with its M/N column
    assert "[step 8/16] loss=" in shown  # log lines are printed above the bar


@pytest.mark.slow
def test_console_leaves_namespaced_log_keys_to_the_loggers_unless_verbose(cli, tmp_path):
    """A key ``name/key`` is a plugin's detail: metrics.jsonl gets it, the console line only with
    --verbose."""
    toys = REPO / "tests" / "toys.py"
    plugin = tmp_path / "detail_plugin.py"
    plugin.write_text(
        "from corelooper.hookspecs import hookimpl\n\n\n@hookimpl(tryfirst=True)\n"
        "def on_log(logs):\n    if 'loss' in logs:\n"
        "        logs.update({'demo/detail': 1.5, 'demo_plain': 2.5})\n"
    )
    for name, extra in (("quiet", ()), ("verbose", ("--verbose",))):
        config = tmp_path / f"{name}.toml"
        config.write_text(
            f'[model]\nfactory = "{toys}:mlp"\n[data]\ntrain = "{toys}:blobs_train"\n'
            f'[train]\noutput_dir = "{tmp_path / name}"\nmax_steps = 4\nsave_strategy = "no"\nlogging_steps = 2\n'
            f'[plugins]\nlocal = ["{plugin}"]\n'
        )
        r = cli("run", str(config), *extra, env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"})
        assert r.returncode == 0, r.stderr
        lines = [x for x in r.stdout.splitlines() if x.startswith("[step ") and " loss=" in x]
        assert len(lines) == 2 and all("demo_plain=2.5" in x for x in lines)
        assert all(("demo/detail=1.5" in x) == (name == "verbose") for x in lines)
        logged = [rec for rec in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in rec]
        assert [rec["demo/detail"] for rec in logged] == [1.5, 1.5]
