"""Is the model's Python plumbing where an SFT step's time goes? The benchmark's Llama (segment-wise
sdpa over a padding-free row) against the same operations written out by hand, without the
``transformers`` forward's kwargs, decorators and output capture: forward + backward over the
same micro-batches, interleaved repetitions, one line of JSON.

usage: python lean_forward.py [--samples 256] [--batch 8] [--reps 6] [--threads 2]

The two losses of the first micro-batch are printed too: they must be equal (the same maths).
Figures: benchmarks/README.md ("Where a step's time goes at two threads").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from common import Sample, make_model, make_samples


def padding_free(samples: list[Sample]) -> dict:
    """One unpadded row with position_ids and cu_seq_lens, as corelooper's segment collator."""
    lengths = [len(s.input_ids) for s in samples]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        input_ids=torch.tensor([sum((s.input_ids for s in samples), [])]),
        labels=torch.tensor([sum((s.labels for s in samples), [])]),
        position_ids=torch.tensor([sum((list(range(n)) for n in lengths), [])]),
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max(lengths),
        max_length_k=max(lengths),
    )


def lean_loss(model, batch: dict) -> torch.Tensor:
    """The Llama forward and causal-LM loss, one operation after another."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner, bounds = model.model, batch["cu_seq_lens_q"].tolist()
    sizes = [end - start for start, end in zip(bounds, bounds[1:], strict=False)]
    hidden = inner.embed_tokens(batch["input_ids"])
    cos, sin = inner.rotary_emb(hidden, batch["position_ids"])
    for layer in inner.layers:
        attn, normed = layer.self_attn, layer.input_layernorm(hidden)
        length = normed.shape[1]
        q, k, v = (
            proj(normed).view(1, length, -1, attn.head_dim).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        pieces = [
            F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=attn.scaling)
            for qi, ki, vi in zip(q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2), strict=True)
        ]
        hidden = hidden + attn.o_proj(torch.cat(pieces, 2).transpose(1, 2).reshape(1, length, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    logits = model.lm_head(inner.norm(hidden))
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from corelooper_lm.segment_attention import use_segment_attention

    model = make_model(0)
    use_segment_attention(model)
    model.train()
    samples = make_samples(a.samples)
    batches = [padding_free(samples[i : i + a.batch]) for i in range(0, len(samples), a.batch)]
    rows = {"model": lambda b: model(**b).loss, "lean": lambda b: lean_loss(model, b)}
    with torch.no_grad():
        losses = {name: f(batches[0]).item() for name, f in rows.items()}

    def seconds(f) -> float:
        start = time.perf_counter()
        for b in batches:
            f(b).backward()
        return time.perf_counter() - start

    for f in rows.values():  # warm-up
        seconds(f)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(a.reps):
        for name, f in rows.items():
            times[name].append(seconds(f))
    ratios = [m / s for m, s in zip(times["model"], times["lean"], strict=True)]
    print(
        json.dumps(
            dict(
                first_loss=losses,
                seconds=times,
                model_over_lean=[round(r, 3) for r in ratios],
                median=round(statistics.median(ratios), 3),
                threads=a.threads,
                batches=len(batches),
            )
        )
    )


if __name__ == "__main__":
    main()
