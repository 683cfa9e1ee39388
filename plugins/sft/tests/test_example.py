"""examples/sft_chat end to end through the CLI, as its README says: make the model, preview, train, reload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "sft_chat"
BIN = Path(sys.executable).parent


def sh(args, cwd, env):
    out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's first step, `python examples/sft_chat/make_model.py --out DIR`, run once for
    both tests (they only read the base model): the folder and what the script said."""
    tmp = tmp_path_factory.mktemp("sft_chat_model")
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp / "cache"), "PYTHONPATH": str(ROOT)}
    model = tmp / "tiny-llama"
    return model, sh([str(BIN / "python"), str(EXAMPLE / "make_model.py"), "--out", str(model)], ROOT, env)


@pytest.mark.slow
@pytest.mark.skipif(not EXAMPLE.is_dir(), reason="runs from a repository checkout")
def test_sft_chat_example_trains_with_lora_packing_and_weighted_loss(tmp_path, made):
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    model, made = made
    # the script says what it wrote and nothing else (no shard bar, no DeepSpeed accelerator notice)
    assert (
        made.stdout + made.stderr
    ).strip() == f"wrote {model}/ (tokenizer: 512 tokens, chat template: ChatML)"
    common = ["--set", f'model.name_or_path="{model}"']
    preview = sh(
        [str(BIN / "corelooper"), "data", "preview", str(EXAMPLE / "config.toml"), "-n", "1", *common],
        ROOT,
        env,
    )
    assert "packed into" in preview.stdout and "[[" in preview.stdout  # packed, assistant tokens marked
    out = tmp_path / "run"
    ran = sh(
        [
            str(BIN / "corelooper"),
            "run",
            str(EXAMPLE / "config.toml"),
            *common,
            "--set",
            f'train.output_dir="{out}"',
            "--set",
            "train.max_steps=8",
            "--set",
            "train.eval_steps=8",
            "--set",
            "train.save_steps=8",
        ],
        ROOT,
        env,
    )
    said = ran.stdout + ran.stderr  # the start line first, then the adapter's share; the merged folder named
    assert said.index("corelooper: training 8 steps") < said.index("trainable_params=16384")
    assert f"peft: the merged model (adapter folded into the base weights) is in {out / 'merged'}" in said
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in x for x in lines) and any(x.get("trainable_params") for x in lines)
    assert (out / "adapter_model.safetensors").is_file() and list((out / "tensorboard").rglob("events.*"))
    generated = out / "generated.jsonl"  # the README's `corelooper predict ... --generate`
    lm = [str(BIN / "corelooper"), "predict", str(EXAMPLE / "config.toml"), "--checkpoint", "latest"]
    sh(
        [
            *lm,
            *common,
            "--set",
            f'train.output_dir="{out}"',
            "--generate",
            "--max-new-tokens",
            "8",
            "-o",
            str(generated),
        ],
        ROOT,
        env,
    )
    records = [json.loads(x) for x in generated.read_text(encoding="utf-8").splitlines()]
    assert len(records) == 8  # the 8 held-out conversations (eval_split), one record each
    for r in records:
        assert r["prompt"].endswith("<|im_start|>assistant\n") and isinstance(r["generated"], str)
        assert r["tokens"] == len(r["label_ids"]) > 0 and r["loss"] > 0 and len(r["generated_ids"]) <= 8

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "merged")  # LoRA folded in, plain HF model
    assert merged.config.vocab_size == 512
    assert_complete_export(out / "merged", model, env)


def assert_complete_export(merged: Path, base: Path, env: dict) -> None:
    """merged/ is a complete HF folder: the tokenizer with its chat template and the generation
    config load from it as they are, and `corelooper eval` runs on it with no other folder named."""
    import tomllib
    from transformers import AutoTokenizer, GenerationConfig

    from corelooper.config import dumps_toml

    tok, want = AutoTokenizer.from_pretrained(merged), AutoTokenizer.from_pretrained(base)
    assert tok.chat_template == want.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.get_vocab() == want.get_vocab() and tok.pad_token == want.pad_token == "<pad>"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(chat, tokenize=False) == want.apply_chat_template(chat, tokenize=False)
    assert (merged / "generation_config.json").is_file() and GenerationConfig.from_pretrained(merged)
    cfg = tomllib.loads((EXAMPLE / "config.toml").read_text())
    cfg.pop("peft")  # the export is a plain model: no adapter
    cfg["model"] = {"name_or_path": str(merged)}
    cfg["data"] = {
        "train": str(EXAMPLE / "data" / "chat.jsonl"),
        "eval": str(EXAMPLE / "data" / "chat.jsonl"),
    }
    cfg["train"]["output_dir"] = str(merged.parent / "eval_merged")
    path = merged.parent / "eval_merged.toml"
    path.write_text(dumps_toml(cfg))
    ev = sh([str(BIN / "corelooper"), "eval", str(path), "--checkpoint", str(merged)], ROOT, env)
    loss = json.loads(ev.stdout.strip().splitlines()[-1])["eval_loss"]
    assert 0 < loss < 6.3, loss  # ln 512 = 6.24 at random init: the trained weights were loaded


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not EXAMPLE.is_dir(), reason="runs from a repository checkout")
def test_sft_chat_example_with_zero3_on_two_processes_merges_and_reloads(tmp_path, made):
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": str(ROOT),
        "TMPDIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    model, _ = made
    out = tmp_path / "run"
    sh(
        [
            str(BIN / "corelooper"),
            "run",
            str(EXAMPLE / "config.toml"),
            "--nproc",
            "2",
            "--set",
            f'model.name_or_path="{model}"',
            "--set",
            f'train.output_dir="{out}"',
            "--set",
            "train.max_steps=4",
            "--set",
            "train.eval_steps=4",
            "--set",
            "train.save_steps=4",
            "--set",
            "deepspeed.zero_stage=3",
        ],
        ROOT,
        env,
    )
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (evaluation,) = [x for x in lines if "eval_loss" in x]
    assert (
        4 < evaluation["eval_loss"] < 7
    )  # the plain token mean (ln 512 = 6.2 at random init), not the weighted loss

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "merged").config.vocab_size == 512
