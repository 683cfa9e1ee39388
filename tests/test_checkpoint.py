"""What a checkpoint holds, sharding, HF models, save strategies, rotation and best model, and
that a crash never costs the last complete checkpoint. Real safetensors files throughout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
import torch
import toys
from safetensors.torch import load_file
from torch import nn

from corelooper.checkpoints.checkpoint import (
    MANIFEST,
    WEIGHTS,
    WEIGHTS_INDEX,
    list_checkpoints,
    parse_size,
    read_weights,
)
from corelooper.config import TrainArgs
from corelooper.errors import ConfigError, DataError, PluginError, TrainingError
from corelooper.loop import Loop


@pytest.fixture(autouse=True)
def _no_installed_plugins(monkeypatch):
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")


class Counter:
    """A stateful plugin: its state goes to plugins.json and comes back on resume."""

    name = "counter"

    def __init__(self):
        self.steps = 0

    def corelooper_configure(self, plugins):
        plugins.register_for_checkpointing("counter", self)  # explicit: nothing is scanned for

    def on_step_end(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, d):
        self.steps = d["steps"]


def make_loop(out, plugins=(), model=None, eval_dataset=None, compute_metrics=None, **overrides) -> Loop:
    args = dict(
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=8,
        logging_steps=1,
        save_steps=2,
        learning_rate=1e-2,
    )
    torch.manual_seed(0)
    return Loop(
        model or toys.mlp(),
        TrainArgs(**{**args, **overrides}),
        train_dataset=toys.Blobs(64),
        eval_dataset=eval_dataset,
        compute_metrics=compute_metrics,
        plugins=plugins,
        blocked_plugins=["console"],
    )


def test_checkpoint_contents(tmp_path):
    loop = make_loop(tmp_path / "out", plugins=[Counter()])
    loop.train()
    out = tmp_path / "out"
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not [
        p for p in out.iterdir() if p.name.startswith(".") and p.name != ".corelooper.lock"
    ]  # no temp folder
    ckpt = out / "checkpoint-4"
    names = {p.name for p in ckpt.iterdir()}
    assert names == {
        WEIGHTS,
        "optimizer.pt",
        "scheduler.pt",
        "rng_state_0.pth",
        "loop_state.json",
        "plugins.json",
        "config.toml",
        "process_state_0.json",
        MANIFEST,
    }
    # everything loads without unpickling arbitrary objects
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(optim["state"]) == len(list(loop.model.parameters()))
    sched = torch.load(ckpt / "scheduler.pt", weights_only=True)
    assert sched["last_epoch"] == 4
    rng = torch.load(ckpt / "rng_state_0.pth", weights_only=True)
    assert {"python", "numpy", "torch"} <= set(rng)
    state = json.loads((ckpt / "loop_state.json").read_text())
    assert state["global_step"] == 4 and state["step_in_epoch"] == 4 and state["micro_batches_in_epoch"] == 4
    assert [h["step"] for h in state["log_history"]] == [1, 2, 3, 4]
    assert {"epoch", "best_metric", "best_model_checkpoint", "total_samples_seen"} <= set(state)
    assert json.loads((ckpt / "plugins.json").read_text()) == {"counter": {"steps": 4}}
    config = tomllib.loads((ckpt / "config.toml").read_text())
    assert config["train"]["save_steps"] == 2 and config["train"]["output_dir"] == str(out)
    import xxhash

    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["algorithm"] == "xxh3_128" and manifest["finite"] is True
    assert manifest["files"] == {
        p.name: {"size": p.stat().st_size, "checksum": xxhash.xxh3_128_hexdigest(p.read_bytes())}
        for p in ckpt.iterdir()
        if p.name != MANIFEST
    }
    # weights of the last checkpoint and of the final model are the trained ones
    trained = loop.model.state_dict()
    for path in (out / "checkpoint-6" / WEIGHTS, out / WEIGHTS):
        saved = load_file(path)
        assert saved.keys() == trained.keys()
        assert all(torch.equal(saved[k], trained[k]) for k in trained)


def test_plugin_state_restored_on_resume(tmp_path):
    make_loop(tmp_path / "out", plugins=[Counter()], max_steps=4).train()
    counter = Counter()
    make_loop(tmp_path / "out", plugins=[counter], max_steps=6).train(
        resume_from_checkpoint=tmp_path / "out" / "checkpoint-2"
    )
    assert counter.steps == 6  # 2 restored + 4 more


@pytest.mark.parametrize(
    "size, bytes_", [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), (1234, 1234), ("1.5KB", 1500)]
)
def test_parse_size(size, bytes_):
    assert parse_size(size) == bytes_


def test_bad_shard_size_is_named(tmp_path):
    """A config value: refused when the arguments are built (exit 2), not at the first save."""
    with pytest.raises(ConfigError, match="save_max_shard_size = '5 gigs' is not a size"):
        make_loop(tmp_path / "out", save_max_shard_size="5 gigs")


def test_sharded_weights_and_resume(tmp_path):
    """Above save_max_shard_size: shards + index, as save_pretrained writes them."""
    out = tmp_path / "out"
    loop = make_loop(out, save_max_shard_size=600, max_steps=4)
    loop.train()
    ckpt = out / "checkpoint-4"
    index = json.loads((ckpt / WEIGHTS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (ckpt / WEIGHTS).exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    trained = loop.model.state_dict()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in trained.values())
    for name in shards:  # every tensor lives in the shard the index names, each shard <= the limit
        shard = load_file(ckpt / name)
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= 600 or len(shard) == 1
        assert all(index["weight_map"][k] == name for k in shard)
    final = read_weights(out)
    assert all(torch.equal(final[k], trained[k]) for k in trained)
    assert (out / WEIGHTS_INDEX).exists() and not (out / WEIGHTS).exists()
    resumed = make_loop(out, save_max_shard_size=600, max_steps=6)
    resumed.train(resume_from_checkpoint=ckpt)
    assert resumed.state.global_step == 6


def _tiny_tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=toys.VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_hf_model_saved_with_save_pretrained(tmp_path):
    """A PreTrainedModel's checkpoint loads with from_pretrained; sharded too; tied weights resume."""
    from transformers import LlamaForCausalLM

    out = tmp_path / "out"
    args = TrainArgs(
        output_dir=str(out),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-2,
        save_max_shard_size=3000,
    )
    loop = Loop(_tiny_tied_llama(), args, train_dataset=toys.lm_samples(16), blocked_plugins=["console"])
    loop.train()
    ckpt = out / "checkpoint-4"
    assert (ckpt / "config.json").exists() and (ckpt / WEIGHTS_INDEX).exists()
    for folder in (ckpt, out):
        reloaded = LlamaForCausalLM.from_pretrained(folder)
        ref = loop.model.state_dict()
        got = reloaded.state_dict()
        assert all(torch.equal(got[k], ref[k]) for k in ref)
    # resume: lm_head.weight is tied to embed_tokens.weight, and save_pretrained stores it once
    model = _tiny_tied_llama()
    resumed = Loop(
        model,
        TrainArgs(**{**args.__dict__, "max_steps": 6}),
        train_dataset=toys.lm_samples(16),
        blocked_plugins=["console"],
    )
    resumed.train(resume_from_checkpoint=out / "checkpoint-2")
    assert resumed.state.global_step == 6
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("verbose", [False, True])
def test_save_pretrained_bar_only_when_verbose(tmp_path, capfd, monkeypatch, verbose):
    """transformers' "Writing model shards" bar is not printed at each save (on a pipe as on a
    terminal) unless the run is verbose; the library's own setting is put back after the save."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    monkeypatch.delenv("CORELOOPER_VERBOSE", raising=False)
    if verbose:
        monkeypatch.setenv("CORELOOPER_VERBOSE", "1")
    args = TrainArgs(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        save_steps=1,
        disable_tqdm=True,
    )
    Loop(_tiny_tied_llama(), args, train_dataset=toys.lm_samples(8), blocked_plugins=["console"]).train()
    printed = capfd.readouterr()
    assert ("Writing model shards" in printed.err + printed.out) is verbose
    assert hf_logging.is_progress_bar_enabled()


# -- strategies, rotation, best model -------------------------------------------------------------


class Scripted:
    """compute_metrics returning a scripted accuracy per evaluation."""

    def __init__(self, values):
        self.values = list(values)
        self.calls = 0

    def __call__(self, predictions, label_ids):
        self.calls += 1
        return {"accuracy": self.values[self.calls - 1]}


def test_rotation_keeps_best_and_latest_and_loads_best(tmp_path, caplog):
    out = tmp_path / "out"
    metrics = Scripted([0.5, 0.9, 0.4, 0.3, 0.2])  # best at step 4
    best_weights = {}

    class Grab:
        name = "grab"

        def on_save(self, state, checkpoint_dir):
            best_weights[checkpoint_dir.name] = load_file(checkpoint_dir / WEIGHTS)
            saved.append(checkpoint_dir)
            kept.append([p.name for p in list_checkpoints(out)])

    saved, kept = [], []
    loop = make_loop(
        out,
        eval_dataset=toys.Blobs(16, seed=1),
        compute_metrics=metrics,
        max_steps=10,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        plugins=[Grab()],
    )
    state = loop.train()
    assert metrics.calls == 5
    assert state.best_metric == 0.9 and state.best_global_step == 4
    assert state.best_model_checkpoint == str(out / "checkpoint-4")
    # during training the best and the newest were kept; at the end, with save_total_limit = 1,
    # only the best stays (HF 5.x _finalize_training)
    assert [c.name for c in saved] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
        "checkpoint-8",
        "checkpoint-10",
    ]
    assert kept[-1] == ["checkpoint-4", "checkpoint-10"]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-4"]
    final = load_file(out / WEIGHTS)  # the best model, loaded at the end, is the final one
    assert all(torch.equal(final[k], best_weights["checkpoint-4"][k]) for k in final)
    assert not all(torch.equal(final[k], best_weights["checkpoint-10"][k]) for k in final)
    # and the run says so, as HF's "Loading best model from ... (score: ...)"
    assert "the final model is the best checkpoint's, checkpoint-4 (accuracy = 0.9)" in caplog.text


def test_rotation_lower_is_better_keeps_latest_best(tmp_path):
    out = tmp_path / "out"
    loop = make_loop(
        out,
        eval_dataset=toys.Blobs(16, seed=1),
        max_steps=8,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=2,
        load_best_model_at_end=True,
    )  # eval_loss, lower
    state = loop.train()
    losses = {h["step"]: h["eval_loss"] for h in state.log_history if "eval_loss" in h}
    best_step = min(losses, key=losses.get)
    assert state.best_global_step == best_step and state.best_metric == losses[best_step]
    kept = {p.name for p in list_checkpoints(out)}
    assert f"checkpoint-{best_step}" in kept and "checkpoint-8" in kept and len(kept) <= 2


@pytest.mark.parametrize(
    "strategy, expected",
    [
        ("no", []),
        ("epoch", ["checkpoint-8", "checkpoint-16"]),  # 64 samples / 8 = 8 steps per epoch
        ("steps", ["checkpoint-5", "checkpoint-10", "checkpoint-15", "checkpoint-16"]),
    ],
)
def test_save_strategies(tmp_path, strategy, expected):
    out = tmp_path / "out"
    make_loop(out, save_strategy=strategy, save_steps=5, max_steps=16).train()
    assert [p.name for p in list_checkpoints(out)] == expected
    assert (out / WEIGHTS).exists()  # the final model, whatever the strategy


def test_save_strategy_best_saves_only_improvements(tmp_path):
    out = tmp_path / "out"
    metrics = Scripted([0.5, 0.4, 0.7, 0.6])
    make_loop(
        out,
        eval_dataset=toys.Blobs(16, seed=1),
        compute_metrics=metrics,
        max_steps=8,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="best",
        metric_for_best_model="accuracy",
    ).train()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-6"]


# -- crashes never cost the last checkpoint ---------------------------------------------------


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


class Boom(nn.Module):
    """Raises in forward at a given call."""

    def __init__(self, at: int):
        super().__init__()
        self.inner = toys.mlp()
        self.at, self.calls = at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("exploded in forward")
        return self.inner(x)


class BadData(toys.Blobs):
    def __getitem__(self, i):
        if getattr(self, "armed", False):
            raise OSError("disk went away")
        return super().__getitem__(i)


class BrokenPlugin:
    name = "broken"

    def __init__(self, hook_at=None, state_at=None):
        self.hook_at, self.state_at, self.step = hook_at, state_at, 0

    def corelooper_configure(self, plugins):
        plugins.register_for_checkpointing("broken", self)

    def on_step_end(self, state):
        self.step = state.global_step
        if state.global_step == self.hook_at:
            raise ValueError("plugin bug")

    def state_dict(self):
        if self.step == self.state_at:
            raise TypeError("cannot serialise")
        return {}

    def load_state_dict(self, d):
        pass


@pytest.mark.parametrize("where", ["model", "data", "plugin hook", "plugin state_dict"])
def test_crash_keeps_last_checkpoint_and_names_the_source(tmp_path, where):
    out = tmp_path / "out"
    torch.manual_seed(0)
    model, data, plugins = toys.mlp(), toys.Blobs(64), []
    if where == "model":
        model, error, match = Boom(at=3), TrainingError, "exploded in forward.*model or its loss"
    elif where == "data":
        error, match = DataError, "disk went away"
        data = BadData(64)
    elif where == "plugin hook":
        plugins, error, match = (
            [BrokenPlugin(hook_at=3)],
            PluginError,
            "'broken' raised in hook 'on_step_end'",
        )
    else:
        plugins, error, match = [BrokenPlugin(state_at=4)], PluginError, "'broken' failed in state_dict"

    class Arm:
        name = "arm"

        def on_save(self):
            data.armed = True  # the data breaks after the first checkpoint

    saved = {}

    class Keep:
        name = "keep"

        def on_save(self, checkpoint_dir):
            saved[checkpoint_dir.name] = _snapshot(checkpoint_dir)

    args = TrainArgs(
        output_dir=str(out), max_steps=6, save_steps=2, per_device_train_batch_size=8, learning_rate=1e-2
    )
    loop = Loop(
        model, args, train_dataset=data, plugins=[*plugins, Arm(), Keep()], blocked_plugins=["console"]
    )
    with pytest.raises(error, match=match):
        loop.train()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    assert _snapshot(out / "checkpoint-2") == saved["checkpoint-2"]  # byte for byte
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]
    # and it resumes
    torch.manual_seed(0)
    again = Loop(
        Boom(at=-1) if where == "model" else toys.mlp(),
        args,
        train_dataset=toys.Blobs(64),
        blocked_plugins=["console"],
    )
    assert again.train(resume_from_checkpoint="latest").global_step == 6


def test_rotation_after_a_resume_from_an_earlier_step_deletes_the_stale_future_first(tmp_path):
    """Resumed from checkpoint-4 (checkpoint-6 failed its checksum and was skipped), the run
    writes checkpoint-5: with save_total_limit = 2 the stale checkpoint-6 goes, not the good
    checkpoint-4 (the newest by number is not the newest of the run any more)."""
    from corelooper.checkpoints.run_dir import list_checkpoints, rotate_checkpoints

    for step in (2, 4, 6, 5):
        (tmp_path / f"checkpoint-{step}").mkdir()
    deleted = rotate_checkpoints(tmp_path, 2, keep=tmp_path / "checkpoint-5")
    assert sorted(p.name for p in deleted) == ["checkpoint-2", "checkpoint-6"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-5"]
    # without a resume the order is the steps': oldest first, the newest kept
    (tmp_path / "checkpoint-7").mkdir()
    assert [p.name for p in rotate_checkpoints(tmp_path, 2, keep=tmp_path / "checkpoint-7")] == [
        "checkpoint-4"
    ]
