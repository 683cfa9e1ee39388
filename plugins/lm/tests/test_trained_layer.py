"""The last decoder layer over the trained positions: the loss and every gradient equal the model's
own (``ForCausalLMLoss`` over every position, computed by the real HF model), for each model
family and batch layout it trims; where it would not be exact it runs the whole layer.

The oracle is ``model(**batch, num_items_in_batch=n).loss`` of the unmodified ``transformers``
model on the same batch; tolerances as ``test_trained_head.py`` (1e-6, float32).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from corelooper_lm.packing import Segment, SegmentCollator
from corelooper_lm.segment_attention import SEGMENT_SDPA, use_segment_attention
from corelooper_lm.trained_head import trained_positions_loss
from corelooper_lm.trained_layer import STATE, last_decoder_layer, why_not_trimmable
from test_segment_attention import padded  # the segments as a padded batch (right or left)
from test_trained_head import ga_step, own_loss  # one GA step's loss and gradients; the model's own loss

transformers = pytest.importorskip("transformers")
VOCAB = 96
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    use_cache=False,
)


def make(family="llama", kv_heads=4, attn="sdpa", seed=0, **extra):
    torch.manual_seed(seed)
    if family == "qwen3":  # per-head q/k norms before the rotary embedding
        config = transformers.Qwen3Config(**SIZES, num_key_value_heads=kv_heads, head_dim=8, **extra)
    elif family == "qwen2":  # biased q/k/v projections
        config = transformers.Qwen2Config(**SIZES, num_key_value_heads=kv_heads, **extra)
    elif family == "mistral":  # without a sliding window (with one: not trimmed, below)
        config = transformers.MistralConfig(
            **SIZES, num_key_value_heads=kv_heads, sliding_window=None, **extra
        )
    else:
        config = transformers.LlamaConfig(**SIZES, num_key_value_heads=kv_heads, **extra)
    config._attn_implementation = attn
    name = {"qwen3": "Qwen3", "qwen2": "Qwen2", "mistral": "Mistral"}.get(family, "Llama")
    return getattr(transformers, name + "ForCausalLM")(config)


def segments(n=6, seed=0, turns=1):
    """Chat-like samples: prompt tokens (-100) then completion, ``turns`` times (multi-turn: the
    trained positions of a sample are not one block)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids, labels = [], []
        for _turn in range(turns):
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 8))]
            answer = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 8))]
            ids += prompt + answer
            labels += [-100] * len(prompt) + answer
        out.append(Segment(ids, labels, {}))
    return out


def layout(model, name, segs):
    """The micro-batches of one GA step in layout ``name`` (the model switched as that layout needs)."""
    halves = [segs[: len(segs) // 2], segs[len(segs) // 2 :]]
    if name in ("segments", "positions_only"):
        use_segment_attention(model)
        batches = [SegmentCollator(0, SEGMENT_SDPA)([h]) for h in halves]
        if name == "positions_only":  # the segments read from position_ids (they restart at 0)
            batches = [
                {k: v for k, v in b.items() if not k.startswith(("cu_seq", "max_length"))} for b in batches
            ]
        return batches
    if name == "block_mask":  # several packed rows, plain sdpa with a 4-D boolean block mask
        return [SegmentCollator(0, "sdpa")([h[:2], h[2:]]) for h in halves]
    if name == "full_rows":  # equal lengths, no padding, no mask: the layer's own causal path
        return [
            {
                k: v
                for k, v in padded(
                    [Segment(s.input_ids[:4], s.labels[:3] + [s.input_ids[3]], {}) for s in h]
                ).items()
                if k != "attention_mask"
            }
            for h in halves
        ]
    return [padded(h, left=name == "left_padded") for h in halves]


def layer_rows(model):
    """The number of positions the last decoder layer returned, per forward."""
    rows: list[int] = []
    last_decoder_layer(model).register_forward_hook(lambda _m, _a, out: rows.append(out.shape[:-1].numel()))
    return rows


def compare(model, name, segs, seed=0, tol=1e-6):
    """Both losses from the same state and random seed; returns the trimmed run's layer rows."""
    reference, probe = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(seed)
    ref_loss, ref_grads = ga_step(reference, layout(reference, name, segs), own_loss)
    rows = layer_rows(probe)
    batches = layout(probe, name, segs)
    torch.manual_seed(seed)
    loss, grads = ga_step(probe, batches, trained_positions_loss)
    assert abs(loss - ref_loss) <= tol and ref_loss > 1.0
    assert ref_grads.keys() == grads.keys() and len(grads) == sum(p.requires_grad for p in model.parameters())
    assert max((ref_grads[k] - grads[k]).abs().max().item() for k in ref_grads) <= tol
    trained = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    return rows, trained, [b["input_ids"].numel() for b in batches]


LAYOUTS = ["right_padded", "left_padded", "full_rows", "segments", "positions_only", "block_mask"]


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize(
    "family,kv_heads", [("llama", 4), ("llama", 2), ("qwen3", 2), ("qwen2", 4), ("mistral", 2)]
)
def test_trimmed_layer_equals_the_models_own_loss_and_gradients(family, kv_heads, name):
    model = make(family, kv_heads)
    assert why_not_trimmable(model) is None
    rows, trained, _ = compare(model, name, segments(6, seed=kv_heads, turns=2))
    assert rows == trained  # the last layer returned the trained positions only, in every micro-batch


def test_a_sample_whose_last_position_alone_trains_and_one_that_trains_nothing():
    segs = [
        Segment([5, 6, 7, 8], [-100, -100, -100, 8], {}),
        Segment([9, 10, 11], [-100, -100, -100], {}),
        Segment([12, 13], [12, 13], {}),
        Segment([14, 15, 16], [-100, 15, -100], {}),
    ]
    rows, trained, _ = compare(make(), "segments", segs)
    assert rows == trained == [1, 2]
    model = make()
    batch = SegmentCollator(0, SEGMENT_SDPA)([segs[1:2]])  # nothing to train: the whole layer, a zero loss
    rows = layer_rows(model)
    assert trained_positions_loss(model, batch, torch.tensor(1)).item() == 0.0 and rows == [3]


def test_evaluation_trims_with_dropout_configured_because_it_is_inactive():
    model = make(attention_dropout=0.3).eval()
    batch = padded(segments(4, seed=3))
    n = (batch["labels"][:, 1:] != -100).sum()
    rows = layer_rows(model)
    with torch.no_grad():
        got, ref = trained_positions_loss(model, batch, n), own_loss(model, batch, n)
    assert abs(got.item() - ref.item()) <= 1e-6
    assert rows[0] == int(n) and rows[1] == batch["input_ids"].numel()


@pytest.mark.parametrize("case", ["attention_dropout", "lora_dropout", "gradient_checkpointing", "eager"])
def test_where_trimming_would_change_the_numbers_the_whole_layer_runs(case):
    """Dropout draws per position, so fewer positions would draw other masks; a recomputed layer
    (gradient checkpointing) runs its own forward after this one. Same seed, same loss, whole layer."""
    model = make(
        attention_dropout=0.2 if case == "attention_dropout" else 0.0,
        attn="eager" if case == "eager" else "sdpa",
    )
    if case == "lora_dropout":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                target_modules=["q_proj", "v_proj", "down_proj"],
                lora_dropout=0.2,
                init_lora_weights=False,
            ),
        )
    if case == "gradient_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows, trained, sizes = compare(model, "right_padded", segments(6, seed=5), seed=11)
    assert rows == sizes and rows != trained
    if case == "eager":
        assert "its attention is 'eager'" in why_not_trimmable(model)


def test_lora_without_dropout_is_trimmed_and_exact():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        make(kv_heads=2),
        LoraConfig(
            r=4, target_modules=["q_proj", "o_proj", "up_proj"], lora_dropout=0.0, init_lora_weights=False
        ),
    )
    rows, trained, _ = compare(model, "segments", segments(6, seed=7, turns=2))
    assert rows == trained


def test_what_it_does_not_understand_is_named():
    gemma = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            attn_implementation="eager",
        )
    )
    assert "not a Llama-family layer's" in why_not_trimmable(gemma)
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            sliding_window=8,
            attn_implementation="sdpa",
        )
    )
    assert "sliding-window" in why_not_trimmable(mistral)
    full = transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            sliding_window=None,
            attn_implementation="sdpa",
        )
    )
    assert why_not_trimmable(full) is None


def test_a_layer_that_computes_something_else_is_caught_by_the_first_check(caplog):
    """Same parts as a Llama layer, another forward (here: a scaled residual). The first trimmed
    forward is compared with the layer's own; they differ, so the layer runs whole from then on."""
    model = make()
    layer = last_decoder_layer(model)

    class Scaled(type(layer)):
        def forward(self, hidden_states, **kwargs):
            return 0.5 * super().forward(hidden_states, **kwargs)

    layer.__class__ = Scaled
    assert why_not_trimmable(model) is None  # by its parts it looks like one
    rows, trained, sizes = compare(model, "right_padded", segments(6, seed=9))
    assert rows == sizes and rows != trained  # the first forward checked and ran whole, then whole
    batch = padded(segments(4, seed=2))
    caplog.clear()
    for _ in range(2):  # said once per layer, not per forward
        trained_positions_loss(model, batch, torch.tensor(1.0))
    assert "differs from its own (max difference" in getattr(layer, STATE).reason
    said = [r.getMessage() for r in caplog.records if r.name == "corelooper.lm"]
    assert len(said) == 1 and "runs over every position from now on" in said[0]


def test_under_bf16_autocast_the_check_allows_bf16_rounding_and_trims():
    """Fewer rows may round otherwise in bf16: the first forward's check allows the dtype's rounding
    (and still catches a layer that computes something else, as above)."""
    model = make(kv_heads=2)
    batch = padded(segments(6, seed=4, turns=2))
    n = (batch["labels"][:, 1:] != -100).sum()
    rows = layer_rows(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, ref = trained_positions_loss(model, batch, n), own_loss(model, batch, n)
    assert rows[0] == int(n) and getattr(last_decoder_layer(model), STATE).reason is None
    assert abs(got.item() - ref.item()) <= 2e-2 * ref.item()


def test_the_chunked_loss_over_trained_positions_uses_the_trimmed_layer_too():
    from types import SimpleNamespace

    from corelooper_lm.chunked_ce import chunked_causal_lm_loss

    def chunked(model, batch, n):
        return chunked_causal_lm_loss(
            SimpleNamespace(loss_type="causal_lm"), model, batch, n, trained_only=True
        )

    model = make(kv_heads=2)
    reference, probe = copy.deepcopy(model), copy.deepcopy(model)
    ref_loss, ref_grads = ga_step(
        reference, layout(reference, "segments", segments(6, seed=8, turns=2)), own_loss
    )
    rows = layer_rows(probe)
    batches = layout(probe, "segments", segments(6, seed=8, turns=2))
    loss, grads = ga_step(probe, batches, chunked)
    assert abs(loss - ref_loss) <= 1e-5  # the chunked loss's own tolerance (tests/test_chunked_ce.py)
    assert max((ref_grads[k] - grads[k]).abs().max().item() for k in ref_grads) <= 1e-5
    assert rows == [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
