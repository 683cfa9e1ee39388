"""The plugin contract's lifecycle and declarations (issue 25, failures 2 and 3):

* ``corelooper_configure`` is historic: a plugin registered after ``Loop()`` is configured at
  registration (the old registry never configured it: 0 calls, no per-run object, plugins.json
  empty); one that declares config sections then is refused with the reason;
* ``corelooper_unconfigure`` fires once when the Loop ends (``close()``, ``with``, a finalizer);
* settings name the plugin they need: a setting whose plugin is blocked is refused before
  training (exit 2), and ``-p no:NAME`` of a name that is not installed gets a did-you-mean;
* the "inactive unless [section]" opening is one helper of the registry.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import toys
from conftest import REPO, run_cli

from corelooper import Loop
from corelooper.config import TrainArgs
from corelooper.errors import ConfigError, PluginError

TOYS = Path(__file__).resolve().parent / "toys.py"


class Counter:
    """A per-run object with checkpointed state."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class LatePlugin:
    """Registers a per-run Counter from corelooper_configure, and records how it was called."""

    name = "late"

    def __init__(self):
        self.configured: list[tuple] = []

    def corelooper_configure(self, config, plugins):
        self.configured.append((config, plugins))
        counter = Counter()
        plugins.register(counter, "late.run")
        plugins.register_for_checkpointing("late", counter)


class ClosingPlugin(LatePlugin):
    """... and records corelooper_unconfigure."""

    def __init__(self):
        super().__init__()
        self.unconfigured: list[tuple] = []

    def corelooper_unconfigure(self, config, plugins):
        self.unconfigured.append((config, plugins))


def test_a_plugin_registered_after_the_loop_is_configured(train_args, tmp_path):
    args = train_args(
        per_device_train_batch_size=8,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        output_dir=str(tmp_path / "run"),
    )
    loop = Loop(toys.mlp(), args, train_dataset=toys.Blobs(64), blocked_plugins=["console"])
    late = LatePlugin()
    loop.plugins.register(late, "late")
    assert late.configured == [(loop.config, loop.plugins)]  # once, with the run's config and registry
    counter = loop.plugins.get("late.run")
    assert isinstance(counter, Counter) and loop.plugins.info["late.run"].kind == "run"
    loop.train()
    assert counter.steps == 6 and len(late.configured) == 1
    assert json.loads((tmp_path / "run" / "checkpoint-3" / "plugins.json").read_text())["late"] == {
        "steps": 3
    }
    assert json.loads((tmp_path / "run" / "checkpoint-6" / "plugins.json").read_text())["late"] == {
        "steps": 6
    }


def test_a_late_plugin_that_declares_config_sections_is_refused(train_args):
    class Sections:
        name = "sections"

        def corelooper_config_sections(self):
            return {"sections": {"x": 1}}

    loop = Loop(toys.mlp(), train_args(max_steps=1), train_dataset=toys.Blobs(8))
    with pytest.raises(
        PluginError,
        match=r"'sections' declares config sections .* registered after the "
        r"config was validated: pass it to Loop\(plugins=\[...\]\)",
    ):
        loop.plugins.register(Sections(), "sections")
    assert loop.plugins.get("sections") is None
    # the same plugin passed to the Loop is fine
    assert Loop(
        toys.mlp(), train_args(max_steps=1), train_dataset=toys.Blobs(8), plugins=[Sections()]
    ).config.section("sections") == {"x": 1}


def test_unconfigure_fires_once_when_the_loop_is_closed(train_args, tmp_path):
    late = ClosingPlugin()
    loop = Loop(toys.mlp(), train_args(max_steps=2), train_dataset=toys.Blobs(16), plugins=[late])
    loop.train()
    assert late.unconfigured == []  # train() does not end the Loop: evaluate() may follow
    loop.evaluate(toys.Blobs(8))
    loop.close()
    loop.close()
    assert late.unconfigured == [(loop.config, loop.plugins)]

    late = ClosingPlugin()
    with Loop(
        toys.mlp(),
        train_args(max_steps=2, output_dir=str(tmp_path / "b")),
        train_dataset=toys.Blobs(16),
        plugins=[late],
    ) as loop:
        loop.train()
        assert late.unconfigured == []
    assert len(late.unconfigured) == 1


@pytest.mark.slow
def test_unconfigure_fires_for_a_script_that_never_closes_its_loop(tmp_path):
    """The finalizer: when the Loop is collected, and at interpreter exit."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(f"""
        import gc, sys
        sys.path.insert(0, {str(TOYS.parent)!r})
        import toys
        from corelooper import Loop
        from corelooper.config import TrainArgs

        class Marker:
            def __init__(self, tag):
                self.name = "marker-" + tag
                self.tag = tag
            def corelooper_unconfigure(self):
                print("unconfigured", self.tag, flush=True)

        args = TrainArgs(output_dir={str(tmp_path / "out")!r}, max_steps=1, save_strategy="no",
                         disable_tqdm=True)
        loop = Loop(toys.mlp(), args, train_dataset=toys.Blobs(8), plugins=[Marker("collected")])
        loop.train()
        del loop
        gc.collect()
        print("collected", flush=True)
        kept = Loop(toys.mlp(), args, train_dataset=toys.Blobs(8), plugins=[Marker("at-exit")])
        print("exiting", flush=True)
    """)
    )
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.split()[0] in ("unconfigured", "collected", "exiting")]
    assert lines == ["unconfigured collected", "collected", "exiting", "unconfigured at-exit"], r.stdout


def test_section_or_inactive_is_the_configure_opening(train_args):
    seen = []

    class Mine:
        name = "mine"

        def corelooper_config_sections(self):
            return {"mine": {"size": 3, "colour": "red"}}

        def corelooper_configure(self, config, plugins):
            seen.append(plugins.section_or_inactive(config, "mine"))

    from corelooper.config import Config

    loop = Loop(toys.mlp(), train_args(max_steps=1), train_dataset=toys.Blobs(8), plugins=[Mine()])
    assert seen == [None] and loop.plugins.inactive["mine"] == "no [mine] section"
    config = Config(train=train_args(max_steps=1), sections={"mine": {"size": 5}})
    loop = Loop(toys.mlp(), config, train_dataset=toys.Blobs(8), plugins=[Mine()])
    assert seen[1] == {"size": 5, "colour": "red"} and "mine" not in loop.plugins.inactive


# -- settings name the plugin they need --------------------------------------------------------


@pytest.mark.parametrize(
    ("train", "blocked", "needles"),
    [
        (
            {
                "save_strategy": "best",
                "eval_strategy": "steps",
                "eval_steps": 1,
                "metric_for_best_model": "loss",
            },
            ["best_metric"],
            ["train.save_strategy = 'best'", "'best_metric'"],
        ),
        (
            {
                "load_best_model_at_end": True,
                "eval_strategy": "steps",
                "save_strategy": "steps",
                "eval_steps": 1,
                "save_steps": 1,
            },
            ["best_metric"],
            ["train.load_best_model_at_end = True", "'best_metric'"],
        ),
        (
            {"auto_find_batch_size": True},
            ["auto_batch_size"],
            ["train.auto_find_batch_size = True", "'auto_batch_size'"],
        ),
        ({"deepspeed": "ds.json"}, ["deepspeed"], ["train.deepspeed = 'ds.json'", "'deepspeed'"]),
        ({"neftune_noise_alpha": 5.0}, ["neftune"], ["train.neftune_noise_alpha = 5.0", "'neftune'"]),
    ],
)
def test_a_setting_whose_plugin_is_blocked_is_refused(train_args, train, blocked, needles):
    with pytest.raises(ConfigError) as info:
        Loop(
            toys.mlp(),
            train_args(max_steps=1, **train),
            train_dataset=toys.Blobs(8),
            eval_dataset=toys.Blobs(8),
            blocked_plugins=blocked,
        )
    text = str(info.value)
    for needle in needles:
        assert needle in text, text
    assert "-p no:" in text and "[plugins] disable / enable" in text  # how it was left out
    # the same settings with the plugin loaded are accepted
    if "deepspeed" not in train:  # (building the DeepSpeed backend needs its JSON file)
        Loop(
            toys.mlp(),
            train_args(max_steps=1, **train),
            train_dataset=toys.Blobs(8),
            eval_dataset=toys.Blobs(8),
        )


def test_a_setting_whose_plugin_is_not_enabled_is_refused(tmp_path):
    from corelooper.config import Config

    config = Config.from_dict(
        {
            "train": {"output_dir": str(tmp_path), "auto_find_batch_size": True},
            "plugins": {"enable": ["tensorboard"]},
        }
    )
    with pytest.raises(
        ConfigError, match=r"needs a plugin .*never imported: 'auto_batch_size' \(not in plugins.enable\)"
    ):
        Loop(toys.mlp(), config, train_dataset=toys.Blobs(8))


def test_plugins_translate_the_hf_names_they_answer_to():
    """The translations moved from the core into the plugins; a name no plugin answers to is an
    unknown key."""
    from corelooper.hf.args import declared_train_fields

    owners = {key: [name for name, _ in v] for key, v in declared_train_fields().items()}
    assert owners["deepspeed"] == ["deepspeed"] and owners["fsdp_config"] == ["fsdp"]
    assert owners["logging_dir"] == ["tensorboard"] and owners["auto_find_batch_size"] == ["auto_batch_size"]
    args = TrainArgs(logging_dir="tb", deepspeed={"zero_optimization": {"stage": 1}})
    assert args.plugin_values == {"logging_dir": "tb", "deepspeed": {"zero_optimization": {"stage": 1}}}
    assert args.plugin_sections == {
        "tensorboard": {"log_dir": "tb"},
        "deepspeed": {"extra": {"zero_optimization": {"stage": 1}}},
    }
    with pytest.raises(ConfigError, match="Unknown key train.no_plugin_answers_to_this"):
        TrainArgs(no_plugin_answers_to_this=1)


def write_config(tmp_path: Path, train: str = "") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        textwrap.dedent(f"""
        [model]
        factory = "{TOYS}:mlp"
        [data]
        train = "{TOYS}:blobs_train"
        eval = "{TOYS}:blobs_eval"
        [train]
        output_dir = "{tmp_path / "out"}"
        max_steps = 2
        logging_steps = 1
    """)
        + textwrap.dedent(train)
    )
    return path


def one_error_line(r) -> str:
    assert "Traceback" not in r.stdout + r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("corelooper: error: ")]
    return line


@pytest.mark.slow
def test_cli_refuses_a_blocked_plugins_setting_before_training(tmp_path):
    config = write_config(
        tmp_path,
        """
        eval_strategy = "steps"
        eval_steps = 1
        save_strategy = "best"
        load_best_model_at_end = true
        metric_for_best_model = "loss"
    """,
    )
    r = run_cli("run", str(config), "-p", "no:best_metric")
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    assert "needs the plugin 'best_metric'" in line and "train.save_strategy = 'best'" in line, line
    assert not (tmp_path / "out").exists()  # refused before training: nothing written

    config = write_config(tmp_path, "auto_find_batch_size = true\n")
    r = run_cli("run", str(config), "-p", "no:auto_batch_size")
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    assert "train.auto_find_batch_size = True needs a plugin that answers to it" in line, line
    assert "never imported: 'auto_batch_size' (disabled)" in line, line  # blocked: its settings unread


@pytest.mark.parametrize(
    ("how", "name", "hint"),
    [
        ("-p", "tensorbord", "Did you mean 'tensorboard'?"),
        ("disable", "best_metrc", "Did you mean 'best_metric'?"),
        ("-p", "no_such_plugin_at_all", "Known: "),
    ],
)
def test_blocking_a_plugin_that_is_not_there_is_refused(tmp_path, how, name, hint):
    config = write_config(tmp_path)
    if how == "disable":
        config.write_text(config.read_text().replace("[model]", f'[plugins]\ndisable = ["{name}"]\n[model]'))
        r = run_cli("run", str(config))
    else:
        r = run_cli("run", str(config), "-p", f"no:{name}")
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    assert f"names {name!r}, which is not an installed plugin nor a builtin policy." in line and hint in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_cli_closes_its_loop(tmp_path):
    """`corelooper run` ends with corelooper_unconfigure (a local plugin writes a marker there)."""
    local = tmp_path / "marker_plugin.py"
    local.write_text(
        textwrap.dedent(f"""
        def corelooper_unconfigure(config):
            open({str(tmp_path / "closed")!r}, "a").write(config.train.output_dir + "\\n")
    """)
    )
    r = run_cli(
        "run",
        str(write_config(tmp_path)),
        "-p",
        str(local),
        cwd=REPO,
        env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "closed").read_text() == f"{tmp_path / 'out'}\n"
