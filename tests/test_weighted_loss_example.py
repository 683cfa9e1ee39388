"""examples/weighted_loss: per-sample loss weights as a compute_loss hook in a local plugin."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

from corelooper.config import Config
from corelooper.loop import Loop

CONFIG = REPO / "examples" / "weighted_loss" / "config.toml"


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    cfg = Config.load(CONFIG, [f"train.output_dir={tmp_path_factory.mktemp('wl')}"])
    return Loop(config=cfg, blocked_plugins=["console"])


def test_weighted_loss_equals_hand_computation_on_a_fixed_batch(loop):
    assert loop.plugins.provider_order("compute_loss")[0] == "examples.weighted_loss.plugin"
    ds = loop.train_dataset
    batch = (
        loop.data_collator([ds[i] for i in range(8)])
        if loop.data_collator
        else torch.utils.data.default_collate([ds[i] for i in range(8)])
    )
    assert batch["difficulty_score"].shape == (8,) and (batch["difficulty_score"] != 1).all()
    model = loop.model.eval()  # no dropout: the hand computation sees the same logits
    with torch.no_grad():
        logits = model(batch["pixel_values"])
        ce = F.cross_entropy(logits, batch["labels"], reduction="none")
        hand = sum(batch["difficulty_score"][i].item() * ce[i].item() for i in range(8)) / 8

        full = loop.hook.compute_loss(
            loop=loop, model=model, batch=batch, num_items_in_batch=torch.tensor(8), return_outputs=False
        )
        # two micro-batches of one step, normalised by the step's 8 items, add up to the same
        halves = [{k: v[s] for k, v in batch.items()} for s in (slice(0, 4), slice(4, 8))]
        parts = [
            loop.hook.compute_loss(
                loop=loop, model=model, batch=h, num_items_in_batch=torch.tensor(8), return_outputs=False
            )
            for h in halves
        ]
        unweighted = ce.mean().item()
    assert full.item() == pytest.approx(hand, rel=1e-6)
    assert sum(p.item() for p in parts) == pytest.approx(hand, rel=1e-6)
    assert abs(hand - unweighted) > 1e-3  # the weights matter


@pytest.mark.slow
def test_config_runs_through_the_cli_and_trains(cli, tmp_path):
    out = tmp_path / "run"
    r = cli(
        "run",
        str(CONFIG),
        "--set",
        f"train.output_dir={out}",
        "--set",
        "train.num_train_epochs=4",
        "-p",
        "no:tensorboard",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [rec for rec in records if rec["event"] == "eval"]
    losses = [rec["loss"] for rec in records if "loss" in rec]
    assert len(evals) == 4 and evals[-1]["eval_accuracy"] >= 0.9
    assert losses[-1] < losses[0] / 3
