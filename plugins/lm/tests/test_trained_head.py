"""The head over trained positions only equals the model's own (full-head) loss, gradients too.

The oracle is the real HF model computing its own loss (``ForCausalLMLoss`` over every
position's logits), with ``num_items_in_batch`` over a whole GA step.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sft" / "tests"))
import toys  # noqa: E402
from corelooper_lm.trained_head import trained_positions_loss, why_not_exact

from corelooper.config import Config, TrainArgs
from corelooper.errors import ConfigError
from corelooper.hookspecs import hookimpl
from corelooper.loop import Loop


def prompt_masked(n=6, seed=0):
    """Right-padded rows whose first ~half of each sample is prompt (label -100), as chat SFT."""
    samples = toys.lm_samples(n, seed=seed, min_len=4)
    for s in samples:
        length = int(s["attention_mask"].sum())
        s["labels"][: length // 2] = -100
    return samples


def stack(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "attention_mask", "labels")}


def head_rows(model):
    """Records the number of positions the output layer computes logits for."""
    rows: list[int] = []
    if not hasattr(model, "get_output_embeddings"):  # not an HF model: nothing to record
        return rows
    model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: rows.append(out.shape[:-1].numel())
    )
    return rows


def ga_step(model, micro_batches, loss_fn):
    """Summed micro-batch losses of one GA step and the gradients of every parameter."""
    model.zero_grad()
    n = sum((b["labels"][:, 1:] != -100).sum() for b in micro_batches)
    total = sum(loss_fn(model, b, n) for b in micro_batches)
    total.backward()
    return total.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def own_loss(model, batch, n):
    return model(**batch, num_items_in_batch=n).loss


def assert_same_step(model, micro_batches, tol=1e-6):
    ref_loss, ref_grads = ga_step(copy.deepcopy(model), micro_batches, own_loss)
    probe = copy.deepcopy(model)
    rows = head_rows(probe)
    loss, grads = ga_step(probe, micro_batches, trained_positions_loss)
    assert abs(loss - ref_loss) <= tol
    assert ref_grads.keys() == grads.keys() and ref_grads
    assert max((ref_grads[k] - grads[k]).abs().max().item() for k in ref_grads) <= tol
    return rows


def test_llama_loss_and_gradients_equal_the_full_head_under_ga():
    model = toys.tiny_llama(seed=1)
    samples = prompt_masked(6)
    micro = [stack(samples[:2]), stack(samples[2:4]), stack(samples[4:])]  # GA: 3 micro-batches
    rows = assert_same_step(model, micro)
    trained = [int((b["labels"][:, 1:] != -100).sum()) for b in micro]
    assert rows == trained  # logits for the trained positions only
    assert sum(trained) < 0.6 * sum(b["input_ids"].numel() for b in micro)  # not the whole batch


def test_shift_labels_and_rows_with_nothing_to_train():
    model = toys.tiny_llama(seed=2)
    batch = stack(prompt_masked(4, seed=3))
    shift = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    shift[1] = -100  # a row without a trained token
    n = (shift != -100).sum()
    ref = model(**batch, shift_labels=shift, num_items_in_batch=n).loss
    got = trained_positions_loss(model, {**batch, "shift_labels": shift}, n)
    assert abs(got.item() - ref.item()) <= 1e-6
    nothing = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    zero = trained_positions_loss(model, nothing, torch.tensor(1))
    assert zero.item() == 0.0


def test_soft_capped_logits_and_lora_on_lm_head_stay_exact():
    # The gather happens before the output layer inside the model's forward: what the model does to
    # each position's logits afterwards (Gemma 2 soft-capping) or inside the layer (LoRA) still runs.
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=toys.VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            final_logit_softcapping=0.5,
            attn_implementation="eager",
        )
    )
    assert why_not_exact(gemma) is None
    samples = prompt_masked(4, seed=4)
    assert_same_step(gemma, [stack(samples[:2]), stack(samples[2:])])
    lora = get_peft_model(
        toys.tiny_llama(seed=5),
        LoraConfig(r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False),
    )
    rows = assert_same_step(lora, [stack(samples)])
    assert rows == [int((stack(samples)["labels"][:, 1:] != -100).sum())]


def test_what_is_not_exact_is_named():
    from transformers import MixtralConfig, MixtralForCausalLM

    moe = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=toys.VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_local_experts=2,
            output_router_logits=True,
        )
    )
    assert "router (MoE) loss" in why_not_exact(moe)
    assert "no output layer" in why_not_exact(toys.tiny_lm())
    llama = toys.tiny_llama()
    llama.loss_type = "ForMaskedLM"  # another HF loss: not the causal-LM cross-entropy
    assert "not ForCausalLMLoss" in why_not_exact(llama)


def _args(tmp_path, name, **overrides):
    base = dict(
        output_dir=str(tmp_path / name),
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        learning_rate=1e-2,
        max_steps=3,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
    )
    return TrainArgs(**{**base, **overrides})


def train(model, tmp_path, name, lm, batch=6, ga=1, **train_args):
    config = Config(
        train=_args(
            tmp_path, name, per_device_train_batch_size=batch, gradient_accumulation_steps=ga, **train_args
        ),
        sections={"lm": lm},
    )
    model = copy.deepcopy(model)
    rows = head_rows(model)
    loop = Loop(model, config, train_dataset=prompt_masked(18, seed=7), blocked_plugins=["console"])
    loop.train()
    losses = [h["loss"] for h in loop.state.log_history if "loss" in h]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, rows


@pytest.mark.parametrize("lm", [{"head": "trained"}, {"head": "trained", "loss": "chunked"}])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_in_a_loop_equals_the_full_head_with_ga(tmp_path, lm, smoothing):
    model = toys.tiny_llama(seed=6)
    ref_losses, ref_params, ref_rows = train(
        model, tmp_path, "all", {"head": "all"}, label_smoothing_factor=smoothing
    )
    losses, params, rows = train(
        model, tmp_path, "trained", lm, batch=3, ga=2, label_smoothing_factor=smoothing
    )
    assert len(losses) == len(ref_losses) == 3
    # logged losses are rounded to 6 decimals (corelooper/logwindow.py): one unit of rounding apart at most
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-6 + 1e-9
    assert max((ref_params[k] - params[k]).abs().max().item() for k in params) <= 1e-5
    assert (
        max((ref_params[k] - v).abs().max().item() for k, v in model.state_dict().items()) > 1e-3
    )  # it trained
    if "loss" not in lm:  # the head ran on the trained positions only (the chunked loss bypasses it)
        assert sum(rows) < 0.6 * sum(ref_rows)


def test_asked_for_where_not_exact_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"lm.head = 'trained' .*no output layer.*Use lm.head = 'all'"):
        train(toys.tiny_lm(), tmp_path, "tiny", {"head": "trained"})
    with pytest.raises(ConfigError, match=r"lm.head = 'sideways': use one of 'auto', 'trained', 'all'"):
        train(toys.tiny_llama(), tmp_path, "bad", {"head": "sideways"})


@pytest.mark.slow
def test_auto_leaves_a_compiled_sft_run_to_the_model_s_own_loss(tmp_path):
    """With ``train.torch_compile`` the trained rows' selection (``nonzero``) would split the
    compiled model into many graphs (12-20 for a 2-layer Llama, on CPU with the eager backend); "auto"
    keeps the model's own loss there, which compiles whole. Asked for, "trained" still runs."""
    from sft_fixtures import make_model_folder
    from test_sft_loop import write_chats
    from torch._dynamo.utils import counters

    model_dir, data = make_model_folder(tmp_path / "model"), write_chats(tmp_path / "chats.jsonl")
    graphs = {}
    for head in ("auto", "trained"):
        torch._dynamo.reset()
        counters.clear()
        loop = Loop(
            config=Config.from_dict(
                {
                    "model": {"name_or_path": str(model_dir)},
                    "data": {"train": str(data)},
                    "train": {
                        "output_dir": str(tmp_path / head),
                        "max_steps": 2,
                        "save_strategy": "no",
                        "per_device_train_batch_size": 6,
                        "disable_tqdm": True,
                        "torch_compile": True,
                        "torch_compile_backend": "eager",
                    },
                    "sft": {"assistant_only_loss": True, "max_length": 64, "padding_free": False},
                    "lm": {"head": head},
                }
            ),
            blocked_plugins=["console"],
        )
        assert loop.plugins.pm.get_plugin("lm.run").head == ("all" if head == "auto" else "trained")
        loop.train()
        graphs[head] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs["auto"] == 1 < graphs["trained"]  # 1 and 20 graphs in 4 steps when written


def test_auto_is_on_in_sft_runs_and_off_elsewhere(tmp_path):
    from sft_fixtures import make_model_folder
    from test_sft_loop import write_chats

    model_dir, data = make_model_folder(tmp_path / "model"), write_chats(tmp_path / "chats.jsonl")
    losses, tokens = {}, {}
    for head in ("auto", "all"):
        loop = Loop(
            config=Config.from_dict(
                {
                    "model": {"name_or_path": str(model_dir)},
                    "data": {"train": str(data)},
                    "train": {
                        "output_dir": str(tmp_path / head),
                        "max_steps": 2,
                        "save_strategy": "no",
                        "logging_steps": 1,
                        "per_device_train_batch_size": 6,
                        "learning_rate": 1e-2,
                        "disable_tqdm": True,
                    },
                    "sft": {"assistant_only_loss": True, "max_length": 64, "padding_free": True},
                    "lm": {"head": head},
                }
            ),
            blocked_plugins=["console"],
        )
        # registered either way in an [sft] run (it counts the training token_accuracy); "all": the model's loss
        assert loop.plugins.pm.get_plugin("lm.run").head == ("trained?" if head == "auto" else "all")
        rows = head_rows(loop.model)
        loop.train()
        losses[head] = [h["loss"] for h in loop.state.log_history if "loss" in h]
        tokens[head] = sum(rows)
    assert len(losses["auto"]) == 2
    assert (
        max(abs(a - b) for a, b in zip(losses["auto"], losses["all"], strict=True)) <= 1e-6 + 1e-9
    )  # rounded
    assert 0 < tokens["auto"] < tokens["all"] / 1.5  # the full head computed the prompt's logits too
    off = Loop(
        config=Config.from_dict(
            {  # head "all" and no token_accuracy: nothing left for it to do
                "model": {"name_or_path": str(model_dir)},
                "data": {"train": str(data)},
                "train": {"output_dir": str(tmp_path / "off"), "max_steps": 1},
                "sft": {"max_length": 64},
                "lm": {"head": "all", "token_accuracy": False},
            }
        ),
        blocked_plugins=["console"],
    )
    assert (
        off.plugins.pm.get_plugin("lm.run") is None
        and off.plugins.pm.get_plugin("lm.train_token_accuracy") is None
    )
    # outside SFT runs "auto" leaves the model's own loss alone: nothing registered
    loop = Loop(
        toys.tiny_llama(),
        Config(train=_args(tmp_path, "plain")),
        train_dataset=prompt_masked(6),
        blocked_plugins=["console"],
    )
    assert loop.plugins.pm.get_plugin("lm.run") is None


def test_asked_for_together_with_liger_fused_loss_is_refused(tmp_path):
    pytest.importorskip(
        "corelooper_liger", reason="corelooper-liger (plugins/liger) declares the [liger] section"
    )
    with pytest.raises(ConfigError, match=r"lm.head = 'trained' and Liger's fused linear cross-entropy"):
        train(toys.tiny_llama(), tmp_path, "liger", {"head": "trained"}, use_liger_kernel=True)


def evaluate(model, tmp_path, name, lm, **loop_kwargs):
    """``Loop.evaluate()`` of ``model`` on prompt-masked rows; the metrics and the head's row counts."""
    config = Config(train=_args(tmp_path, name, per_device_eval_batch_size=4), sections={"lm": lm})
    model = copy.deepcopy(model)
    rows = head_rows(model)
    loop = Loop(
        model, config, eval_dataset=prompt_masked(10, seed=3), blocked_plugins=["console"], **loop_kwargs
    )
    return loop.evaluate(), rows


def test_loss_only_evaluation_uses_the_trained_head_and_equals_the_full_head(tmp_path):
    model = toys.tiny_llama(seed=2)
    ref, ref_rows = evaluate(model, tmp_path, "all", {"head": "all"})
    got, rows = evaluate(model, tmp_path, "trained", {"head": "trained"})
    assert abs(got["eval_loss"] - ref["eval_loss"]) <= 1e-6 and ref["eval_loss"] > 1.0
    assert got["eval_perplexity"] == pytest.approx(ref["eval_perplexity"], rel=1e-5)
    assert len(rows) == len(ref_rows) == 3  # one forward per batch: no second forward for outputs
    assert sum(rows) < 0.6 * sum(ref_rows)  # no logits for the prompt or the padding


class _SeesOutputs:
    def __init__(self):
        self.shapes = []

    @hookimpl
    def on_prediction_step(self, outputs):
        self.shapes.append(tuple(outputs.logits.shape))


class _ReadsLogits:
    """A streaming metric without ``preprocess_logits``: it reads the logits themselves."""

    def reset(self):
        self.top = []

    def update(self, predictions, label_ids):
        self.top.append(predictions.max().item())

    def compute(self):
        return {"top": max(self.top)}


def test_evaluation_that_needs_the_logits_gets_every_position(tmp_path):
    model = toys.tiny_llama(seed=2)
    ref, ref_rows = evaluate(model, tmp_path, "all", {"head": "all"}, compute_metrics=_ReadsLogits())
    got, rows = evaluate(model, tmp_path, "trained", {"head": "trained"}, compute_metrics=_ReadsLogits())
    assert rows == ref_rows and got["eval_top"] == ref["eval_top"]  # every position's logits: the full head
    assert abs(got["eval_loss"] - ref["eval_loss"]) <= 1e-6 + 1e-9  # its loss from them, a slice at a time
    sees = _SeesOutputs()  # a plugin's on_prediction_step that takes the outputs gets them, whole
    got, rows = evaluate(model, tmp_path, "hooked", {"head": "trained"}, plugins=[sees])
    assert (
        rows == ref_rows
        and len(sees.shapes) == 3
        and all(s[-1] == model.config.vocab_size for s in sees.shapes)
    )
    assert abs(got["eval_loss"] - ref["eval_loss"]) <= 1e-6


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_loss_from_kept_logits_is_hfs_a_chunk_at_a_time(monkeypatch, smoothing):
    """An evaluation with a metric keeps every position's logits; its loss comes from them a
    slice of rows at a time (no second float32 array as large as the logits). The oracle:
    HF's ForCausalLMLoss on the same logits (and F.cross_entropy's label smoothing, HF's
    LabelSmoother on shifted labels)."""
    from corelooper_lm import trained_head
    from corelooper_lm.trained_head import causal_targets, loss_from_logits
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    logits, labels = torch.randn(3, 40, 500) * 3, torch.randint(0, 500, (3, 40))
    labels[:, :15] = -100
    widths: list[int] = []
    real_ce = torch.nn.functional.cross_entropy
    monkeypatch.setattr(
        torch.nn.functional,
        "cross_entropy",
        lambda x, *a, **k: widths.append(x.shape[0]) or real_ce(x, *a, **k),
    )
    monkeypatch.setattr(trained_head, "EVAL_CHUNK_BYTES", 4 * 500 * 100)  # 100 rows per slice
    got = loss_from_logits(logits, causal_targets({"labels": labels}), torch.tensor(70), smoothing)
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", real_ce)
    if smoothing:
        flat = causal_targets({"labels": labels}).reshape(-1)
        ref = real_ce(logits.reshape(-1, 500), flat, reduction="sum", label_smoothing=smoothing) / 70
    else:
        ref = ForCausalLMLoss(logits, labels, vocab_size=500, num_items_in_batch=torch.tensor(70))
    assert abs(got.item() - ref.item()) <= 1e-6 and ref.item() > 1.0
    assert widths == [100, 20]  # 120 positions, 100 at a time
