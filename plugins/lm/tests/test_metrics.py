"""TokenAccuracy, the streaming metric: HF's whole-set compute_metrics value, without the logits;
packed evaluation counts what unpacked evaluation counts."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from corelooper_lm.collators import PackedDataset
from corelooper_lm.metrics import TokenAccuracy

from corelooper import Loop, TrainArgs

transformers = pytest.importorskip("transformers")

COMMON = dict(disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, report_to="none")


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def sequences(n=13, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 64) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def padded(seqs, length=20):
    rows = []
    for s in seqs:
        k = len(s)
        rows.append(
            {
                "input_ids": torch.tensor(s + [0] * (length - k)),
                "attention_mask": torch.tensor([1] * k + [0] * (length - k)),
                "labels": torch.tensor([-100] * 2 + s[2:] + [-100] * (length - k)),
            }
        )
    return rows


def hf_token_accuracy(eval_pred):
    """What HF users write (non-batch mode: every logit of the set, as numpy)."""
    logits, labels = eval_pred
    preds, labels = logits.argmax(-1)[:, :-1], labels[:, 1:]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


def test_token_accuracy_is_hfs_whole_set_compute_metrics_value(tmp_path):
    model, data = llama(), padded(sequences())
    args = dict(per_device_eval_batch_size=4, **COMMON)
    hf = transformers.Trainer(
        model=copy.deepcopy(model),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **args),
        eval_dataset=data,
        compute_metrics=hf_token_accuracy,
    )
    loop = Loop(
        copy.deepcopy(model),
        TrainArgs(output_dir=str(tmp_path / "cl"), **args),
        eval_dataset=data,
        compute_metrics=TokenAccuracy(),
        blocked_plugins=["console"],
    )
    hf_acc, cl = hf.evaluate()["eval_accuracy"], loop.evaluate()
    assert 0 < cl["eval_accuracy"] == pytest.approx(hf_acc, abs=1e-12)
    assert loop.evaluate()["eval_accuracy"] == cl["eval_accuracy"]  # reset between evaluations


def test_packed_evaluation_gives_the_unpacked_accuracy_and_loss(tmp_path):
    model, seqs = llama(), sequences(17, seed=1)
    # unpacked: each sample alone, labels = its ids (what PackedDataset trains on)
    alone = [{"input_ids": torch.tensor(s), "labels": torch.tensor(s)} for s in seqs]
    packed = PackedDataset(seqs, seq_len=32, pad_token_id=0, strategy="bfd")
    assert len(packed) < len(seqs)  # really packed, several samples per row
    results = []
    for data, batch in ((alone, 1), (packed, 2)):
        loop = Loop(
            copy.deepcopy(model),
            TrainArgs(output_dir=str(tmp_path / str(batch)), per_device_eval_batch_size=batch, **COMMON),
            eval_dataset=data,
            compute_metrics=TokenAccuracy(),
            blocked_plugins=["console"],
        )
        results.append(loop.evaluate())
    unpacked, in_rows = results
    assert in_rows["eval_accuracy"] == unpacked["eval_accuracy"] > 0
    assert in_rows["eval_loss"] == pytest.approx(unpacked["eval_loss"], abs=1e-5)


def test_token_accuracy_state_is_summed_by_sync():
    a, b = TokenAccuracy(), TokenAccuracy()
    labels = torch.tensor([[5, 1, 2, 3]])
    a.update(torch.tensor([[1, 2, 0, 9]]), labels)  # ids: 2 of 3 shifted positions right
    b.update(torch.tensor([[1, 9, 9, 9]]), labels)  # 1 of 3
    total = a.state + b.state
    for m in (a, b):
        m.sync(lambda t: total.clone())
    assert a.compute() == b.compute() == {"accuracy": 0.5}


def test_the_token_accuracy_setting_reports_it_unless_the_run_has_its_own_metric(tmp_path):
    from corelooper import Config
    from corelooper.errors import ConfigError

    model, data = llama(), padded(sequences())

    def loop(name, lm, **kwargs):
        args = TrainArgs(output_dir=str(tmp_path / name), per_device_eval_batch_size=4, **COMMON)
        return Loop(
            copy.deepcopy(model),
            Config(train=args, sections={"lm": lm}),
            eval_dataset=data,
            blocked_plugins=["console"],
            **kwargs,
        )

    given = loop("given", {}, compute_metrics=TokenAccuracy()).evaluate()
    on = loop("on", {"token_accuracy": True, "head": "trained"}).evaluate()
    assert on["eval_token_accuracy"] == given["eval_accuracy"] > 0
    assert abs(on["eval_loss"] - given["eval_loss"]) <= 1e-6 + 1e-9
    own = loop(
        "own",
        {"token_accuracy": True},
        compute_metrics=lambda p, ids: hf_token_accuracy((p.numpy(), ids.numpy())),
    ).evaluate()
    assert "eval_token_accuracy" not in own and own["eval_accuracy"] == pytest.approx(given["eval_accuracy"])
    assert "eval_token_accuracy" not in loop("auto", {}).evaluate()  # "auto" outside [sft] runs: off
    with pytest.raises(ConfigError, match=r"lm.token_accuracy = 'yes': use true, false"):
        loop("bad", {"token_accuracy": "yes"})
