"""Two real processes (torchrun, gloo) against one with twice the batch: the difficulty-weighted,
packed SFT step gives the same weights (num_items_in_batch is counted across ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / f"cache{nproc}"), "PYTHONPATH": str(ROOT),
           "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    args = [str(BIN / "corelooper"), "run", str(cfg), "--set", f'train.output_dir="{out}"',
            "--set", f"train.per_device_train_batch_size={batch}"] + (["--nproc", str(nproc)] if nproc > 1 else [])
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return load_file(str(out / "model.safetensors"))


def test_two_ranks_equal_one_process_with_twice_the_batch(tmp_path, model_dir):
    cfg = write(tmp_path, model_dir)
    one = run(cfg, tmp_path / "one", 1, 4, tmp_path)
    two = run(cfg, tmp_path / "two", 2, 2, tmp_path)
    start = load_file(str(Path(model_dir) / "model.safetensors"))
    moved = max((one[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst <= 1e-5, worst
