"""Two real processes (torchrun, gloo) against one with twice the batch: the difficulty-weighted,
packed SFT step gives the same weights (num_items_in_batch is counted across ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from sft_fixtures import CHATS, _datasets_cache, model_dir  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent


def write(tmp_path, model_dir):
    rows = [json.loads(json.dumps(CHATS[i % 3])) | {"difficulty_score": 0.5 + i % 4} for i in range(16)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    (tmp_path / "c.toml").write_text(f"""
[model]
name_or_path = "{model_dir}"
[data]
train = "chats.jsonl"
[sft]
assistant_only_loss = true
packing = true
max_length = 128
[lm]
entropy = true
[train]
max_steps = 2
optim = "sgd"
learning_rate = 0.5
max_grad_norm = 0.0
save_strategy = "no"
use_cpu = true
[plugins]
local = ["examples.sft_chat.weighting"]
""")
    return tmp_path / "c.toml"


def run(cfg, out, nproc, batch, tmp_path):
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(tmp_path / f"cache{nproc}"),
        "PYTHONPATH": str(ROOT),
        "TMPDIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    args = [
        str(BIN / "corelooper"),
        "run",
        str(cfg),
        "--set",
        f'train.output_dir="{out}"',
        "--set",
        f"train.per_device_train_batch_size={batch}",
    ] + (["--nproc", str(nproc)] if nproc > 1 else [])
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_twice_the_batch(tmp_path, model_dir):
    cfg = write(tmp_path, model_dir)
    one = run(cfg, tmp_path / "one", 1, 4, tmp_path)
    two = run(cfg, tmp_path / "two", 2, 2, tmp_path)
    start = load_file(str(Path(model_dir) / "model.safetensors"))
    moved = max((one[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst <= 1e-5, worst
    # token_accuracy (on in [sft] runs, counted from the weighting plugin's logits) and entropy: the
    # sums of both ranks are summed, so the two-rank log is the one-process log
    one_log, two_log = (train_records(tmp_path / d) for d in ("one", "two"))
    assert len(one_log) == len(two_log) == 1 and 0 < one_log[0]["token_accuracy"] < 1, one_log
    assert two_log[0]["token_accuracy"] == one_log[0]["token_accuracy"]
    assert 0 < one_log[0]["entropy"] and abs(two_log[0]["entropy"] - one_log[0]["entropy"]) <= 1e-6, one_log


def train_records(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r and "learning_rate" in r]


def eval_records(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval_token_accuracy" in r or "eval_loss" in r]


@pytest.mark.slow
@pytest.mark.distributed
def test_evaluation_with_token_accuracy_on_two_ranks_equals_one_process(tmp_path, model_dir):
    """An [sft] run evaluates with eval_token_accuracy (on by default, the output layer a slice of
    rows at a time over the trained positions): two real processes give one process's loss and
    accuracy (the counts summed across ranks)."""
    rows = [json.loads(json.dumps(CHATS[i % 3])) for i in range(12)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    cfg = tmp_path / "e.toml"
    cfg.write_text(f"""
[model]
name_or_path = "{model_dir}"
attn_implementation = "sdpa"
[data]
train = "chats.jsonl"
eval = "chats.jsonl"
[sft]
assistant_only_loss = true
max_length = 128
[lm]
entropy = true
[train]
max_steps = 2
learning_rate = 1e-2
per_device_eval_batch_size = 3
eval_strategy = "steps"
eval_steps = 2
save_strategy = "no"
use_cpu = true
""")
    results = {}
    for nproc, batch in ((1, 4), (2, 2)):
        out = tmp_path / f"run{nproc}"
        run(cfg, out, nproc, batch, tmp_path)
        results[nproc] = eval_records(out)
    one, two = results[1], results[2]
    assert len(one) == len(two) == 1 and 0 < one[0]["eval_token_accuracy"] < 1
    assert two[0]["eval_token_accuracy"] == one[0]["eval_token_accuracy"]
    assert 0 < one[0]["eval_entropy"] and abs(two[0]["eval_entropy"] - one[0]["eval_entropy"]) <= 1e-6
    assert abs(two[0]["eval_loss"] - one[0]["eval_loss"]) <= 1e-5
