"""Config: TOML in, validated dataclasses out, --set overrides, resolved TOML back to disk."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import tomllib

from corelooper.config import (
    Config,
    DataConfig,
    ModelConfig,
    PluginsConfig,
    TrainArgs,
    apply_override,
    dumps_toml,
    import_object,
)
from corelooper.errors import ConfigError

EXAMPLE = textwrap.dedent("""
    [model]
    factory = "mypkg.model:build"
    args = { hidden = 64, layers = [1, 2], act = "gelu" }

    [data]
    train = "mypkg.data:train"
    eval = "mypkg.data:eval"
    args = { root = "/data" }

    [train]
    output_dir = "runs/x"
    learning_rate = 3e-4
    num_train_epochs = 2
    per_device_train_batch_size = 16
    gradient_accumulation_steps = 4
    warmup_steps = 0.1
    lr_scheduler_type = "cosine"
    eval_strategy = "steps"
    eval_steps = 50

    [plugins]
    disable = ["wandb"]
    local = ["my_plugin.py"]

    [tensorboard]
    log_dir = "tb"
""")


@pytest.fixture
def example(tmp_path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(EXAMPLE)
    return path


def test_load_sections_and_hf_names(example):
    cfg = Config.load(example)
    assert cfg.model == ModelConfig(
        factory="mypkg.model:build", args={"hidden": 64, "layers": [1, 2], "act": "gelu"}
    )
    assert cfg.data == DataConfig(train="mypkg.data:train", eval="mypkg.data:eval", args={"root": "/data"})
    t = cfg.train
    assert (t.learning_rate, t.num_train_epochs, t.gradient_accumulation_steps) == (3e-4, 2.0, 4)
    assert isinstance(t.num_train_epochs, float)  # an int is accepted for a float, and converted
    assert t.warmup_steps == 0.1 and t.eval_steps == 50 and t.seed == 42  # untouched: HF's default
    assert cfg.plugins == PluginsConfig(enable=None, disable=["wandb"], local=["my_plugin.py"])
    assert cfg.sections == {"tensorboard": {"log_dir": "tb"}}
    assert cfg.source == example.resolve()


def test_the_same_config_built_in_python(example):
    built = Config(
        model=ModelConfig(factory="mypkg.model:build", args={"hidden": 64, "layers": [1, 2], "act": "gelu"}),
        data=DataConfig(train="mypkg.data:train", eval="mypkg.data:eval", args={"root": "/data"}),
        train=TrainArgs(
            output_dir="runs/x",
            learning_rate=3e-4,
            num_train_epochs=2.0,
            per_device_train_batch_size=16,
            gradient_accumulation_steps=4,
            warmup_steps=0.1,
            lr_scheduler_type="cosine",
            eval_strategy="steps",
            eval_steps=50,
        ),
        plugins=PluginsConfig(disable=["wandb"], local=["my_plugin.py"]),
        sections={"tensorboard": {"log_dir": "tb"}},
    )
    assert built.to_dict() == Config.load(example).to_dict()


def test_set_overrides(example):
    cfg = Config.load(
        example,
        [
            "train.learning_rate=1e-3",
            "train.lr_scheduler_type=linear",
            "train.logging_first_step=true",
            "model.args.hidden=128",
            "plugins.disable=[]",
            "tensorboard.log_dir=other",
            "train.run_name=a=b",
        ],
    )
    assert cfg.train.learning_rate == 1e-3 and cfg.train.lr_scheduler_type == "linear"
    assert cfg.train.logging_first_step is True
    assert cfg.model.args == {"hidden": 128, "layers": [1, 2], "act": "gelu"}
    assert cfg.plugins.disable == [] and cfg.sections["tensorboard"]["log_dir"] == "other"
    assert cfg.train.run_name == "a=b"  # split at the first "=" only


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("learning_rate=1", "the key needs a section"),
        ("train.learning_rate", "expected KEY=VALUE"),
        ("train.learning_rate.x=1", "'learning_rate' is not a section"),
    ],
)
def test_bad_set_syntax(item, message):
    data = {"train": {"learning_rate": 0.1}}
    with pytest.raises(ConfigError, match=message):
        apply_override(data, item)


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"learning_rat": 1e-3}, r"Unknown key train.learning_rat. Did you mean 'learning_rate'\?"),
        ({"evaluation_strategy": "steps", "eval_strategy": "epoch"}, r"contradicts train.eval_strategy"),
        ({"lr": 0.1}, r"Unknown key train.lr. Did you mean learning_rate\?"),
        ({"seed": "1"}, r"train.seed must be int, got '1' \(str\)"),
        ({"learning_rate": True}, r"train.learning_rate must be float"),
        ({"eval_strategy": "step"}, r"train.eval_strategy must be one of 'no', 'steps', 'epoch'"),
        ({"per_device_train_batch_size": 0}, r"train.per_device_train_batch_size must be > 0"),
        ({"warmup_steps": 2.5}, r"train.warmup_steps = 2.5: use an int number of steps or a ratio < 1"),
        ({"max_steps": -1, "num_train_epochs": 0}, r"nothing to train"),
        ({"load_best_model_at_end": True}, r"need evaluations: set train.eval_strategy"),
    ],
)
def test_invalid_train_values_name_the_key(train, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"train": train})


def test_other_structural_errors():
    with pytest.raises(ConfigError, match=r"Top-level key 'learning_rate' = 0.1 is not a section"):
        Config.from_dict({"learning_rate": 0.1})
    with pytest.raises(ConfigError, match=r"\[train\] must be a table"):
        Config.from_dict({"train": 3})
    with pytest.raises(ConfigError, match=r"Unknown key model.factroy. Did you mean 'factory'"):
        Config.from_dict({"model": {"factroy": "x:y"}})


def test_metric_for_best_model_defaults_like_hf():
    cfg = Config.from_dict(
        {"train": {"eval_strategy": "epoch", "save_strategy": "epoch", "load_best_model_at_end": True}}
    )
    assert cfg.train.metric_for_best_model == "loss" and cfg.train.greater_is_better is False
    cfg = Config.from_dict({"train": {"metric_for_best_model": "accuracy"}})
    assert cfg.train.greater_is_better is True


def test_write_and_load_round_trip(tmp_path, example):
    cfg = Config.load(example, ['train.run_name=with "quotes" and \\ backslash', "model.args.note=a\nb"])
    out = tmp_path / "resolved.toml"
    cfg.write(out)
    again = Config.load(out)
    assert again.to_dict() == cfg.to_dict()
    assert again.train.run_name == 'with "quotes" and \\ backslash'
    # unset (None) keys are left out: TOML has no null
    assert "eval_steps = 50" in out.read_text() and "data_seed" not in out.read_text()
    data = {"s": {"inf": float("inf"), "unset": None, "path": Path("a/b"), "nested": {"a": [1, 2.5, "x"]}}}
    assert tomllib.loads(dumps_toml(data)) == {
        "s": {"inf": float("inf"), "path": "a/b", "nested": {"a": [1, 2.5, "x"]}}
    }


def test_import_object_relative_to_the_config_folder(tmp_path):
    (tmp_path / "factories.py").write_text("class Box:\n    class Inner:\n        value = 7\n")
    assert import_object("factories.py:Box.Inner.value", "model.factory", tmp_path) == 7
    with pytest.raises(ConfigError, match=r"model.factory = 'factories.py': expected 'module:callable'"):
        import_object("factories.py", "model.factory", tmp_path)
    with pytest.raises(ConfigError, match=r"model.factory: file 'nope.py' does not exist"):
        import_object("nope.py:f", "model.factory", tmp_path)
    with pytest.raises(ConfigError, match=r"has no attribute 'Bx'. Did you mean 'Box'"):
        import_object("factories.py:Bx", "model.factory", tmp_path)
