"""Bad input through the real CLI: a non-zero exit, one paragraph naming what is wrong (key,
file, plugin and hook) and how to fix it, and never a traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

TOYS = Path(__file__).resolve().parent / "toys.py"


@pytest.fixture
def cli():
    """The real CLI, without other installed plugins (they are tested elsewhere): faster, and
    what is tested here does not depend on what else happens to be installed."""

    def run(*args, env=None):
        return run_cli(*args, env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})})

    return run


def write_config(tmp_path: Path, body: str = "", **replace: str) -> Path:
    sections = {
        "model": f'factory = "{TOYS}:mlp"',
        "data": f'train = "{TOYS}:blobs_train"',
        "train": f'output_dir = "{tmp_path / "out"}"\nmax_steps = 2\nsave_strategy = "no"\nlogging_steps = 1',
    }
    sections.update(replace)
    text = "\n".join(f"[{k}]\n{v}" for k, v in sections.items()) + "\n" + textwrap.dedent(body)
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def assert_clean_error(r, *needles: str, code: int | None = None) -> str:
    """Non-zero exit; exactly one error paragraph (one line) naming every needle; no traceback."""
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    if code is not None:
        assert r.returncode == code, out
    assert "Traceback" not in out
    lines = r.stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("corelooper: error: ")]
    assert len(errors) == 1, r.stderr
    # one paragraph: the message is a single line; the --traceback hint follows only where a
    # traceback could help (a plugin or the training step failed), not after bad input (2, 4, 5)
    hint = [] if r.returncode in (2, 4, 5) else ["(run with --traceback for the full traceback)"]
    assert lines[errors[0] + 1 :] == hint, r.stderr
    message = lines[errors[0]]
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    return message


def test_missing_config(cli, tmp_path):
    r = cli("run", str(tmp_path / "nope.toml"))
    assert_clean_error(r, "nope.toml", "does not exist", code=2)


def test_malformed_toml(cli, tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[train]\nlearning_rate = 3e-4\nseed = "42\n')
    r = cli("run", str(path))
    assert_clean_error(r, str(path), "is not valid TOML", "line 3")


def test_unknown_key_with_did_you_mean(cli, tmp_path):
    path = write_config(tmp_path, train="learning_rat = 1e-3")
    assert_clean_error(cli("run", str(path)), "train.learning_rat", "Did you mean 'learning_rate'?")
    # an HF TrainingArguments name that corelooper does not support says why, naming the key
    path = write_config(tmp_path, train="save_only_model = true")
    assert_clean_error(cli("run", str(path)), "train.save_only_model = True", "exact resume")
    # a misspelt HF name is offered the HF name and what it is here (not an unrelated field): the
    # plugin that answers to it is named when installed plugins load (autoload off imports none)
    path = write_config(tmp_path, train='deepspeeed = "ds.json"')
    assert_clean_error(
        cli("run", str(path), env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": ""}),
        "train.deepspeeed",
        "Did you mean 'deepspeed'?",
        "the plugin 'deepspeed' answers to it",
    )
    # and a --set override is checked the same way
    path = write_config(tmp_path)
    r = cli("run", str(path), "--set", "train.num_train_epoch=3")
    assert_clean_error(r, "train.num_train_epoch", "Did you mean 'num_train_epochs'?")


def test_wrong_type(cli, tmp_path):
    path = write_config(tmp_path, train='per_device_train_batch_size = "8"')
    assert_clean_error(cli("run", str(path)), "train.per_device_train_batch_size must be int", "'8'")
    path = write_config(tmp_path, train='lr_scheduler_type = "cosin"')
    assert_clean_error(cli("run", str(path)), "train.lr_scheduler_type must be one of", "'cosine'")


@pytest.mark.slow
def test_factory_that_does_not_import(cli, tmp_path):
    path = write_config(tmp_path, model='factory = "no_such_package.models:build"')
    assert_clean_error(cli("run", str(path)), "model.factory", "no_such_package.models")
    path = write_config(tmp_path, model=f'factory = "{TOYS}:mpl"')
    assert_clean_error(
        cli("run", str(path)), "model.factory", "has no attribute 'mpl'", "Did you mean 'mlp'?"
    )


@pytest.mark.slow
def test_dataset_factory_returning_the_wrong_thing(cli, tmp_path):
    (tmp_path / "bad_data.py").write_text(
        "def numbers(**_):\n    return 123\n\ndef strings(**_):\n    return ['a', 'b']\n"
    )
    path = write_config(tmp_path, data='train = "bad_data.py:numbers"')
    assert_clean_error(
        cli("run", str(path)), "data.train = 'bad_data.py:numbers'", "returned int", "not a dataset", code=4
    )
    path = write_config(tmp_path, data='train = "bad_data.py:strings"')
    assert_clean_error(
        cli("run", str(path)), "data.train = 'bad_data.py:strings'", "sample 0 is a str", code=4
    )


def test_local_plugin_that_fails_to_import(cli, tmp_path):
    (tmp_path / "broken_plugin.py").write_text("import no_such_dependency\n")
    path = write_config(tmp_path, plugins='local = ["broken_plugin.py"]')
    assert_clean_error(cli("run", str(path)), "plugins.local", "broken_plugin.py", "no_such_dependency")


def test_installed_plugin_that_fails_to_import(cli, tmp_path, allow_plugins):
    """A real distribution on sys.path (a .dist-info with an entry point) whose module raises."""
    site = tmp_path / "site"
    info = site / "broken_ep-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-ep\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[corelooper]\nbroken = broken_ep_module\n")
    (site / "broken_ep_module.py").write_text("raise RuntimeError('needs libfoo 2')\n")
    env = {"PYTHONPATH": str(site), "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": ""}
    allow_plugins("broken-ep")  # installed by this test (the root conftest.py allows no other)
    path = write_config(tmp_path, plugins='enable = ["broken"]')  # load only this one
    r = cli("run", str(path), env=env)
    assert_clean_error(
        r, "Plugin 'broken'", "broken-ep 1.0", "failed to import", "needs libfoo 2", "-p no:broken", code=3
    )
    # the hint works: skipped, everything else still loads
    r = cli("plugins", "--config", str(path), "-p", "no:broken", env=env)
    assert r.returncode == 0, r.stderr
    assert "broken [installed, inactive: disabled]" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hook", "body"),
    [
        (
            "on_step_end",
            "def on_step_end(state):\n    raise ValueError('bad value at step %d' % state.global_step)\n",
        ),
        ("compute_loss", "def compute_loss(batch, num_items_in_batch):\n    raise KeyError('weights')\n"),
    ],
)
def test_plugin_that_raises_in_a_hook(cli, tmp_path, hook, body):
    (tmp_path / "raising_plugin.py").write_text(body)
    path = write_config(tmp_path, plugins='local = ["raising_plugin.py"]')
    r = cli("run", str(path))
    message = assert_clean_error(
        r, "Plugin 'raising_plugin.py'", f"raised in hook {hook!r}", "-p no:raising_plugin.py", code=3
    )
    assert (
        ("ValueError: bad value at step 1" in message)
        if hook == "on_step_end"
        else ("KeyError: 'weights'" in message and "global_step 0" in message)
    )


def test_traceback_flag_shows_the_traceback(cli, tmp_path):
    path = write_config(tmp_path, train="learning_rat = 1e-3")
    r = cli("run", str(path), "--traceback")
    assert r.returncode == 2 and "Traceback" in r.stderr and "train.learning_rat" in r.stderr


@pytest.mark.parametrize(
    "line", ["learning_rate = inf", "weight_decay = inf", "max_grad_norm = nan", "num_train_epochs = nan"]
)
def test_values_that_can_only_give_nan_fail_at_start_up(cli, tmp_path, line):
    path = write_config(tmp_path, train=f'output_dir = "{tmp_path / "out"}"\nmax_steps = 2\n{line}')
    key = line.split(" = ")[0]
    assert_clean_error(cli("run", str(path)), f"train.{key}", "not a finite number", code=2)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.slow
def test_plugin_that_returns_the_wrong_type_is_blamed(cli, tmp_path):
    """Not "the model or its loss" (exit 6): the plugin, the hook, what was expected, what came."""
    (tmp_path / "sched_plugin.py").write_text("def create_scheduler(optimizer):\n    return 'cosine'\n")
    path = write_config(tmp_path, plugins='local = ["sched_plugin.py"]')
    r = cli("run", str(path))
    assert_clean_error(
        r,
        "Plugin 'sched_plugin.py' returned a str from hook 'create_scheduler'",
        "expected a learning-rate scheduler",
        "get_last_lr()",
        "-p no:sched_plugin.py",
        code=3,
    )
