"""The model-FLOPs estimate behind MFU (corelooper_lm.throughput): 6N + 12·L·d·T per token, with
embeddings left out, and the throughput logs built on it."""

from __future__ import annotations

import pytest
import torch
from corelooper_lm.throughput import ThroughputMeter, flops_per_token, non_embedding_parameters


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_cache=False,
        )
    )


def test_flops_per_token_follows_the_formula():
    pytest.importorskip("transformers")
    model = _tiny_llama()
    d, i, L, V, kv = 32, 64, 2, 64, 2 * (32 // 4)
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * i + 2 * d  # q, k, v, o, mlp, two norms
    n = L * per_layer + d + V * d  # + final norm + (tied) output head, a matmul
    assert non_embedding_parameters(model) == n
    assert flops_per_token(model, 128) == 6 * n + 12 * L * d * 128
    meter = ThroughputMeter(model, peak_flops=1e9, world_size=2)
    # 1000 tokens of 10 samples in 2 s: 500 tokens/s, 5 samples/s (mean length 100)
    logs = meter.logs(tokens_per_second=500.0, samples_per_second=5.0, tokens_seen=5000)
    per = 6 * n + 12 * L * d * 100
    assert logs["model_flops_per_token"] == per
    assert logs["mfu"] == pytest.approx(per * 1000 / 2.0 / 2e9, rel=1e-5)
    assert "mfu" not in ThroughputMeter(model, None, 1).logs(500.0, 5.0, 5000)
    # A plain module: 6N, embeddings excluded.
    emb = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 8))
    assert flops_per_token(emb, 50) == 6 * (8 * 8 + 8)
