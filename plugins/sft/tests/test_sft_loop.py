"""corelooper-sft inside a real Loop: model and data by path, packed == padded, extras in the batch."""

from __future__ import annotations

import json

import pytest
import torch
from sft_fixtures import CHATS, _datasets_cache, make_model_folder, model_dir  # noqa: F401 (fixtures)

from corelooper import Loop
from corelooper.config import Config
from corelooper.data.loader import count_loss_items
from corelooper.errors import ConfigError, DataError


def write_chats(path, n=24):
    rows = []
    for i in range(n):
        row = json.loads(json.dumps(CHATS[i % len(CHATS)]))
        row["messages"][-1]["content"] += f" ({i})" * (i % 4)  # uneven lengths
        row["difficulty_score"] = 0.5 + (i % 5) / 2
        rows.append(row)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def config(tmp_path, model_dir, sft=None, **train):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_chats(tmp_path / "chats.jsonl")
    return Config.from_dict(
        {
            "model": {"name_or_path": str(model_dir)},
            "data": {"train": str(data), "eval": str(data)},
            "train": {
                "output_dir": str(tmp_path / "run"),
                "max_steps": 2,
                "save_strategy": "no",
                "per_device_train_batch_size": 4,
                "per_device_eval_batch_size": 3,
                "learning_rate": 1e-2,
                **train,
            },
            "sft": {"assistant_only_loss": True, "max_length": 64, **(sft or {})},
        }
    )


LAYOUTS = {
    "padded": {"padding_free": False},
    "padding_free": {"padding_free": True},
    "bfd": {"packing": True},
    "bfd_split": {"packing": True, "packing_strategy": "bfd_split"},
}
# "wrapped" cuts samples at row ends (each piece loses the context before the cut): another loss by design.


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def any_attn_model(request, tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp(request.param), attn=request.param)


def test_eval_loss_and_item_counts_are_the_same_packed_and_unpacked(tmp_path, any_attn_model):
    losses, items = {}, {}
    for name, sft in LAYOUTS.items():  # max_length above the longest sample: nothing truncated or split
        loop = Loop(config=config(tmp_path / name, any_attn_model, {**sft, "max_length": 256}))
        assert loop.eval_dataset.stats.overlong == 0
        loader = loop.hook.eval_dataloader(loop=loop, dataset=loop.eval_dataset)
        items[name] = sum(int(count_loss_items(b, "causal_lm")) for b in loader)
        losses[name] = loop.evaluate()["eval_loss"]
    assert len(set(items.values())) == 1, items  # num_items_in_batch counts the same tokens
    for name, loss in losses.items():
        assert abs(loss - losses["padded"]) <= 1e-5, (name, losses)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_unset_picks_the_faster_exact_layout_and_trains_as_padded(
    tmp_path, model_dir, attn, caplog
):
    """``sft.padding_free`` unset ("auto"): on the CPU an sdpa model gets padding-free batches with
    segment-wise attention (half the time of padded ones: benchmarks/README.md), an eager one keeps
    padded batches; either way the run's weights equal the explicitly padded run's (exact)."""
    import logging

    weights = {}
    for name, sft in (("auto", {}), ("padded", {"padding_free": False})):
        cfg = config(
            tmp_path / name,
            model_dir,
            {**sft, "max_length": 256},
            max_steps=2,
            optim="sgd",
            max_grad_norm=0.0,
        ).replace("model", attn_implementation=attn)
        with caplog.at_level(logging.INFO, logger="corelooper.sft"):
            loop = Loop(config=cfg)
        batch = loop.data_collator(loop.train_dataset.__getitems__([0, 1, 2]))
        if name == "auto":
            free = attn == "sdpa"
            assert ("attention_mask" not in batch and batch["input_ids"].shape[0] == 1) is free
            assert loop.model.config._attn_implementation == ("corelooper_segment_sdpa" if free else "eager")
            assert ("padding-free batches, the same samples per step" in caplog.text) is free
        loop.train()
        weights[name] = torch.cat([p.detach().flatten() for p in loop.model.parameters()])
    assert (weights["auto"] - weights["padded"]).abs().max().item() <= 1e-5


def test_padding_free_must_be_a_bool_or_auto(tmp_path, model_dir):
    with pytest.raises(ConfigError, match=r"sft.padding_free must be true, false or \"auto\""):
        Loop(config=config(tmp_path, model_dir, {"padding_free": "yes"}))
    with pytest.raises(ConfigError, match="Set sft.packing or sft.padding_free, not both"):
        Loop(config=config(tmp_path / "b", model_dir, {"padding_free": True, "packing": True}))
    Loop(config=config(tmp_path / "c", model_dir, {"padding_free": "auto", "packing": True}))  # auto: packed


def test_packing_really_packs_and_trains(tmp_path, model_dir):
    loop = Loop(
        config=config(tmp_path, model_dir, {"packing": True, "max_length": 256}, max_steps=3, logging_steps=1)
    )
    assert len(loop.train_dataset) < 24 and loop.model.config.use_cache is False
    batch = loop.data_collator(loop.train_dataset.__getitems__([0, 1]))
    # sdpa became segment-wise sdpa: one unpadded row, the samples' bounds in cu_seq_lens, no T x T mask
    assert loop.model.config._attn_implementation == "corelooper_segment_sdpa"
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    assert batch["cu_seq_lens_q"][-1] == batch["input_ids"].shape[1] == batch["position_ids"].shape[1]
    loop.train()
    losses = [h["loss"] for h in loop.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_segment_attention_unset_is_the_cpus_only(tmp_path, model_dir):
    """Unset ("auto"): segment-wise sdpa on the CPU; a GPU keeps the 4-D block mask (measured 26x
    faster on an H200 without flash attention). Decided per device type: no CUDA here to run it."""
    from corelooper_sft.setup import segments_for

    assert segments_for({"segment_attention": None}, "cpu") is True
    assert segments_for({"segment_attention": "auto"}, "cuda") is False
    assert segments_for({"segment_attention": True}, "cuda") is True
    assert segments_for({"segment_attention": False}, "cpu") is False
    with pytest.raises(ConfigError, match=r"sft.segment_attention must be true, false or \"auto\""):
        Loop(config=config(tmp_path, model_dir, {"packing": True, "segment_attention": "yes"}))


def test_without_segment_attention_sdpa_gets_a_boolean_block_mask(tmp_path, model_dir):
    loop = Loop(
        config=config(tmp_path, model_dir, {"packing": True, "max_length": 256, "segment_attention": False})
    )
    assert loop.model.config._attn_implementation == "sdpa"
    batch = loop.data_collator(loop.train_dataset.__getitems__([0, 1]))
    assert batch["attention_mask"].dim() == 4 and batch["attention_mask"].dtype == torch.bool
    assert batch["position_ids"].shape == batch["input_ids"].shape


class WeightedLoss:
    """The user's only code in the example: difficulty-weighted token loss."""

    def __init__(self):
        self.seen = []

    def compute_loss(self, model, batch, num_items_in_batch, return_outputs):
        weight = batch["difficulty_score"]  # weighted in evaluation too: padded == packed is checked on it
        self.seen.append(tuple(weight.shape))
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "difficulty_score")}
        outputs = model(**inputs)
        logits, labels = outputs.logits[:, :-1], batch["labels"][:, 1:]
        per_token = torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none"
        )
        w = weight[:, None] if weight.dim() == 1 else weight[:, 1:]
        loss = (per_token * w).sum() / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


@pytest.mark.parametrize("layout", ["padded", "bfd"])
def test_extra_columns_reach_compute_loss_in_training_and_eval(tmp_path, model_dir, layout):
    plugin = WeightedLoss()
    loop = Loop(config=config(tmp_path, model_dir, LAYOUTS[layout]), plugins=[plugin])
    loop.train()
    in_training = len(plugin.seen)  # the user's loss, not corelooper-lm's default head over trained positions
    metrics = loop.evaluate()
    assert in_training > 0 and len(plugin.seen) > in_training
    assert all(len(s) == (1 if layout == "padded" else 2) for s in plugin.seen)
    assert metrics["eval_loss"] > 0


def test_weighted_loss_is_the_same_packed_and_padded(tmp_path, model_dir):
    out = {}
    for layout in ("padded", "bfd"):
        loop = Loop(config=config(tmp_path / layout, model_dir, LAYOUTS[layout]), plugins=[WeightedLoss()])
        out[layout] = loop.evaluate()["eval_loss"]
    assert abs(out["padded"] - out["bfd"]) <= 1e-5, out


def test_datasets_dataset_passed_in_python_works_as_is(tmp_path, model_dir):
    from datasets import Dataset

    ds = Dataset.from_list([json.loads(json.dumps(r)) for r in CHATS * 4])
    cfg = config(tmp_path, model_dir).replace("data", train=None, eval=None)
    loop = Loop(config=cfg, train_dataset=ds, eval_dataset=ds)
    assert loop.evaluate()["eval_loss"] > 0


def test_malformed_jsonl_names_file_and_line(tmp_path, model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CHATS[0]) + "\n" + '{"messages": [}\n', encoding="utf-8")
    cfg = config(tmp_path, model_dir).replace("data", train=str(bad), eval=None)
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: not valid JSON"):
        Loop(config=cfg)


@pytest.mark.parametrize("layout", ["padded", "bfd", "padding_free"])
def test_weighted_loss_is_exact_under_gradient_accumulation(tmp_path, model_dir, layout):
    params = {}
    for bs, ga in ((4, 1), (2, 2), (1, 4)):
        cfg = config(
            tmp_path / f"{bs}x{ga}",
            model_dir,
            {**LAYOUTS[layout], "max_length": 256},
            max_steps=1,
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga,
            optim="sgd",
            max_grad_norm=0.0,
            learning_rate=1.0,
        )
        loop = Loop(config=cfg, plugins=[WeightedLoss()])
        loop.train()
        params[(bs, ga)] = torch.cat([p.detach().flatten() for p in loop.model.parameters()])
    start = torch.cat([p.detach().flatten() for p in Loop(config=cfg).model.parameters()])
    step = params[(4, 1)] - start
    assert step.abs().max() > 1e-3  # the step moved the weights
    for key, value in params.items():
        assert (value - start - step).abs().max().item() <= 1e-5 * step.abs().max().item() + 1e-6, key


@pytest.mark.slow
def test_packed_run_resumes_exactly(tmp_path, model_dir):
    from safetensors.torch import load_file

    def run(out, resume=None):
        cfg = config(
            tmp_path / out,
            model_dir,
            {"packing": True, "max_length": 128},
            max_steps=4,
            per_device_train_batch_size=2,
            save_strategy="steps",
            save_steps=2,
            save_total_limit=3,
        )
        Loop(config=cfg, plugins=[WeightedLoss()]).train(resume_from_checkpoint=resume)
        return tmp_path / out / "run"

    straight = run("straight")  # its checkpoint-2 is where the second run resumes, in a fresh folder
    run("again", resume=str(straight / "checkpoint-2"))
    a, b = (
        load_file(str(straight / "model.safetensors")),
        load_file(str(tmp_path / "again" / "run" / "model.safetensors")),
    )
    mid = load_file(str(straight / "checkpoint-2" / "model.safetensors"))
    assert max((a[k] - mid[k]).abs().max().item() for k in a) > 1e-4  # steps 3-4 changed the weights
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
