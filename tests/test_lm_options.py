"""train.gradient_checkpointing / torch_compile / tf32 (the model-FLOPs estimate behind MFU, in
corelooper-lm: plugins/lm/tests/test_throughput.py)."""

from __future__ import annotations

import pytest
import torch

from corelooper import Loop
from corelooper.errors import ConfigError
from corelooper.hf.model_options import enable_gradient_checkpointing


class Block(torch.nn.Module):
    calls = 0

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        Block.calls += 1
        return x + torch.tanh(self.lin(x))


class Deep(torch.nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _grads(model, x, y):
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_plain_module_checkpointing_recomputes_blocks_and_keeps_loss_and_grads():
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3] * 2)
    plain, ckpt = Deep(), Deep()
    loss0, g0 = _grads(plain, x, y)
    assert enable_gradient_checkpointing(ckpt) == 3
    Block.calls = 0
    loss1, g1 = _grads(ckpt, x, y)
    assert Block.calls == 6  # each block's forward ran again during backward
    assert torch.equal(loss0, loss1)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    ckpt.eval()
    Block.calls = 0
    with torch.no_grad():
        ckpt(x)
    assert Block.calls == 3  # no checkpointing outside training
    assert list(ckpt.state_dict()) == list(plain.state_dict())


def test_checkpointing_a_model_without_blocks_is_a_clear_error():
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(3, 3))


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


def _lm_data(n=16, seq=12):
    ids = torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(2))
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def test_hf_gradient_checkpointing_trains_identically(tmp_path):
    pytest.importorskip("transformers")
    runs = {}
    for flag in (False, True):
        loop = Loop(
            _tiny_llama(),
            {
                "train": {
                    "output_dir": str(tmp_path / str(flag)),
                    "max_steps": 3,
                    "save_strategy": "no",
                    "logging_steps": 1,
                    "learning_rate": 1e-2,
                    "per_device_train_batch_size": 4,
                    "gradient_checkpointing": flag,
                }
            },
            train_dataset=_lm_data(),
        )
        loop.train()
        model = loop.backend.unwrap_model(loop.model)
        on = getattr(model, "is_activation_checkpointing", None)
        assert (on if on is not None else model.is_gradient_checkpointing) is flag
        runs[flag] = (
            [h["loss"] for h in loop.state.log_history if "loss" in h][:3],
            [p.detach() for p in loop.model.parameters()],
        )
    assert runs[True][0] == pytest.approx(runs[False][0], abs=1e-6)
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_compile_and_tf32_are_applied(tmp_path):
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        data = [(torch.randn(16), torch.tensor(i % 4)) for i in range(16)]
        losses = {}
        for compiled in (False, True):
            train = {
                "output_dir": str(tmp_path / str(compiled)),
                "max_steps": 2,
                "save_strategy": "no",
                "logging_steps": 1,
                "per_device_train_batch_size": 8,
                "tf32": True,
            }
            if compiled:  # the eager backend: the torch.compile path without minutes of C++ compiling
                train.update(torch_compile=True, torch_compile_backend="eager")
            loop = Loop(Deep(), {"train": train}, train_dataset=data)
            loop.train()
            model = loop.backend.unwrap_model(loop.model)
            assert (getattr(model, "_compiled_call_impl", None) is not None) is compiled
            losses[compiled] = [h["loss"] for h in loop.state.log_history if "loss" in h][:2]
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert losses[True] == pytest.approx(losses[False], abs=1e-6)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.slow
def test_a_compiled_llama_compiles_as_often_as_in_a_hand_written_loop(tmp_path):
    """Llama's forward slices ``self.layers[:n]`` into a new ModuleList on every call. corelooper's
    kept parameter list once counted that registration, so dynamo guarded on the count and compiled
    the model again every step (4 graphs in 4 steps; on an H200 21x slower than torch.compile in a
    hand-written loop). The oracle is torch.compile itself: the same model, compiled by hand."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    data = _lm_data()
    graphs = {}
    for who in ("hand-written", "corelooper"):
        torch._dynamo.reset()
        counters.clear()
        if who == "corelooper":
            train = {
                "output_dir": str(tmp_path),
                "max_steps": 4,
                "save_strategy": "no",
                "logging_steps": 1,
                "per_device_train_batch_size": 4,
                "torch_compile": True,
                "torch_compile_backend": "eager",
            }
            Loop(_tiny_llama(), {"train": train}, train_dataset=data).train()
        else:
            model = _tiny_llama()
            model.compile(backend="eager")
            optimizer = torch.optim.AdamW(model.parameters())
            for step in range(4):
                batch = {k: torch.stack([r[k] for r in data[4 * step : 4 * step + 4]]) for k in data[0]}
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        graphs[who] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs["corelooper"] == graphs["hand-written"] == 1
