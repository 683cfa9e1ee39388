"""Segment-wise sdpa: packed rows without a T x T mask, checked against each sample run alone."""

from __future__ import annotations

import random

import pytest
import torch
from corelooper_lm.packing import Segment, SegmentCollator, plan_packing
from corelooper_lm.segment_attention import SEGMENT_SDPA, segment_bounds, use_segment_attention

from corelooper.data.loader import count_loss_items

transformers = pytest.importorskip("transformers")


def tiny_llama(attn="sdpa", kv_heads=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        attn_implementation=attn,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def samples(n=7, seed=0, lo=2, hi=20):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 96) for _ in range(rng.randint(lo, hi))]
        prompt = rng.randint(0, len(ids) - 1)
        out.append(Segment(ids, [-100] * prompt + ids[prompt:], {}))
    return out


def alone(model, seg):
    with torch.no_grad():
        return model(input_ids=torch.tensor([seg.input_ids])).logits[0]


def padded(segs, left=False):
    """The segments as a padded batch (right-padded, or left-padded with ``left``)."""
    longest = max(len(s.input_ids) for s in segs)
    batch = {
        "input_ids": torch.zeros((len(segs), longest), dtype=torch.long),
        "labels": torch.full((len(segs), longest), -100),
        "attention_mask": torch.zeros((len(segs), longest), dtype=torch.long),
    }
    for r, s in enumerate(segs):
        k = len(s.input_ids)
        where = slice(longest - k, longest) if left else slice(0, k)
        batch["input_ids"][r, where] = torch.tensor(s.input_ids)
        batch["labels"][r, where] = torch.tensor(s.labels)
        batch["attention_mask"][r, where] = 1
    return batch


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_logits_equal_each_sample_alone(kv_heads):
    model = tiny_llama(kv_heads=kv_heads).eval()
    segs = samples()
    refs = [alone(model, s) for s in segs]  # plain sdpa, before the switch
    assert use_segment_attention(model) == SEGMENT_SDPA and model.config._attn_implementation == SEGMENT_SDPA
    plan = plan_packing([len(s.input_ids) for s in segs], 32, "bfd")
    rows = [[segs[i] for i, _, _ in row] for row in plan]
    batch = SegmentCollator(pad_token_id=0, attn_implementation=SEGMENT_SDPA)(rows)
    assert "attention_mask" not in batch and batch["input_ids"].shape == (
        1,
        sum(len(s.input_ids) for s in segs),
    )
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    order = [s for row in rows for s in row]
    pos, worst = 0, 0.0
    for seg in order:
        k = len(seg.input_ids)
        worst = max(worst, (out[pos : pos + k] - refs[segs.index(seg)]).abs().max().item())
        pos += k
    assert worst <= 1e-5, worst


def test_without_cu_seq_lens_segments_come_from_position_ids():
    model = tiny_llama().eval()
    segs = samples(4, seed=2)
    refs = [alone(model, s) for s in segs]
    use_segment_attention(model)
    batch = SegmentCollator(pad_token_id=0, attn_implementation=SEGMENT_SDPA)([segs])
    with torch.no_grad():  # what TRL's padding-free collator gives: ids and position_ids only
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    pos = 0
    for seg, ref in zip(segs, refs, strict=True):
        k = len(seg.input_ids)
        assert (out[pos : pos + k] - ref).abs().max().item() <= 1e-5
        pos += k


def test_padding_free_loss_and_gradients_equal_the_padded_batch():
    segs = samples(6, seed=4)
    ref_model, model = tiny_llama(), tiny_llama()
    use_segment_attention(model)
    pad = padded(segs)
    free = SegmentCollator(pad_token_id=0, attn_implementation=SEGMENT_SDPA)([segs])
    n_pad, n_free = count_loss_items(pad, "causal_lm"), count_loss_items(free, "causal_lm")
    assert int(n_pad) == int(n_free) > 0
    loss_pad = ref_model(**pad, num_items_in_batch=n_pad).loss
    loss_free = model(**free, num_items_in_batch=n_free).loss
    assert abs(loss_pad.item() - loss_free.item()) <= 1e-5
    loss_pad.backward()
    loss_free.backward()
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name


def test_padded_batches_still_run_plain_sdpa():
    segs = samples(5, seed=6)
    ref_model, model = tiny_llama().eval(), tiny_llama().eval()
    use_segment_attention(model)
    batch = padded(segs)
    with torch.no_grad():
        ref, out = ref_model(**batch).logits, model(**batch).logits
    keep = batch["attention_mask"].bool()
    assert (ref[keep] - out[keep]).abs().max().item() <= 1e-6


def test_other_attentions_are_left_as_they_are():
    model = tiny_llama("eager")
    assert use_segment_attention(model) == "eager" and model.config._attn_implementation == "eager"


def test_segment_bounds():
    assert segment_bounds(torch.tensor([0, 3, 5], dtype=torch.int32)) == [[0, 3, 5]]
    assert segment_bounds(torch.tensor([0, 3, 5]), length=8) == [[0, 3, 5, 8]]  # padding: one more segment
    assert segment_bounds(None, torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]), 2) == [[0, 3, 5], [0, 2, 5]]
    assert segment_bounds(None, None, 2, 4) == [[0, 4], [0, 4]]
