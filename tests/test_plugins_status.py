"""`corelooper plugins --config`'s per-config status of installed plugins, and a section of a plugin
that is not installed. (corelooper_testing, the pytest plugin: plugins/testing/tests.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from corelooper.config import Config
from corelooper.errors import ConfigError
from corelooper.plugins import Plugins, check_sections


def test_a_section_of_a_plugin_not_installed_names_the_package():
    with pytest.raises(ConfigError, match=r"\[early_stopping\].*pip install corelooper-early-stopping"):
        check_sections(Config.from_dict({"early_stopping": {"patience": 2}}), {}, Plugins())


def _status_lines(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and "[" in line:
            out[line.split()[0]] = line[line.index("[") + 1 : line.rindex("]")]
    return out


@pytest.mark.slow
def test_plugins_command_shows_which_plugins_are_active_for_a_config(tmp_path):
    env = {"WANDB_MODE": "", "WANDB_PROJECT": "", "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": ""}
    config = str(Path("examples/digits/config.toml"))
    plain = run_cli("plugins", "--config", config, env=env)
    assert plain.returncode == 0, plain.stderr
    status = _status_lines(plain.stdout)
    assert status["tensorboard"] == "installed, active"
    assert status["wandb"] == (
        "installed, inactive for this config: no [wandb] section and neither "
        "WANDB_PROJECT nor WANDB_MODE is set"
    )
    assert status["early_stopping"] == "installed, inactive for this config: no [early_stopping] section"

    mixed = run_cli(
        "plugins",
        "--config",
        config,
        "--set",
        "wandb.project=x",
        "--set",
        "early_stopping.patience=2",
        "-p",
        "no:tensorboard",
        env=env,
    )
    assert mixed.returncode == 0, mixed.stderr
    status = _status_lines(mixed.stdout)
    assert status["wandb"] == "installed, active" and status["early_stopping"] == "installed, active"
    assert status["tensorboard"] == "installed, inactive: disabled"
