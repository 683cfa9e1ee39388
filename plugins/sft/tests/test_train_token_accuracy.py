"""``token_accuracy`` in the training logs (corelooper-lm, on in ``[sft]`` runs) and, with ``[lm]
entropy``, ``entropy``, against TRL's ``mean_token_accuracy`` and ``entropy``: the real SFTTrainer
on the same chats, the same weights, the same order."""

from __future__ import annotations

import json
import math

import pytest
from sft_fixtures import CHATS, _datasets_cache, model_dir  # noqa: F401 (fixtures)
from test_sft_loop import write_chats

from corelooper import Loop
from corelooper.config import Config

RUN = dict(
    per_device_train_batch_size=4,
    max_steps=4,
    learning_rate=1e-2,
    optim="adamw_torch",
    lr_scheduler_type="constant",
    logging_steps=1,
    seed=0,
    train_sampling_strategy="sequential",
)


def trl_logs(model_dir, tmp_path, data, **kw):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = [
        {"messages": json.loads(line)["messages"]} for line in data.read_text(encoding="utf-8").splitlines()
    ]
    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        bf16=False,
        max_length=None,
        use_cpu=True,
        activation_checkpointing=False,
        dataset_num_proc=None,
        assistant_only_loss=True,
        save_strategy="no",
        disable_tqdm=True,
        **{**RUN, **kw},
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def our_logs(model_dir, tmp_path, data, sft=None, lm=None, **kw):
    config = Config.from_dict(
        {
            "model": {"name_or_path": str(model_dir)},
            "data": {"train": str(data)},
            "train": {
                "output_dir": str(tmp_path / "run"),
                "save_strategy": "no",
                "use_cpu": True,
                **{**RUN, **kw},
            },
            "sft": {"assistant_only_loss": True, "max_length": 0, **(sft or {})},
            **({"lm": lm} if lm else {}),
        }
    )
    with Loop(config=config) as loop:
        loop.train()
        return [h for h in loop.state.log_history if "loss" in h]


@pytest.mark.parametrize(
    ("sft", "lm"),
    [
        ({"padding_free": False}, None),  # what an [sft] run does: the head over the trained positions
        ({}, None),  # padding-free rows (the CPU default for sdpa)
        ({"padding_free": False}, {"head": "all"}),  # the model's own loss and logits
        ({"padding_free": False}, {"loss": "chunked"}),  # the chunked cross-entropy counts its chunks
    ],
    ids=["trained-head", "padding-free", "head-all", "chunked"],
)
def test_token_accuracy_and_entropy_are_trls(model_dir, tmp_path, sft, lm):
    data = write_chats(tmp_path / "chats.jsonl", n=16)
    theirs = trl_logs(model_dir, tmp_path, data)
    mine = our_logs(model_dir, tmp_path, data, sft, {**(lm or {}), "entropy": True})
    assert [h["step"] for h in mine] == [h["step"] for h in theirs] == [1, 2, 3, 4]
    for h, c in zip(theirs, mine, strict=True):
        assert abs(c["loss"] - h["loss"]) <= 1e-5, (h, c)  # the same training
        assert c["token_accuracy"] == pytest.approx(h["mean_token_accuracy"], abs=1e-6), (h, c)
        assert c["entropy"] == pytest.approx(h["entropy"], abs=1e-5), (h, c)
    assert len({round(c["token_accuracy"], 6) for c in mine}) > 1  # it moves as the model learns
    assert len({round(c["entropy"], 4) for c in mine}) > 1


def test_entropy_is_asked_for_and_alone_without_accuracy(model_dir, tmp_path):
    """Off by default (it costs a log-softmax per micro-batch); ``entropy`` alone when the accuracy
    is off, in training and evaluation logs."""
    data = write_chats(tmp_path / "chats.jsonl", n=8)
    default = our_logs(model_dir, tmp_path / "default", data, {"padding_free": False}, max_steps=1)
    assert "entropy" not in default[0] and "token_accuracy" in default[0]
    config = Config.from_dict(
        {
            "model": {"name_or_path": str(model_dir)},
            "data": {"train": str(data), "eval": str(data)},
            "train": {
                "output_dir": str(tmp_path / "alone"),
                "save_strategy": "no",
                "use_cpu": True,
                **RUN,
                "max_steps": 1,
            },
            "sft": {"assistant_only_loss": True, "max_length": 0},
            "lm": {"token_accuracy": False, "entropy": True},
        }
    )
    with Loop(config=config) as loop:
        loop.train()
        metrics = loop.evaluate()
        log = [h for h in loop.state.log_history if "loss" in h][0]
    assert "entropy" in log and "token_accuracy" not in log, log
    assert 0 < metrics["eval_entropy"] <= math.log(loop.model.config.vocab_size), metrics
    assert "eval_token_accuracy" not in metrics, metrics


def test_eval_entropy_and_accuracy_are_trls(model_dir, tmp_path):
    """One evaluation batch (TRL averages per batch): ``eval_entropy`` and ``eval_token_accuracy``
    equal TRL's ``eval_entropy`` and ``eval_mean_token_accuracy`` for the same weights."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    data = write_chats(tmp_path / "chats.jsonl", n=8)
    rows = [
        {"messages": json.loads(line)["messages"]} for line in data.read_text(encoding="utf-8").splitlines()
    ]
    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        bf16=False,
        max_length=None,
        use_cpu=True,
        activation_checkpointing=False,
        assistant_only_loss=True,
        per_device_eval_batch_size=8,
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    theirs = trainer.evaluate()
    config = Config.from_dict(
        {
            "model": {"name_or_path": str(model_dir)},
            "data": {"train": str(data), "eval": str(data)},
            "train": {"output_dir": str(tmp_path / "run"), "use_cpu": True, "per_device_eval_batch_size": 8},
            "sft": {"assistant_only_loss": True, "max_length": 0},
            "lm": {"entropy": True},
        }
    )
    with Loop(config=config) as loop:
        mine = loop.evaluate()
    assert mine["eval_loss"] == pytest.approx(theirs["eval_loss"], abs=1e-5)
    assert mine["eval_token_accuracy"] == pytest.approx(theirs["eval_mean_token_accuracy"], abs=1e-6)
    assert mine["eval_entropy"] == pytest.approx(theirs["eval_entropy"], abs=1e-5)


def trained_tokens_per_step(model_dir, tmp_path, data, **kw) -> list[int]:
    """The tokens each of TRL's optimizer steps counts (its sequential batches' shifted labels)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = [
        {"messages": json.loads(line)["messages"]} for line in data.read_text(encoding="utf-8").splitlines()
    ]
    args = SFTConfig(
        output_dir=str(tmp_path / "count"),
        report_to=[],
        bf16=False,
        max_length=None,
        use_cpu=True,
        activation_checkpointing=False,
        assistant_only_loss=True,
        **{**RUN, **kw},
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    per_batch = [int((batch["labels"][:, 1:] != -100).sum()) for batch in trainer.get_train_dataloader()]
    ga = args.gradient_accumulation_steps
    return [sum(per_batch[i : i + ga]) for i in range(0, len(per_batch), ga)]


def test_a_window_of_steps_and_micro_batches_is_weighted_by_tokens(model_dir, tmp_path):
    """Two micro-batches per step and a log every two steps: one value over the window's trained
    tokens, over all of them (TRL would average its four per-micro-batch values instead)."""
    data = write_chats(tmp_path / "chats.jsonl", n=16)
    per_step = trl_logs(model_dir, tmp_path, data)  # batch 4: the steps below, one by one
    tokens = trained_tokens_per_step(model_dir, tmp_path, data)
    windows = our_logs(
        model_dir,
        tmp_path,
        data,
        {"padding_free": False},
        {"entropy": True},
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=2,
    )
    assert [h["step"] for h in windows] == [2, 4]
    for window, steps in zip(windows, ((0, 1), (2, 3)), strict=True):
        hits = sum(per_step[i]["mean_token_accuracy"] * tokens[i] for i in steps)
        assert window["token_accuracy"] == pytest.approx(hits / sum(tokens[i] for i in steps), abs=1e-6)
        entropy = sum(per_step[i]["entropy"] * tokens[i] for i in steps)
        assert window["entropy"] == pytest.approx(entropy / sum(tokens[i] for i in steps), abs=1e-5)
        assert abs(window["loss"] - sum(per_step[i]["loss"] for i in steps) / 2) <= 1e-5


@pytest.mark.slow
def test_a_resumed_window_counts_the_steps_before_the_checkpoint(model_dir, tmp_path):
    """The window's counts are checkpointed: a run resumed at step 2 logs at step 4 the accuracy
    of steps 1-4, as the uninterrupted run does (without them it would count steps 3-4 only)."""
    data = write_chats(tmp_path / "chats.jsonl", n=16)
    kw = dict(logging_steps=4, save_strategy="steps", save_steps=2)
    whole = our_logs(model_dir, tmp_path / "whole", data, {"padding_free": False}, {"entropy": True}, **kw)
    config = Config.from_dict(
        {
            "model": {"name_or_path": str(model_dir)},
            "data": {"train": str(data)},
            "train": {"output_dir": str(tmp_path / "whole" / "run"), "use_cpu": True, **{**RUN, **kw}},
            "sft": {"assistant_only_loss": True, "max_length": 0, "padding_free": False},
            "lm": {"entropy": True},
        }
    )
    with Loop(config=config) as loop:
        loop.train(resume_from_checkpoint=str(tmp_path / "whole" / "run" / "checkpoint-2"))
        resumed = [h for h in loop.state.log_history if "loss" in h and h["step"] == 4]
    part = our_logs(model_dir, tmp_path / "part", data, {"padding_free": False}, logging_steps=2)
    assert [h["step"] for h in whole] == [4]
    assert resumed[0]["token_accuracy"] == pytest.approx(whole[0]["token_accuracy"], abs=1e-9)
    assert resumed[0]["entropy"] == pytest.approx(whole[0]["entropy"], abs=1e-9)
    assert abs(resumed[0]["token_accuracy"] - part[1]["token_accuracy"]) > 1e-3  # steps 3-4 alone differ


def test_a_plugins_own_loss_is_counted_too(model_dir, tmp_path):
    """A per-sample weighted loss (the example's plugin) replaces corelooper-lm's: its outputs'
    logits are counted. With every weight 1 the run is the unweighted one, accuracy included."""
    data = write_chats(tmp_path / "chats.jsonl", n=16)
    rows = [
        json.loads(line) | {"difficulty_score": 1.0} for line in data.read_text(encoding="utf-8").splitlines()
    ]
    ones = tmp_path / "ones.jsonl"
    ones.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    plain = our_logs(model_dir, tmp_path / "plain", ones, {"padding_free": False})
    weighted = our_logs_with_plugin(model_dir, tmp_path / "weighted", ones)
    for p, w in zip(plain, weighted, strict=True):
        assert abs(p["loss"] - w["loss"]) <= 1e-5 and p["token_accuracy"] == pytest.approx(
            w["token_accuracy"], abs=1e-6
        )


def our_logs_with_plugin(model_dir, tmp_path, data):
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    config = Config.from_dict(
        {
            "model": {"name_or_path": str(model_dir)},
            "data": {"train": str(data)},
            "train": {"output_dir": str(tmp_path / "run"), "save_strategy": "no", "use_cpu": True, **RUN},
            "sft": {"assistant_only_loss": True, "max_length": 0, "padding_free": False},
            "plugins": {"local": [str(root / "examples" / "sft_chat" / "weighting.py")]},
        }
    )
    with Loop(config=config) as loop:
        order = loop.plugins.provider_order("compute_loss")
        assert any("weighting" in name for name in order), order  # the loss is the plugin's
        loop.train()
        return [h for h in loop.state.log_history if "loss" in h]


def test_a_run_stopped_by_an_evaluation_logs_its_last_window_with_accuracy(model_dir, tmp_path):
    """Early stopping ends training in on_evaluate, between two logs: the loop logs what is left of
    the window, and that log has its token_accuracy too (the counts are summed then)."""
    from corelooper import hookimpl

    class StopAtFirstEvaluation:
        @hookimpl
        def on_evaluate(self, control):
            control.should_training_stop = True

    data = write_chats(tmp_path / "chats.jsonl", n=16)
    config = Config.from_dict(
        {
            "model": {"name_or_path": str(model_dir)},
            "data": {"train": str(data), "eval": str(data)},
            "train": {
                "output_dir": str(tmp_path / "run"),
                "save_strategy": "no",
                "use_cpu": True,
                **{**RUN, "logging_steps": 2, "eval_strategy": "steps", "eval_steps": 3},
            },
            "sft": {"assistant_only_loss": True, "max_length": 0, "padding_free": False},
        }
    )
    with Loop(config=config, plugins=[StopAtFirstEvaluation()]) as loop:
        loop.train()
        logs = [h for h in loop.state.log_history if "loss" in h]
    per_step = our_logs(model_dir, tmp_path / "every", data, {"padding_free": False})
    assert [h["step"] for h in logs] == [2, 3]
    assert logs[1]["token_accuracy"] == pytest.approx(per_step[2]["token_accuracy"], abs=1e-9)  # step 3 alone


def test_an_evaluation_is_not_counted_even_with_the_model_in_train_mode(model_dir, tmp_path):
    """A DeepSpeed engine stays in train mode while it evaluates (under no_grad): the batches of a
    loss-only evaluation (no metric asks for outputs) must not reach the training window's counts."""
    data = write_chats(tmp_path / "chats.jsonl", n=8)
    for head in ("auto", "all"):  # the trained head's loss, and the model's own
        config = Config.from_dict(
            {
                "model": {"name_or_path": str(model_dir)},
                "data": {"train": str(data), "eval": str(data)},
                "train": {"output_dir": str(tmp_path / head), "use_cpu": True},
                "sft": {"assistant_only_loss": True, "max_length": 0},
                "lm": {"head": head},
            }
        )
        with Loop(config=config, blocked_plugins=["lm.token_accuracy"]) as loop:  # a loss-only evaluation
            loop.prepare_for_evaluation()
            model = loop.model
            model.train()
            model.eval = lambda: model  # noqa: B023 (it stays in train mode, as DeepSpeed's engine does)
            metrics = loop.evaluate()
            counter = loop.plugins.pm.get_plugin("lm.train_token_accuracy")
            assert "eval_loss" in metrics and "eval_token_accuracy" not in metrics, metrics
            assert counter.local is None, (head, counter.local)
