"""``[sft] weight_column``: the per-sample weighted loss with no Python, against a hand computation
and against the same loss written as a plugin (test_sft_loop.WeightedLoss, the example's code)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from corelooper_sft.weighting import weighted_token_loss
from sft_fixtures import _datasets_cache, model_dir  # noqa: F401 (fixtures)
from test_sft_loop import LAYOUTS, WeightedLoss, config, write_chats

from corelooper import Loop
from corelooper.errors import ConfigError, DataError


def test_the_loss_is_each_tokens_cross_entropy_times_its_samples_weight_over_the_step_items():
    """Two samples of 4 positions over a 3-token vocabulary, by hand: position t predicts label
    t + 1, -100 is not trained; the weighted sum is divided by the step's trained tokens (6 here:
    another micro-batch of the step holds 2 more), not by this batch's 4."""
    logits = torch.tensor(
        [
            [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]],
            [[0.5, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 0.0]],
        ]
    )
    labels = torch.tensor([[-100, 0, 2, 1], [-100, -100, 1, 0]])
    weight = torch.tensor([2.0, 0.5])

    def ce(row, pos, target):  # -log softmax(logits[row, pos])[target]
        z = logits[row, pos].tolist()
        return math.log(sum(math.exp(v) for v in z)) - z[target]

    # sample 0: positions 0, 1, 2 predict labels 0, 2, 1; sample 1: positions 1, 2 predict 1, 0
    by_hand = (2.0 * (ce(0, 0, 0) + ce(0, 1, 2) + ce(0, 2, 1)) + 0.5 * (ce(1, 1, 1) + ce(1, 2, 0))) / 6
    assert weighted_token_loss(logits, labels, weight, torch.tensor(6)).item() == pytest.approx(
        by_hand, rel=1e-6
    )
    per_token = torch.tensor(
        [[9.0, 2.0, 2.0, 2.0], [9.0, 9.0, 0.5, 0.5]]
    )  # packed: the label's token's weight
    assert weighted_token_loss(logits, labels, per_token, 6).item() == pytest.approx(by_hand, rel=1e-6)
    ones = weighted_token_loss(logits, labels, torch.ones(2), None)  # no step count: this batch's 5 tokens
    plain = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 3), labels[:, 1:].reshape(-1))
    assert ones.item() == pytest.approx(plain.item(), rel=1e-6)


def one_step(tmp_path, model_dir, layout, sft, plugins=(), bs=4, ga=1):
    cfg = config(
        tmp_path,
        model_dir,
        {**LAYOUTS[layout], "max_length": 256, **sft},
        max_steps=1,
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        optim="sgd",
        max_grad_norm=0.0,
        learning_rate=1.0,
        logging_steps=1,
    )
    with Loop(config=cfg, plugins=list(plugins)) as loop:
        start = torch.cat([p.detach().flatten() for p in loop.model.parameters()])
        order = loop.plugins.provider_order("compute_loss")
        loop.train()
        after = torch.cat([p.detach().flatten() for p in loop.model.parameters()])
        (log,) = [h for h in loop.state.log_history if "loss" in h]
    return start, after, log, order


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "bfd", "padding_free"])
def test_weight_column_trains_as_the_weighted_loss_plugin(tmp_path, model_dir, layout):
    """The column's loss is the plugin's, step and logged loss alike, in every layout and under
    gradient accumulation (2 x 2 == 4 x 1); the plain loss differs (the weights are not all 1)."""
    start, by_column, log, order = one_step(
        tmp_path / "column", model_dir, layout, {"weight_column": "difficulty_score"}, bs=2, ga=2
    )
    # corelooper-lm's loss gives way to it; its token-accuracy wrapper counts its logits
    assert order.index("sft.weighted_loss") < order.index("lm.run") < order.index("builtin"), order
    _, by_plugin, plugin_log, _ = one_step(tmp_path / "plugin", model_dir, layout, {}, [WeightedLoss()])
    _, plain, plain_log, _ = one_step(tmp_path / "plain", model_dir, layout, {})
    step = by_plugin - start
    assert step.abs().max() > 1e-3
    assert (by_column - by_plugin).abs().max().item() <= 1e-5 * step.abs().max().item() + 1e-6
    assert log["loss"] == pytest.approx(plugin_log["loss"], rel=1e-5)
    assert abs(log["loss"] - plain_log["loss"]) > 1e-2 and "token_accuracy" in log


def test_every_weight_one_is_the_plain_loss_and_evaluation_stays_plain(tmp_path, model_dir):
    data = write_chats(tmp_path / "chats.jsonl")
    rows = [json.loads(x) | {"w": 1} for x in data.read_text(encoding="utf-8").splitlines()]
    ones = tmp_path / "ones.jsonl"
    ones.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")

    def cfg(sft):
        made = config(tmp_path / str(len(sft)), model_dir, {"padding_free": False, **sft}, max_steps=1)
        return made.replace("data", train=str(ones), eval=str(ones))

    with Loop(config=cfg({"weight_column": "w"})) as loop:
        weighted_eval = loop.evaluate()["eval_loss"]
        loop.train()
        (weighted,) = [h["loss"] for h in loop.state.log_history if "loss" in h]
    with Loop(config=cfg({})) as loop:
        assert loop.evaluate()["eval_loss"] == pytest.approx(weighted_eval, rel=1e-6)
        loop.train()
        (plain,) = [h["loss"] for h in loop.state.log_history if "loss" in h]
    assert weighted == pytest.approx(plain, rel=1e-5)


def test_a_missing_or_bad_weight_column_is_named(tmp_path, model_dir):
    with pytest.raises(DataError, match=r"weight_column = 'difficulty', but the data has no numeric column"):
        Loop(config=config(tmp_path / "a", model_dir, {"weight_column": "difficulty"}))
    data = write_chats(tmp_path / "chats.jsonl")
    rows = [json.loads(x) for x in data.read_text(encoding="utf-8").splitlines()]
    rows[3]["difficulty_score"], rows[5]["difficulty_score"] = -1.0, None
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    cfg = config(tmp_path / "b", model_dir, {"weight_column": "difficulty_score"})
    with pytest.raises(
        DataError, match=r"1 sample\(s\) lack a value and 1 have a negative or non-finite one"
    ):
        Loop(config=cfg.replace("data", train=str(bad)))
    with pytest.raises(ConfigError, match=r"sft.weight_column = 3: name a numeric column"):
        Loop(config=config(tmp_path / "c", model_dir, {"weight_column": 3}))
    with pytest.raises(
        ConfigError, match=r"train.label_smoothing_factor = 0.1: the per-sample weighted loss"
    ):
        Loop(
            config=config(tmp_path / "d", model_dir, {"weight_column": "difficulty_score"}).replace(
                "train", label_smoothing_factor=0.1
            )
        )
