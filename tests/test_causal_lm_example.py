"""examples/causal_lm trained through the real CLI (a subprocess): loss and perplexity fall, the
throughput facts are logged, and the saved model and tokenizer load back with from_pretrained."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # in the examples/test extras

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/causal_lm/config.toml"
STEPS = 30


def overrides(out: Path) -> list[str]:
    return [
        f"train.output_dir={out}",
        f"train.max_steps={STEPS}",
        "train.logging_steps=10",
        f"train.eval_steps={STEPS}",
        f"train.save_steps={STEPS}",
        "train.per_device_train_batch_size=16",
        "model.args.vocab_size=512",
        "data.args.vocab_size=512",
        "data.args.seq_len=64",
        "model.args.hidden_size=64",
        "train.peak_flops=1e12",
        "data.args.max_eval_blocks=96",
    ]


@pytest.mark.slow
def test_causal_lm_example_learns_and_reloads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from corelooper import Loop
    from corelooper.config import Config

    out = tmp_path / "run"
    sets = overrides(out)
    initial = Loop(config=Config.load(CONFIG, sets)).evaluate()  # same seed: the run's initial model
    assert initial["eval_perplexity"] == pytest.approx(math.exp(initial["eval_loss"]), rel=1e-3)
    assert initial["eval_perplexity"] > 300  # about the vocabulary size for a random model

    cmd = [sys.executable, "-m", "corelooper", "run", str(CONFIG)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "difficulty_score" in proc.stderr  # the unused column is named once, not passed to the model

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logs = [r for r in records if r["event"] == "log" and "loss" in r]
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in logs] == [10, 20, 30]
    assert logs[0]["loss"] > logs[-1]["loss"] + 0.3
    final = evals[-1]
    assert final["step"] == STEPS
    assert final["eval_perplexity"] < initial["eval_perplexity"] / 2, (initial, final)

    # Throughput facts: tokens seen, model FLOPs per token, MFU against train.peak_flops.
    last = logs[-1]
    assert last["num_input_tokens_seen"] == STEPS * 16 * 64
    assert last["model_flops_per_token"] > 0
    assert last["mfu"] == pytest.approx(
        last["model_flops_per_token"] * last["tokens_per_second"] / 1e12, rel=0.02
    )

    # The final model and tokenizer load back with from_pretrained and give the logged eval loss.
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    from examples.causal_lm.data import tokenizer as corpus_tokenizer

    text = "import json\nfrom email.message import Message\n"
    assert tok(text)["input_ids"] == corpus_tokenizer(("json", "email"), 512, 8).encode(text).ids
    again = Loop(model, Config.load(CONFIG, sets + [f"train.output_dir={tmp_path / 'eval'}"])).evaluate()
    assert again["eval_loss"] == pytest.approx(final["eval_loss"], abs=1e-4)
    with torch.no_grad():
        ids = torch.tensor([tok(text)["input_ids"]])
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 512)
