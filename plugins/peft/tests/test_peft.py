"""corelooper-peft: LoRA through the real peft library on a tiny Llama (random init, no download)."""

from __future__ import annotations

import json

import pytest
import torch

from corelooper import Loop
from corelooper.errors import ConfigError

transformers = pytest.importorskip("transformers")  # a declared dependency of corelooper-peft
peft = pytest.importorskip("peft")


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def data(n=32, seq=16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (n, seq), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


LORA = {"method": "lora", "config": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}


def config(out, steps=6, save_steps=6, **peft_section):
    return {
        "train": {
            "output_dir": str(out),
            "max_steps": steps,
            "save_steps": save_steps,
            "per_device_train_batch_size": 4,
            "learning_rate": 1e-2,
            "logging_steps": 2,
        },
        "peft": {**LORA, **peft_section},
    }


def test_lora_trains_only_the_adapter_and_exports_it_for_peft(tmp_path):
    loop = Loop(tiny_llama(), config(tmp_path / "run"), train_dataset=data())
    assert isinstance(loop.model, peft.PeftModel)
    before = {n: p.detach().clone() for n, p in loop.model.named_parameters()}
    loop.train()
    changed = {n for n, p in loop.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed, "nothing trained"
    assert all("lora_" in n for n in changed), sorted(changed)[:5]
    assert any("lora_B" in n for n in changed)  # lora_B starts at 0: it must have moved
    trainable = sum(p.numel() for p in loop.model.parameters() if p.requires_grad)
    first = next(h for h in loop.state.log_history if "trainable_params" in h)
    assert first["trainable_params"] == trainable
    assert first["all_params"] == sum(p.numel() for p in loop.model.parameters())

    for folder in (tmp_path / "run", tmp_path / "run" / "checkpoint-6"):
        names = {p.name for p in folder.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= names, names
        assert not any(n.startswith("model") and n.endswith(".safetensors") for n in names), names
    assert json.loads((tmp_path / "run" / "adapter_config.json").read_text())["r"] == 4

    # The exported adapter on a fresh copy of the base model gives identical logits.
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "run")).eval()
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    trained = loop.backend.unwrap_model(loop.model).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, trained(input_ids=x).logits)
        base = tiny_llama()(input_ids=x).logits
        assert not torch.allclose(base, trained(input_ids=x).logits)


def test_merge_on_export_writes_a_plain_model_with_the_same_outputs(tmp_path):
    from transformers import AutoModelForCausalLM

    loop = Loop(tiny_llama(), config(tmp_path / "run", merge_on_export=True), train_dataset=data())
    loop.train()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "merged")).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = loop.backend.unwrap_model(loop.model).eval()(input_ids=x).logits
        torch.testing.assert_close(merged(input_ids=x).logits, want, atol=1e-5, rtol=1e-5)
    assert isinstance(loop.backend.unwrap_model(loop.model), peft.PeftModel)  # training model untouched


def test_resume_from_an_adapter_checkpoint_is_exact(tmp_path):
    full = Loop(tiny_llama(), config(tmp_path / "full", steps=8, save_steps=4), train_dataset=data())
    full.train()

    class StopAt4:  # an interrupted run: same schedule as the full one, stopped after step 4
        @staticmethod
        def on_step_end(state, control):
            control.should_training_stop = state.global_step >= 4

    part = Loop(
        tiny_llama(),
        config(tmp_path / "part", steps=8, save_steps=4),
        train_dataset=data(),
        plugins=[StopAt4()],
    )
    part.train()
    assert part.state.global_step == 4
    resumed = Loop(tiny_llama(), config(tmp_path / "part", steps=8, save_steps=4), train_dataset=data())
    resumed.train(resume_from_checkpoint="latest")
    assert resumed.state.global_step == 8
    a = dict(full.model.named_parameters())
    for n, p in resumed.model.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p, a[n], atol=1e-6, rtol=1e-5)


def test_other_peft_methods_through_their_config(tmp_path):
    cfg = config(tmp_path / "ia3", steps=2, save_steps=2)
    cfg["peft"] = {
        "method": "ia3",
        "config": {"target_modules": ["k_proj", "down_proj"], "feedforward_modules": ["down_proj"]},
    }
    loop = Loop(tiny_llama(), cfg, train_dataset=data())
    loop.train()
    assert (tmp_path / "ia3" / "adapter_model.safetensors").is_file()
    assert all("ia3_" in n for n, p in loop.model.named_parameters() if p.requires_grad)


def test_bad_peft_config_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="peft.method = 'lorra'"):
        Loop(tiny_llama(), {"train": {"output_dir": str(tmp_path)}, "peft": {"method": "lorra"}})
    with pytest.raises(ConfigError, match=r"\[peft.config\] is not valid for LoraConfig"):
        Loop(tiny_llama(), {"train": {"output_dir": str(tmp_path)}, "peft": {"config": {"rank": 4}}})
    with pytest.raises(ConfigError, match="target_modules"):
        Loop(
            tiny_llama(),
            {
                "train": {"output_dir": str(tmp_path)},
                "peft": {"config": {"target_modules": ["nothing_here"]}},
            },
        )


def test_inert_without_a_peft_section(tmp_path):
    loop = Loop(tiny_llama(), {"train": {"output_dir": str(tmp_path), "max_steps": 1}}, train_dataset=data())
    assert not isinstance(loop.model, peft.PeftModel)


def test_an_interrupted_run_writes_no_merged_model(tmp_path):
    from corelooper_testing import SigtermAt

    loop = Loop(
        tiny_llama(),
        config(tmp_path / "run", steps=6, save_steps=6, merge_on_export=True),
        train_dataset=data(),
        plugins=[SigtermAt(3)],
    )
    state = loop.train()
    assert state.preempted and state.global_step == 3
    assert (tmp_path / "run" / "checkpoint-3" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "run" / "merged").exists()
    assert not (tmp_path / "run" / "adapter_model.safetensors").exists()  # no final export either


def _saved_adapter(tmp_path):
    loop = Loop(tiny_llama(), config(tmp_path / "run", steps=2, save_steps=2), train_dataset=data())
    loop.train()
    return tmp_path / "run" / "checkpoint-2"


def _rewrite(ckpt, name: str, data: bytes) -> None:
    """Replace a checkpoint file and re-sign the manifest (checksums would refuse the edit as
    corruption first; here the loading itself must find the bad adapter)."""
    from corelooper.checkpoints.manifest import write_manifest

    (ckpt / name).write_bytes(data)
    (ckpt / "manifest.json").unlink()
    write_manifest(ckpt)


def test_a_bad_adapter_checkpoint_is_a_checkpoint_error_naming_file_and_tensor(tmp_path):
    from safetensors.torch import load_file, save

    from corelooper.errors import CheckpointError

    ckpt = _saved_adapter(tmp_path)
    weights = load_file(str(ckpt / "adapter_model.safetensors"))
    name = next(k for k in weights if "lora_A" in k)
    weights[name] = torch.zeros(3, 3)  # saved from another rank r
    _rewrite(ckpt, "adapter_model.safetensors", save(weights))
    resumed = Loop(tiny_llama(), config(tmp_path / "again", steps=4, save_steps=2), train_dataset=data())
    with pytest.raises(CheckpointError) as err:
        resumed.train(resume_from_checkpoint=str(ckpt))
    message = str(err.value)
    assert "adapter_model.safetensors" in message and "shape mismatch" in message
    assert "lora_A.default.weight: file (3, 3) vs model (4, 32)" in message
    assert err.value.exit_code == 5

    _rewrite(ckpt, "adapter_model.safetensors", b"\0" * 64)  # corrupt
    with pytest.raises(CheckpointError, match="adapter_model.safetensors.*unreadable"):
        Loop(tiny_llama(), config(tmp_path / "third", steps=4, save_steps=2), train_dataset=data()).train(
            resume_from_checkpoint=str(ckpt)
        )
