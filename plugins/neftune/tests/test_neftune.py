"""corelooper-neftune: noise on the embedding output in training mode only; the hook goes away."""

from __future__ import annotations

import math

import pytest
import torch

from corelooper import Loop
from corelooper.errors import ConfigError


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


def data(n=16, seq=12):
    ids = torch.randint(0, 50, (n, seq), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


class Probe:
    """Looks at the embedding output during training (train and eval mode)."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, loop, state):
        model = loop.backend.unwrap_model(loop.model)
        x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
        clean = torch.nn.functional.embedding(x, model.embed.weight)
        with torch.no_grad():
            noisy1, noisy2 = model.embed(x), model.embed(x)
            model.eval()
            evaluated = model.embed(x)
            model.train()
        self.seen.append((clean, noisy1, noisy2, evaluated))


def test_noise_only_while_training_and_hook_removed_after(tmp_path):
    probe = Probe()
    model = TinyLM()
    loop = Loop(
        model,
        {
            "train": {
                "output_dir": str(tmp_path),
                "max_steps": 3,
                "save_strategy": "no",
                "eval_strategy": "steps",
                "eval_steps": 2,
                "logging_steps": 1,
            },
            "neftune": {"noise_alpha": 5.0},
        },
        train_dataset=data(),
        eval_dataset=data(8),
        plugins=[probe],
    )
    assert not model.embed._forward_hooks  # nothing before training begins
    loop.train()
    assert len(probe.seen) == 3
    bound = 5.0 / math.sqrt(12 * 16)
    for clean, n1, n2, evaluated in probe.seen:
        assert not torch.equal(n1, clean) and not torch.equal(n1, n2)  # fresh noise every call
        assert (n1 - clean).abs().max() <= bound + 1e-6
        assert (n1 - clean).abs().max() > bound / 2  # uniform in [-a, a]: near a somewhere
        assert torch.equal(evaluated, clean)  # eval mode: no noise
    assert not model.embed._forward_hooks  # removed at on_train_end
    x = torch.randint(0, 50, (2, 12))
    model.train()
    assert torch.equal(model.embed(x), torch.nn.functional.embedding(x, model.embed.weight))
    # Evaluations during and after training are deterministic (no noise).
    assert loop.evaluate()["eval_loss"] == loop.evaluate()["eval_loss"]


def test_hook_removed_when_training_fails(tmp_path):
    class Boom:
        def on_step_end(self, state):
            raise RuntimeError("boom")

    model = TinyLM()
    loop = Loop(
        model,
        {"train": {"output_dir": str(tmp_path), "max_steps": 3, "save_strategy": "no"}, "neftune": {}},
        train_dataset=data(),
        plugins=[Boom()],
    )
    with pytest.raises(Exception, match="boom"):
        loop.train()
    assert not model.embed._forward_hooks


def test_inert_without_section_and_clear_errors(tmp_path):
    model = TinyLM()
    Loop(
        model,
        {"train": {"output_dir": str(tmp_path), "max_steps": 1, "save_strategy": "no"}},
        train_dataset=data(),
        plugins=[Probe()],
    ).train()
    assert not model.embed._forward_hooks
    for section, match in (
        ({"noise_alpha": 0.0}, "noise_alpha must be > 0"),
        ({"module": "nope"}, "neftune.module = 'nope'"),
    ):
        loop = Loop(
            TinyLM(),
            {
                "train": {
                    "output_dir": str(tmp_path / "x"),
                    "max_steps": 1,
                    "save_strategy": "no",
                    "overwrite_output_dir": True,
                },
                "neftune": section,
            },
            train_dataset=data(),
        )
        with pytest.raises(ConfigError, match=match):
            loop.train()


def test_hf_model_input_embeddings_get_the_noise(tmp_path):
    transformers = pytest.importorskip("transformers")  # test extra of corelooper-neftune
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    seen = []

    class Look:
        def on_step_end(self, loop):
            emb = loop.backend.unwrap_model(loop.model).get_input_embeddings()
            x = torch.randint(0, 50, (1, 12))
            with torch.no_grad():
                seen.append(not torch.equal(emb(x), torch.nn.functional.embedding(x, emb.weight)))

    Loop(
        model,
        {
            "train": {"output_dir": str(tmp_path), "max_steps": 2, "save_strategy": "no"},
            "neftune": {"noise_alpha": 10.0},
        },
        train_dataset=data(),
        plugins=[Look()],
    ).train()
    assert seen == [True, True]
    assert not model.get_input_embeddings()._forward_hooks
