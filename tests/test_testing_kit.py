"""corelooper_testing (the pytest plugin for plugin authors) and `corelooper plugins --config`'s
per-config status of installed plugins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from corelooper.config import Config
from corelooper.errors import ConfigError
from corelooper.plugins import Plugins, check_sections


def test_the_pytest_plugin_imports_no_torch():
    # pytest loads corelooper_testing in every run of every project that has corelooper-testing installed
    code = "import sys, corelooper_testing; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_recorder_sees_every_event_in_order_and_what_providers_returned(run_loop, hook_recorder):
    loop = run_loop([hook_recorder])
    names = [n for n in hook_recorder.names() if n.startswith("on_")]
    assert names[:3] == ["on_init_end", "on_train_begin", "on_epoch_begin"]
    assert names[-3:] == ["on_epoch_end", "on_log", "on_train_end"]  # the summary log comes last
    counts = {n: hook_recorder.count(n) for n in ("on_step_begin", "on_step_end", "on_before_backward",
                                                   "on_optimizer_step", "on_log", "on_evaluate", "on_save")}
    assert counts == {"on_step_begin": 8, "on_step_end": 8, "on_before_backward": 8, "on_optimizer_step": 8,
                      "on_log": 5 + 2, "on_evaluate": 2, "on_save": 2}  # each evaluation logs too (HF)
    assert [c.global_step for c in hook_recorder.calls_of("on_step_end")] == list(range(1, 9))
    # arguments are snapshots: each on_log call kept its own logs
    logs = [c["logs"] for c in hook_recorder.calls_of("on_log")]
    assert loop.state.log_history == [
        {**log, "step": c.global_step} for log, c in zip(logs, hook_recorder.calls_of("on_log"), strict=True)
    ]
    saves = hook_recorder.calls_of("on_save")
    assert [c["checkpoint_dir"].name for c in saves] == ["checkpoint-4", "checkpoint-8"]
    assert hook_recorder.last("on_evaluate")["metrics"] == loop.evaluate()
    # providers: the call and the answer (8 training micro-batches + 1 eval batch per evaluation)
    assert hook_recorder.count("compute_loss") == 8 + 2 + 1
    assert len(hook_recorder.last("train_dataloader").result) == 8  # 64 samples / batch 8
    assert hook_recorder.last("create_optimizer").result.defaults["lr"] == 0.05
    with pytest.raises(LookupError, match="never called"):
        hook_recorder.last("on_substep_end")


def test_run_loop_loads_installed_plugins_only_when_asked(run_loop, tmp_path):
    loop = run_loop(output_dir=tmp_path / "isolated")
    assert "tensorboard" not in loop.plugins.info and not (tmp_path / "isolated" / "tensorboard").exists()
    loop = run_loop(output_dir=tmp_path / "autoload", autoload=True)
    assert "tensorboard" in loop.plugins.info and (tmp_path / "autoload" / "tensorboard").is_dir()


def test_a_section_of_a_plugin_not_installed_names_the_package():
    with pytest.raises(ConfigError, match=r"\[early_stopping\].*pip install corelooper-early-stopping"):
        check_sections(Config.from_dict({"early_stopping": {"patience": 2}}), {}, Plugins())


def _status_lines(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and "[" in line:
            out[line.split()[0]] = line[line.index("[") + 1:line.rindex("]")]
    return out


def test_plugins_command_shows_which_plugins_are_active_for_a_config(tmp_path):
    env = {"WANDB_MODE": "", "WANDB_PROJECT": "", "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": ""}
    config = str(Path("examples/digits/config.toml"))
    plain = run_cli("plugins", "--config", config, env=env)
    assert plain.returncode == 0, plain.stderr
    status = _status_lines(plain.stdout)
    assert status["tensorboard"] == "installed, active"
    assert status["wandb"] == ("installed, inactive for this config: no [wandb] section and neither "
                               "WANDB_PROJECT nor WANDB_MODE is set")
    assert status["early_stopping"] == "installed, inactive for this config: no [early_stopping] section"

    mixed = run_cli("plugins", "--config", config, "--set", "wandb.project=x", "--set",
                    "early_stopping.patience=2", "-p", "no:tensorboard", env=env)
    assert mixed.returncode == 0, mixed.stderr
    status = _status_lines(mixed.stdout)
    assert status["wandb"] == "installed, active" and status["early_stopping"] == "installed, active"
    assert status["tensorboard"] == "installed, inactive: disabled"
