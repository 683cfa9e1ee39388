"""The Trainer-subclass recipes as hook implementations: weighted causal-LM loss, DPO, GRPO-style loader."""

from __future__ import annotations

import math

import pytest
import torch

from corelooper import Loop
from corelooper.config import Config

pytest.importorskip("transformers")  # in the test extra

from examples.causal_lm.model import build  # noqa: E402

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def tiny(vocab=96, seed=0):
    torch.manual_seed(seed)
    return build(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )


def _perturb(model, seed=1, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


# -- weighted causal-LM loss ---------------------------------------------------------------------------


def test_weighted_loss_matches_hand_computation_and_reduces_to_the_model_loss(tmp_path):
    from examples.causal_lm import weighted_loss

    model = tiny()
    loop = Loop(model, {"train": {"output_dir": str(tmp_path)}}, plugins=[weighted_loss])
    loop.prepare_for_evaluation()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 96, (3, 10), generator=g)
    labels = ids.clone()
    labels[1, 7:] = -100
    weights = torch.tensor([0.5, 1.0, 2.0])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
        "difficulty_score": weights,
    }
    n = (labels[:, 1:] != -100).sum()
    model.train()
    loss = loop.hook.compute_loss(
        loop=loop, model=model, batch=batch, num_items_in_batch=n, return_outputs=False
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    total = 0.0
    for i in range(3):
        for t in range(9):
            if labels[i, t + 1] != -100:
                total += weights[i].item() * -torch.log_softmax(logits[i, t], -1)[labels[i, t + 1]].item()
    assert loss.item() == pytest.approx(total / n.item(), rel=1e-5)
    # Weights 1 = the model's own token-normalised causal-LM loss.
    ones = {**batch, "difficulty_score": torch.ones(3)}
    loss1 = loop.hook.compute_loss(
        loop=loop, model=model, batch=ones, num_items_in_batch=n, return_outputs=False
    )
    own = model(input_ids=ids, labels=labels).loss
    assert loss1.item() == pytest.approx(own.item(), rel=1e-5)
    # Evaluation reports the unweighted loss.
    model.eval()
    eval_loss = loop.hook.compute_loss(
        loop=loop, model=model, batch=batch, num_items_in_batch=n, return_outputs=False
    )
    assert eval_loss.item() == pytest.approx(own.item(), rel=1e-5)


def test_weighted_loss_example_trains_with_perplexity(tmp_path):
    cfg = Config.load(
        ROOT / "examples/causal_lm/config.toml",
        [
            f"train.output_dir={tmp_path}",
            "train.max_steps=10",
            "train.logging_steps=5",
            "train.eval_steps=10",
            "train.save_strategy=no",
            "train.per_device_train_batch_size=8",
            "model.args.vocab_size=512",
            "data.args.vocab_size=512",
            "data.args.seq_len=64",
            "model.args.hidden_size=32",
            'plugins.local=["examples.causal_lm.plugin", "examples.causal_lm.weighted_loss"]',
        ],
    )
    loop = Loop(config=cfg)
    assert loop.plugins.provider_order("compute_loss")[0] == "examples.causal_lm.weighted_loss"
    loop.train()
    logs = [h for h in loop.state.log_history if "loss" in h]
    assert logs[-1]["loss"] < logs[0]["loss"]
    ev = [h for h in loop.state.log_history if "eval_loss" in h][-1]
    assert ev["eval_perplexity"] == pytest.approx(math.exp(ev["eval_loss"]), rel=1e-3)


# -- DPO ----------------------------------------------------------------------------------------------


def dpo_loop(tmp_path, beta=0.1, **train):
    from examples.dpo import plugin

    cfg = {"train": {"output_dir": str(tmp_path), "save_strategy": "no", **train}, "dpo": {"beta": beta}}
    return Loop(tiny(), cfg, plugins=[plugin])


def test_dpo_loss_equals_hand_computation_on_a_fixed_batch(tmp_path):
    from examples.dpo.data import DPOCollator

    loop = dpo_loop(tmp_path, beta=0.3)
    _perturb(loop.model)  # the reference stays the initial copy
    loop.prepare_for_evaluation()
    pairs = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 10, 0], "rejected_ids": [11, 12]},
        {"prompt_ids": [20, 21], "chosen_ids": [22], "rejected_ids": [23, 24, 25, 26, 0]},
    ]
    batch = DPOCollator(pad_token_id=1)(pairs)
    loss = loop.hook.compute_loss(
        loop=loop, model=loop.model, batch=batch, num_items_in_batch=None, return_outputs=False
    )

    def logp(model, prompt, completion):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        return sum(lp[len(prompt) + j - 1, tok].item() for j, tok in enumerate(completion))

    ref = loop.plugins.get("dpo.run").reference
    terms = []
    for p in pairs:
        margin = 0.3 * (
            (logp(loop.model, p["prompt_ids"], p["chosen_ids"]) - logp(ref, p["prompt_ids"], p["chosen_ids"]))
            - (
                logp(loop.model, p["prompt_ids"], p["rejected_ids"])
                - logp(ref, p["prompt_ids"], p["rejected_ids"])
            )
        )
        terms.append(-math.log(1 / (1 + math.exp(-margin))))
    assert loss.item() == pytest.approx(sum(terms) / 2, rel=1e-4)
    assert abs(loss.item() - math.log(2)) > 1e-3  # the perturbed policy is not the reference


def test_dpo_example_trains_logs_reward_margins_and_keeps_the_reference_frozen(tmp_path):
    cfg = Config.load(
        ROOT / "examples/dpo/config.toml",
        [
            f"train.output_dir={tmp_path}",
            "train.max_steps=6",
            "train.logging_steps=3",
            "train.eval_steps=6",
            "model.args.hidden_size=32",
            "data.args.max_pairs=200",
            "train.per_device_train_batch_size=8",
            "train.learning_rate=3e-3",
            "train.logging_first_step=true",
        ],
    )
    loop = Loop(config=cfg)
    ref_before = {k: v.clone() for k, v in loop.plugins.get("dpo.run").reference.state_dict().items()}
    loop.train()
    logs = [h for h in loop.state.log_history if "loss" in h and "rewards/margins" in h]
    assert [h["step"] for h in logs] == [1, 3, 6]
    for h in logs:
        assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies"} <= set(h)
        assert h["rewards/margins"] == pytest.approx(h["rewards/chosen"] - h["rewards/rejected"], abs=2e-6)
    assert loop.state.log_history[0]["loss"] != 0
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # step 1: policy == reference
    assert logs[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert logs[-1]["loss"] < math.log(2)  # the policy learned to prefer the true continuations
    assert all(
        torch.equal(v, ref_before[k]) for k, v in loop.plugins.get("dpo.run").reference.state_dict().items()
    )
    ev = [h for h in loop.state.log_history if "eval_loss" in h][-1]
    assert "eval_perplexity" not in ev  # exp(DPO loss) is not a perplexity


# -- GRPO-style dataloader -----------------------------------------------------------------------------


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n, self.fetches = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i

    def __getitems__(self, idx):
        self.fetches += 1
        return list(idx)


def test_generation_loader_fetches_once_per_generation_and_resumes_exactly():
    from corelooper.data.loader import BatchLoader
    from examples.grpo_style_dataloader.loader import GenerationBatchLoader

    def generate(samples):  # deterministic: rows derived from the sample ids
        x = torch.tensor(samples).repeat_interleave(2)  # 2 "generations" per prompt
        return {"input_ids": torch.stack([x, x * 10], 1), "advantages": x.float()}

    ds = CountingDataset(48)
    loader = GenerationBatchLoader(BatchLoader(ds, 8, collate_fn=list, seed=1, drop_last=True), 4, generate)
    loader.set_epoch(1)
    batches = list(loader)
    assert len(batches) == len(loader) == 24
    assert ds.fetches == 6 and loader.generations == 6  # one load + one generate per 4 steps
    assert all(b["input_ids"].shape == (4, 2) for b in batches)
    seen = torch.cat([b["input_ids"][:, 0] for b in batches]).tolist()
    assert sorted(seen[::2]) == list(range(48))  # every prompt once per epoch

    for n in (0, 5, 8, 23):
        again = GenerationBatchLoader(
            BatchLoader(CountingDataset(48), 8, collate_fn=list, seed=1, drop_last=True), 4, generate
        )
        again.set_epoch(1)
        again.skip(n)
        rest = list(again)
        assert len(rest) == 24 - n
        assert all(
            torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches[n:], rest, strict=True)
        )


def test_grpo_style_example_generates_once_per_steps_per_generation(tmp_path):
    cfg = Config.load(
        ROOT / "examples/grpo_style_dataloader/config.toml",
        [
            f"train.output_dir={tmp_path}",
            "train.max_steps=4",
            "train.logging_steps=2",
            "model.args.hidden_size=32",
            "data.args.max_prompts=64",
            "grpo.max_new_tokens=6",
            "train.per_device_train_batch_size=4",
            "grpo.steps_per_generation=2",
            "grpo.num_generations=2",
        ],
    )
    loop = Loop(config=cfg)
    seen_batches = []
    orig = loop.training_step

    def spy(micro_batches):
        seen_batches.append(micro_batches[0])
        return orig(micro_batches)

    loop.training_step = spy
    loop.train()
    assert loop.state.global_step == 4
    assert all(b["input_ids"].shape[0] == 4 for b in seen_batches)
    assert {"advantages", "old_logps", "labels"} <= set(seen_batches[0])
    # Steps 1-2 share one generation batch, 3-4 the next: the same prompt length block.
    loader_generations = len({b["old_logps"].untyped_storage().data_ptr() for b in seen_batches})
    assert loader_generations == 2
    assert "reward" in [h for h in loop.state.log_history if "loss" in h][0]
