"""The chunked cross-entropy equals ``F.cross_entropy`` on the full logits, loss and gradients.

The oracle is torch's own ``F.cross_entropy`` over ``(hidden @ weight.T + bias).float()``, i.e. what
an HF causal LM's ``lm_head`` followed by its loss computes. Memory is measured in
``benchmarks/chunked_ce.py``, not here.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import toys  # noqa: E402
from corelooper_lm.chunked_ce import chunked_cross_entropy

from corelooper.config import Config
from corelooper.errors import ConfigError
from corelooper.loop import Loop


def _inputs(n=37, hidden=24, vocab=101, dtype=torch.float32, ignored=0.3, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignored] = -100
    return h, w, b, y


def _reference(h, w, b, y, smoothing=0.0):
    logits = h @ w.t() + (b if b is not None else 0)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits, y, ignore_index=-100, reduction="sum", label_smoothing=smoothing)


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])  # one token, uneven chunks, exact, one chunk
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_equals_full_logits_float32(chunk, smoothing):
    h, w, b, y = _inputs()
    n_items = (y != -100).sum()
    ref = _reference(h, w, b, y, smoothing) / n_items
    got = chunked_cross_entropy(h, w, y, bias=b, label_smoothing=smoothing, chunk_tokens=chunk) / n_items
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) < 1e-6
    for g_ref, g_got in zip(_grads(ref, h, w, b), _grads(got, h, w, b), strict=True):
        assert (g_ref - g_got).abs().max().item() < 1e-6


def test_equals_full_logits_float64_to_rounding():
    h, w, b, y = _inputs(dtype=torch.float64, seed=1)
    ref = _reference(h, w, b, y)
    got = chunked_cross_entropy(h, w, y, bias=b, chunk_tokens=5)
    assert abs(got.item() - ref.item()) < 1e-12
    for g_ref, g_got in zip(_grads(ref, h, w, b), _grads(got, h, w, b), strict=True):
        assert (g_ref - g_got).abs().max().item() < 1e-12


def test_bfloat16_model_follows_the_upcast_as_hf_does():
    # lm_head in bf16, then logits.float() (HF's ForCausalLMLoss): the same numbers, not better ones
    h, w, _, y = _inputs(dtype=torch.bfloat16, bias=False, seed=2)
    ref = _reference(h, w, None, y)
    got = chunked_cross_entropy(h, w, y, chunk_tokens=8)
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) < 1e-6 * ref.item()
    gh_ref, gw_ref = _grads(ref, h, w)
    gh, gw = _grads(got, h, w)
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert (gh.float() - gh_ref.float()).abs().max().item() < 1e-2  # bf16 rounding of the products
    # weight gradient: summed over chunks in float32, then rounded to bf16 once
    assert (gw.float() - gw_ref.float()).abs().max().item() < 5e-2


def test_ignored_tokens_and_empty_batch():
    h, w, b, y = _inputs(ignored=1.1)  # every label ignored
    loss = chunked_cross_entropy(h, w, y, bias=b, chunk_tokens=4)
    assert loss.item() == 0.0
    gh, gw, gb = _grads(loss, h, w, b)
    assert gh.abs().max() == gw.abs().max() == gb.abs().max() == 0


def test_no_bias_batched_shape_and_gradient_scale():
    h, w, _, y = _inputs(n=24, bias=False)
    h3, y3 = h.view(2, 12, -1), y.view(2, 12)
    ref = _reference(h, w, None, y) * 3.0  # an upstream factor (e.g. 1 / num_items_in_batch)
    got = chunked_cross_entropy(h3, w, y3, chunk_tokens=7) * 3.0
    assert abs(got.item() - ref.item()) < 1e-4
    for g_ref, g_got in zip(_grads(ref, h, w), _grads(got, h, w), strict=True):
        assert (g_ref - g_got).abs().max().item() < 1e-5


def test_bad_shapes_are_named():
    h, w, b, y = _inputs()
    with pytest.raises(ValueError, match=r"labels \(36,\) do not match hidden states \(37, 24\)"):
        chunked_cross_entropy(h, w, y[:-1])
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_cross_entropy(h, w, y, chunk_tokens=0)


def _train_llama(model, samples, train_args, batch, ga, loss_impl, steps=3):
    args = train_args(
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga,
        max_steps=steps,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        output_dir=train_args().output_dir + f"-{batch}x{ga}-{loss_impl}",
    )
    args = Config(train=args, sections={"lm": {"loss": loss_impl}})
    loop = Loop(copy.deepcopy(model), args, train_dataset=samples, blocked_plugins=["console"])
    loop.train()
    losses = [h["loss"] for h in loop.state.log_history if "loss" in h]
    params = {k: v.detach().clone() for k, v in loop.backend.unwrap_model(loop.model).state_dict().items()}
    return losses, params


def test_llama_chunked_equals_default_loss_and_stays_ga_exact(train_args, monkeypatch):
    # A real LlamaForCausalLM computes its own (HF) loss by default: that is the oracle here.
    import corelooper_lm.chunked_ce as chunked_ce

    calls = []
    real = chunked_ce.chunked_cross_entropy
    monkeypatch.setattr(
        chunked_ce, "chunked_cross_entropy", lambda h, *a, **k: calls.append(h.shape) or real(h, *a, **k)
    )
    samples = toys.lm_samples(24, seed=0)
    model = toys.tiny_llama(seed=0)
    hf_losses, hf_params = _train_llama(model, samples, train_args, 8, 1, "default")
    assert calls == []
    losses, params = _train_llama(model, samples, train_args, 8, 1, "chunked")
    ga_losses, ga_params = _train_llama(model, samples, train_args, 2, 4, "chunked")
    # the chunked loss computed every micro-batch (3 + 12), from [batch, seq, hidden] states
    assert len(calls) == 15 and calls[0] == (8, toys.SEQ_LEN, 16) and calls[-1] == (2, toys.SEQ_LEN, 16)
    assert len(hf_losses) == 3
    for other, other_params in ((losses, params), (ga_losses, ga_params)):
        assert max(abs(a - b) for a, b in zip(hf_losses, other, strict=True)) < 1e-6
        assert max((hf_params[k] - other_params[k]).abs().max().item() for k in hf_params) < 1e-5
    # the weights moved: the comparison is not between untouched models
    assert max((hf_params[k] - v).abs().max().item() for k, v in model.state_dict().items()) > 1e-3


def test_chunked_needs_an_hf_causal_lm(train_args):
    loop = Loop(
        toys.tiny_lm(),
        Config(train=train_args(max_steps=1), sections={"lm": {"loss": "chunked"}}),
        train_dataset=toys.lm_samples(4),
        blocked_plugins=["console"],
    )
    with pytest.raises(ConfigError, match=r"lm.loss = 'chunked' needs a Hugging Face causal LM.*TinyLM"):
        loop.train()


class _Run:
    """What ``chunked_causal_lm_loss`` reads of the loop: the resolved loss type."""

    loss_type = "causal_lm"


def test_label_smoothing_and_shift_labels_as_hf():
    from corelooper_lm.chunked_ce import chunked_causal_lm_loss

    model = toys.tiny_llama(seed=3)
    batch = {
        k: torch.stack([s[k] for s in toys.lm_samples(4, seed=1)])
        for k in ("input_ids", "attention_mask", "labels")
    }
    n = (batch["labels"][:, 1:] != -100).sum()
    # label smoothing: the default loss computes it from the logits with F.cross_entropy
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref = (
        F.cross_entropy(
            logits[:, :-1].reshape(-1, toys.VOCAB).float(),
            batch["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
            label_smoothing=0.1,
        )
        / n
    )
    got = chunked_causal_lm_loss(_Run(), model, batch, n, label_smoothing=0.1)
    assert abs(got.item() - ref.item()) < 1e-6
    # shift_labels (already shifted, e.g. by a padding-free collator): HF's own loss is the oracle
    shift = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    shift[:, :2] = -100
    hf = model(**batch, shift_labels=shift, num_items_in_batch=(shift != -100).sum()).loss
    got = chunked_causal_lm_loss(_Run(), model, {**batch, "shift_labels": shift}, (shift != -100).sum())
    assert abs(got.item() - hf.item()) < 1e-6


def test_models_whose_logits_are_not_a_plain_projection_are_refused():
    from corelooper_lm.chunked_ce import output_head
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
        )
    )
    assert gemma.config.final_logit_softcapping  # Gemma 2 soft-caps its logits
    with pytest.raises(
        ConfigError,
        match=r"Gemma2ForCausalLM's logits are not that \(its config sets final_logit_softcapping",
    ):
        output_head(gemma)
    llama = toys.tiny_llama()
    assert output_head(llama) is llama.lm_head
    llama.lm_head = torch.nn.Sequential(llama.lm_head)  # e.g. a wrapped head (LoRA on lm_head)
    with pytest.raises(ConfigError, match="its output layer is a Sequential"):
        output_head(llama)


def test_through_a_peft_model_equals_its_own_loss_and_gradients():
    from corelooper_lm.chunked_ce import chunked_causal_lm_loss
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        toys.tiny_llama(seed=4),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False),
    )
    batch = {
        k: torch.stack([s[k] for s in toys.lm_samples(4, seed=2)])
        for k in ("input_ids", "attention_mask", "labels")
    }
    n = (batch["labels"][:, 1:] != -100).sum()
    lora = [p for name, p in model.named_parameters() if "lora_" in name]
    ref = model(**batch, num_items_in_batch=n).loss
    ref_grads = torch.autograd.grad(ref, lora)
    got = chunked_causal_lm_loss(_Run(), model, batch, n)
    grads = torch.autograd.grad(got, lora)
    assert abs(got.item() - ref.item()) < 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(ref_grads, grads, strict=True)) < 1e-6
