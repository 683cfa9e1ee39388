"""``corelooper run CONFIG --nproc 2`` as a real subprocess on the digits example."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = "examples/digits/config.toml"
SHORT = [
    "--set",
    "train.num_train_epochs=1",
    "--set",
    "model.args.dropout=0.0",
    "--set",
    "train.logging_steps=4",
]
# SHORT with a log line per step: the 2-process runs' losses are compared with one process's step
# by step (its 12 steps: 1797 digits x 0.8 in batches of 128)
PER_STEP = [*SHORT[:-1], "train.logging_steps=1"]


def corelooper(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "corelooper", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The output folder of one process with twice the batch (PER_STEP): the reference that both
    2-process launches (--nproc 2, accelerate launch) are compared with, run once."""
    tmp = tmp_path_factory.mktemp("one_process")
    out = tmp / "one"
    one = corelooper(
        tmp,
        "run",
        CONFIG,
        *PER_STEP,
        "--set",
        "train.per_device_train_batch_size=128",
        "--set",
        f"train.output_dir={out}",
    )
    assert one.returncode == 0, one.stderr[-4000:]
    return out


def step_losses(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "loss" in x and "train_runtime" not in x]


@pytest.mark.slow
@pytest.mark.distributed
def test_nproc_2_runs_distributed_and_matches_one_process(tmp_path, one_process):
    from safetensors.torch import load_file

    two = corelooper(
        tmp_path, "run", CONFIG, "--nproc", "2", *PER_STEP, "--set", f"train.output_dir={tmp_path / 'two'}"
    )
    assert two.returncode == 0, two.stderr[-4000:]
    assert "batch 64 x 1 accumulation x 2 processes" in two.stdout
    assert two.stdout.count("corelooper: training") == 1  # only the main process reports
    logs_two, logs_one = step_losses(tmp_path / "two"), step_losses(one_process)
    assert [x["step"] for x in logs_two] == list(range(1, 13))  # one line per step: one writer
    for a, b in zip(logs_two, logs_one, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
    w2, w1 = (
        load_file(str(tmp_path / "two" / "model.safetensors")),
        load_file(str(one_process / "model.safetensors")),
    )
    assert max((w2[k] - w1[k]).abs().max().item() for k in w1) <= 1e-5
    ckpt = tmp_path / "two" / "checkpoint-12"
    assert sorted(p.name for p in ckpt.glob("rng_state_*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    evals = [
        json.loads(x)
        for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
        if "eval_accuracy" in x
    ]
    one_evals = [
        json.loads(x)
        for x in (one_process / "metrics.jsonl").read_text().splitlines()
        if "eval_accuracy" in x
    ]
    assert len(evals) == 1 and abs(evals[0]["eval_accuracy"] - one_evals[0]["eval_accuracy"]) < 1e-6


@pytest.mark.slow
@pytest.mark.distributed
def test_a_crash_in_one_rank_ends_all_ranks_naming_it(tmp_path):
    plugin = tmp_path / "crash_rank1.py"
    plugin.write_text(
        "import os\n\n\n"
        "def on_step_end(state):\n"
        "    if os.environ.get('RANK') == '1' and state.global_step == 3:\n"
        "        raise RuntimeError('rank one breaks on purpose')\n"
    )
    proc = corelooper(
        tmp_path,
        "run",
        CONFIG,
        "--nproc",
        "2",
        *SHORT,
        "-p",
        str(plugin),
        "--set",
        "train.load_best_model_at_end=false",
        "--set",
        "train.save_strategy=steps",
        "--set",
        "train.save_steps=2",
        "--set",
        f"train.output_dir={tmp_path / 'out'}",
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]  # the rank's own code: a plugin failed
    last = proc.stderr.strip().splitlines()
    error = next(line for line in last if line.startswith("corelooper: error: rank"))
    assert "rank 1 of 2" in error and "rank one breaks on purpose" in error
    assert proc.stderr.count("rank one breaks on purpose") == 1  # said once, by the launcher
    assert "on_step_end" in error and "other ranks were stopped" in error
    # the checkpoint saved before the crash is intact; nothing half-written is left
    assert sorted(p.name for p in (tmp_path / "out").glob("*checkpoint-*")) == ["checkpoint-2"]
    assert (tmp_path / "out" / "checkpoint-2" / "model.safetensors").is_file()


@pytest.mark.slow
def test_accelerate_launch_runs_the_same_command_distributed(tmp_path, one_process):
    """`accelerate launch --multi_gpu --num_processes 2 -m corelooper run CONFIG` (on CPU the
    backend's Accelerator(cpu=True) makes it MULTI_CPU/gloo): two ranks, one writer, and the
    same losses, step by step, as one process with twice the batch (the module's reference; its
    evaluation, saves and TensorBoard, left out here, come after or beside the steps)."""
    accelerate = Path(sys.executable).parent / "accelerate"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    steps = [
        *PER_STEP,
        "--set",
        "train.eval_strategy='no'",
        "--set",
        "train.save_strategy='no'",
        "--set",
        "train.load_best_model_at_end=false",
        "-p",
        "no:tensorboard",
    ]
    two = subprocess.run(
        [
            str(accelerate),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "corelooper",
            "run",
            CONFIG,
            *steps,
            "--set",
            f"train.output_dir={tmp_path / 'two'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert two.returncode == 0, two.stderr[-4000:]
    assert "x 2 processes" in two.stdout and two.stdout.count("corelooper: training") == 1
    losses_two = [x["loss"] for x in step_losses(tmp_path / "two")]
    losses_one = [x["loss"] for x in step_losses(one_process)]
    assert len(losses_two) == 12  # a line per step: one writer
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses_two, losses_one, strict=True))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_bad_checkpoint_under_nproc_exits_5_and_is_said_once(tmp_path):
    """Every rank finds the checkpoint bad: the launcher reports it once, with exit 5 (not 7)."""
    missing = tmp_path / "no-such-checkpoint"
    proc = corelooper(
        tmp_path,
        "run",
        CONFIG,
        "--nproc",
        "2",
        *SHORT,
        "-p",
        "no:tensorboard",
        "--set",
        f"train.output_dir={tmp_path / 'out'}",
        "--resume-from-checkpoint",
        str(missing),
        timeout=120,
    )
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert proc.stderr.count(f"Checkpoint {str(missing)!r} does not exist") == 1, proc.stderr[-3000:]
    assert "corelooper: error: rank " in proc.stderr and "Traceback" not in proc.stderr
