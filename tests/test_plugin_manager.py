"""Plugin discovery and mixing, with a real separately installed package
(tests/third_party_plugin, pip-installed for these tests by the ``thirdparty_plugin`` fixture of
conftest.py) found through its entry point."""

from __future__ import annotations

import dataclasses
import re
import textwrap

import pytest
import torch
import toys

from corelooper.config import Config, TrainArgs
from corelooper.errors import ConfigError
from corelooper.loop import Loop
from corelooper.plugins import AUTOLOAD_ENV, installed_entry_points, load_plugins

pytestmark = pytest.mark.usefixtures("thirdparty_plugin")


def provider_line(out: str, hook: str) -> str:
    (line,) = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(f"{hook}:")]
    return line


def plugin_block(out: str, name: str) -> str:
    """The lines `corelooper plugins` prints for plugin ``name``."""
    m = re.search(rf"^  {re.escape(name)} .*?(?=^  \S|^providers)", out, re.M | re.S)
    assert m, f"{name} not listed:\n{out}"
    return m.group(0)


def test_found_through_its_entry_point():
    eps = {ep.name: ep for ep in installed_entry_points()}
    assert eps["thirdparty"].value == "corelooper_thirdparty.plugin"
    assert eps["thirdparty_rival"].value == "corelooper_thirdparty.rival"
    pl = load_plugins(Config())
    info = pl.info["thirdparty"]
    assert (info.kind, info.dist, info.version) == ("installed", "corelooper-thirdparty-example", "0.3.1")
    assert info.hooks == ["corelooper_config_sections", "create_optimizer", "on_train_end"]
    assert info.sections == {"thirdparty": {"optimizer": "", "marker": ""}}


def test_inert_by_default(train_args):
    loop = Loop(toys.mlp(), train_args(max_steps=1), train_dataset=toys.Blobs(8))
    loop.train()
    assert isinstance(
        loop.optimizer.optimizer if hasattr(loop.optimizer, "optimizer") else loop.optimizer,
        torch.optim.AdamW,
    )


def _optimizer(loop):
    return getattr(loop.optimizer, "optimizer", loop.optimizer)


def _config(tmp_path, sections: str, **train) -> Config:
    cfg = Config.from_dict(
        {
            "train": {
                "output_dir": str(tmp_path / "out"),
                "save_strategy": "no",
                "max_steps": 2,
                "disable_tqdm": True,
                **train,
            }
        }
    )
    extra = Config.from_dict(__import__("tomllib").loads(textwrap.dedent(sections)))
    cfg = dataclasses.replace(cfg, sections=extra.sections, plugins=extra.plugins)
    if cfg.plugins.enable is None:  # only these two: other installed plugins must not change the outcome
        cfg = cfg.replace("plugins", enable=["thirdparty", "thirdparty_rival"])
    return cfg


SECTIONS = """
    [thirdparty]
    optimizer = "sgd"
    marker = "{marker}"
    [thirdparty_rival]
    optimizer = "adagrad"
"""


def test_same_provider_deterministic_winner_and_disable(tmp_path):
    marker = tmp_path / "marker.txt"
    sections = SECTIONS.format(marker=marker)
    loop = Loop(toys.mlp(), _config(tmp_path, sections), train_dataset=toys.Blobs(8))
    assert loop.plugins.provider_order("create_optimizer")[:2] == ["thirdparty", "thirdparty_rival"]
    loop.train()
    assert type(_optimizer(loop)) is torch.optim.SGD  # "thirdparty" sorts first: it is asked first
    assert marker.read_text() == "2"

    marker.unlink()
    # -p no:thirdparty (blocked_plugins): the rival answers; the disabled plugin's section is ignored
    loop = Loop(
        toys.mlp(),
        _config(tmp_path, sections, overwrite_output_dir=True),
        train_dataset=toys.Blobs(8),
        blocked_plugins=["thirdparty"],
    )
    loop.train()
    assert type(_optimizer(loop)) is torch.optim.Adagrad
    assert not marker.exists() and "thirdparty" not in loop.plugins.info
    assert loop.plugins.skipped["thirdparty"] == "disabled"

    # [plugins] disable = [...] does the same from the config
    loop = Loop(
        toys.mlp(),
        _config(
            tmp_path,
            sections + '[plugins]\ndisable = ["thirdparty", "thirdparty_rival"]\n',
            overwrite_output_dir=True,
        ),
        train_dataset=toys.Blobs(8),
    )
    loop.train()
    assert type(_optimizer(loop)) is torch.optim.AdamW and not marker.exists()


def test_enable_allow_list(tmp_path):
    cfg = _config(
        tmp_path, '[plugins]\nenable = ["thirdparty_rival"]\n[thirdparty_rival]\noptimizer = "adagrad"\n'
    )
    pl = load_plugins(cfg)
    assert "thirdparty_rival" in pl.info and "thirdparty" not in pl.info
    assert pl.skipped["thirdparty"] == "not in plugins.enable"
    assert {"builtin", "console", "jsonl"} <= set(pl.info)  # the core's own plugins always load

    with pytest.raises(ConfigError, match=r"plugins.enable names \['thirdpraty'\].*Installed:"):
        load_plugins(_config(tmp_path, '[plugins]\nenable = ["thirdpraty"]\n'))


def test_autoload_env_loads_no_installed_plugin(monkeypatch, tmp_path):
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    pl = load_plugins(Config())
    installed = {ep.name for ep in installed_entry_points()}
    assert {"thirdparty", "thirdparty_rival"} <= installed
    assert not installed & set(pl.info)
    assert all(pl.skipped[name].startswith("autoload off") for name in installed)
    assert pl.provider_order("create_optimizer") == ["builtin"]


def test_local_and_object_plugins_outrank_installed_ones(tmp_path):
    local = tmp_path / "my_local_plugin.py"
    local.write_text(
        "import torch\n\n"
        "def create_optimizer(loop, model):\n"
        "    return torch.optim.RMSprop(model.parameters(), lr=loop.args.learning_rate)\n"
    )
    cfg = _config(tmp_path, SECTIONS.format(marker="") + f'[plugins]\nlocal = ["{local}"]\n')
    loop = Loop(toys.mlp(), cfg, train_dataset=toys.Blobs(8))
    order = loop.plugins.provider_order("create_optimizer")
    assert order == [str(local), "thirdparty", "thirdparty_rival", "builtin"]
    loop.train()
    assert type(_optimizer(loop)) is torch.optim.RMSprop

    class ObjectPlugin:
        name = "object_plugin"

        def create_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.5)

    cfg = _config(tmp_path, SECTIONS.format(marker="") + f'[plugins]\nlocal = ["{local}"]\n')
    loop = Loop(toys.mlp(), cfg, train_dataset=toys.Blobs(8), plugins=[ObjectPlugin()])
    assert loop.plugins.provider_order("create_optimizer")[0] == "object_plugin"


def test_plugin_sections_are_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"Unknown key thirdparty.optimiser. Did you mean 'optimizer'"):
        load_plugins(_config(tmp_path, '[thirdparty]\noptimiser = "sgd"\n'))
    with pytest.raises(ConfigError, match=r"thirdparty.marker must be of type str.*got 3"):
        load_plugins(_config(tmp_path, "[thirdparty]\nmarker = 3\n"))
    with pytest.raises(
        ConfigError, match=r"Unknown config section \[thirdparti\].*Did you mean \[thirdparty\]"
    ):
        load_plugins(_config(tmp_path, '[thirdparti]\noptimizer = "sgd"\n'))
    # declared defaults are filled in
    cfg = _config(tmp_path, '[thirdparty]\noptimizer = "sgd"\n')
    pl = load_plugins(cfg)
    assert pl.config.section("thirdparty") == {"optimizer": "sgd", "marker": ""}
    assert cfg.section("thirdparty") == {"optimizer": "sgd"}  # the given config is not changed
    assert TrainArgs().seed == 42


@pytest.mark.slow
def test_cli_plugins_shows_installed_plugin_and_winner(cli, tmp_path):
    r = cli("plugins")
    assert r.returncode == 0, r.stderr
    block = plugin_block(r.stdout, "thirdparty")
    assert "(corelooper-thirdparty-example 0.3.1) [installed, active]" in block
    assert "hooks: corelooper_config_sections, create_optimizer, on_train_end" in block
    assert "config [thirdparty]: optimizer='', marker=''" in block
    line = provider_line(r.stdout, "create_optimizer")
    assert line.index(" thirdparty ") < line.index(" thirdparty_rival") and line.endswith(" builtin)")

    # with only the two rivals enabled, the winner is the one whose name sorts first
    config = tmp_path / "rivals.toml"
    config.write_text('[plugins]\nenable = ["thirdparty_rival", "thirdparty"]\n')
    r = cli("plugins", "--config", str(config))
    assert r.returncode == 0, r.stderr
    assert provider_line(r.stdout, "create_optimizer") == (
        "create_optimizer: thirdparty  (then thirdparty_rival, builtin)"
    )

    local = tmp_path / "cli_local_plugin.py"
    local.write_text("def on_log(state, logs):\n    pass\n")
    r = cli("plugins", "--config", str(config), "-p", "no:thirdparty", "-p", str(local))
    assert r.returncode == 0, r.stderr
    assert "thirdparty [installed, inactive: disabled]" in r.stdout
    block = plugin_block(r.stdout, str(local))  # -p MODULE registers a local plugin
    assert "[local, active]" in block and "hooks: on_log" in block
    assert provider_line(r.stdout, "create_optimizer") == "create_optimizer: thirdparty_rival  (then builtin)"

    config = tmp_path / "c.toml"
    config.write_text('[plugins]\ndisable = ["thirdparty_rival"]\n[thirdparty]\noptimizer = "sgd"\n')
    r = cli("plugins", "--config", str(config))
    assert r.returncode == 0, r.stderr
    assert "thirdparty_rival [installed, inactive: disabled]" in r.stdout
    assert "thirdparty_rival" not in provider_line(r.stdout, "create_optimizer")

    r = cli("plugins", env={AUTOLOAD_ENV: "1"})
    assert r.returncode == 0, r.stderr
    assert "thirdparty [installed, inactive: autoload off" in r.stdout
    assert provider_line(r.stdout, "create_optimizer") == "create_optimizer: builtin"


def test_report_to_chooses_the_logging_plugins_as_hf(monkeypatch):
    """HF's report_to: only the named loggers run; "none" runs none; an unknown name is an error."""
    monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    names = {ep.name for ep in installed_entry_points()}
    if not {"tensorboard", "wandb"} <= names:
        pytest.fail("the tensorboard and wandb plugins are part of the development install")
    pl = load_plugins(Config.from_dict({"train": {"report_to": ["wandb"]}}))
    assert "wandb" in pl.info and pl.skipped["tensorboard"] == "not in train.report_to"
    pl = load_plugins(Config.from_dict({"train": {"report_to": "none"}}))
    assert {"wandb", "tensorboard"} <= set(pl.skipped) and "wandb" not in pl.info
    pl = load_plugins(Config.from_dict({"train": {}}))  # corelooper's default: "all"
    assert {"wandb", "tensorboard"} <= set(pl.info)
    with pytest.raises(
        ConfigError, match=r"train.report_to names \['my_tracker'\].*pip install corelooper-my_tracker"
    ):
        load_plugins(Config.from_dict({"train": {"report_to": ["my_tracker"]}}))
