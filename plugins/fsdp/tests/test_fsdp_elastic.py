"""Elastic resume with corelooper-fsdp: an FSDP2 run saved on N processes continues on M != N.

The issue's end-to-end run with real ``corelooper run`` processes (torchrun, gloo) and real DCP
files: 2 processes -> preempted (SIGTERM) at step 6 -> resumed on 1 -> preempted at step 9 ->
resumed on 2. The sharded model and optimizer state (``fsdp_state/``) are re-sharded by
``torch.distributed.checkpoint`` on load; the loader's position is corelooper-elastic-resume's (plugins/elastic_resume).
Final weights and every step's loss equal an uninterrupted 2-process FSDP2 run to 1e-5 (a
repeated or skipped sample, or an optimizer state not carried over, would change both).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
from cluster_task import ELASTIC, STOP_PLUGIN, env, max_diff, write_config  # noqa: E402

MODEL = "[model.args]\nhidden = 7\n"  # 7 rows split 4 + 3 over 2 ranks: uneven shards to re-shard


def _config(tmp_path: Path, name: str, sharded_state: bool = True, **train) -> Path:
    """The toy MLP run of cluster_task with an [fsdp] section: each Linear one FSDP unit."""
    path = write_config(tmp_path, tmp_path / name, name=f"{name}.toml", **train)
    fsdp = f'[fsdp]\nwrap = ["Linear"]\nsharded_state = {str(sharded_state).lower()}\n'
    path.write_text(path.read_text() + MODEL + fsdp)
    return path


def _run(tmp_path: Path, config: Path, nproc: int, stop: int = 0, resume: bool = False):
    """``corelooper run`` with the FSDP and elastic plugins (autoload is off in tests: named with -p)."""
    args = [
        sys.executable,
        "-m",
        "corelooper",
        "run",
        str(config),
        "-p",
        "corelooper_fsdp",
        "-p",
        str(tmp_path / "stop_at.py"),
        *ELASTIC,
    ]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    if resume:
        args += ["--resume-from-checkpoint", "latest"]
    (tmp_path / "stop_at.py").write_text(STOP_PLUGIN)
    return subprocess.run(
        args,
        cwd=REPO,
        env={**env(tmp_path), "STOP_AT_STEP": str(stop)},
        capture_output=True,
        text=True,
        timeout=240,
    )


def _steps(run_dir: Path) -> dict[int, dict[str, float]]:
    """Loss, gradient norm and learning rate of each logged step."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [
        (x["step"], {k: x[k] for k in ("loss", "grad_norm", "learning_rate")})
        for x in lines
        if "loss" in x and "train_runtime" not in x
    ]
    assert len({s for s, _ in steps}) == len(steps), steps  # each step logged once
    return dict(steps)


def _step_diff(got: dict, want: dict, first: int = 1) -> float:
    """The largest difference over steps ``first``..12 (``got`` has those, ``want`` all 12)."""
    assert sorted(got) == list(range(first, 13)) and sorted(want) == list(range(1, 13))
    return max(abs(got[s][k] - want[s][k]) for s in got for k in want[s])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-process FSDP2 run: its steps, final weights and run folder.

    It saves with fsdp.sharded_state = false, which changes only what a checkpoint holds (the
    model then comes from model.safetensors), not the training: its checkpoint-6 is the one the
    optimizer-only test resumes, instead of a second 2-process run to step 6 (issue 50)."""
    tmp = tmp_path_factory.mktemp("fsdp_ref")
    ref = _run(tmp, _config(tmp, "ref", sharded_state=False), 2)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return _steps(tmp / "ref"), load_file(str(tmp / "ref" / "model.safetensors")), tmp / "ref"


def _shards(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in (checkpoint / "fsdp_state").glob("*.distcp"))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_two_then_one_then_two_processes_equals_an_uninterrupted_run(tmp_path, reference):
    # 64 samples, global batch 8: 8 steps an epoch; stops at 6 (epoch 0) and 9 (epoch 1)
    cfg, run = _config(tmp_path, "run"), tmp_path / "run"
    first = _run(tmp_path, cfg, 2, stop=6)
    assert first.returncode == 143 and (run / "checkpoint-6").is_dir(), first.stderr[-3000:]
    assert _shards(run / "checkpoint-6") == ["__0_0.distcp", "__1_0.distcp"]  # saved sharded on 2
    one = _run(tmp_path, cfg, 1, stop=9, resume=True)
    assert one.returncode == 143, one.stderr[-3000:]
    assert (
        "saved with 4 per device x 1 accumulation x 2 processes = 8; on 1 processes: "
        "4 per device x 2 accumulation x 1 processes = 8"
    ) in one.stdout
    assert "continuing after sample 48 of epoch 0" in one.stdout
    assert _shards(run / "checkpoint-9") == ["__0_0.distcp"]  # 1 process: FSDP2 on a mesh of one
    last = _run(tmp_path, cfg, 2, resume=True)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "on 2 processes: 4 per device x 1 accumulation x 2 processes = 8" in last.stdout
    assert "continuing after sample 8 of epoch 1" in last.stdout  # step 9 = 1 step into epoch 1

    want_steps, want_final, _ = reference
    assert want_final["net.0.weight"].shape == (7, 8)  # the uneven model (7 rows over 2 ranks)
    step_diff = _step_diff(_steps(run), want_steps)
    final = load_file(str(run / "model.safetensors"))
    weight_diff = max_diff(final, want_final)
    print(f"2 -> 1 -> 2: max step difference {step_diff:.3g}, max final-weight difference {weight_diff:.3g}")
    assert step_diff <= 1e-5 and weight_diff <= 1e-5
    assert max_diff(final, load_file(str(run / "checkpoint-6" / "model.safetensors"))) > 1e-3


@pytest.mark.slow
def test_fsdp_optimizer_only_sharded_state_resumes_on_one_process(tmp_path, reference):
    """fsdp.sharded_state = false: the model comes from model.safetensors, only the optimizer
    state from fsdp_state/ (re-sharded from 2 processes onto 1). The checkpoint is the reference
    run's checkpoint-6 (2 processes, sharded_state = false), resumed in a folder of its own; the
    preempted 2-process save is the test above's."""
    import shutil

    want_steps, want_final, ref = reference
    cfg, run = _config(tmp_path, "run", sharded_state=False), tmp_path / "run"
    shutil.copytree(ref / "checkpoint-6", run / "checkpoint-6")
    assert _shards(run / "checkpoint-6") == ["__0_0.distcp", "__1_0.distcp"]  # saved on 2
    one = _run(tmp_path, cfg, 1, resume=True)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "continuing after sample 48 of epoch 0" in one.stdout

    step_diff = _step_diff(_steps(run), want_steps, first=7)
    weight_diff = max_diff(load_file(str(run / "model.safetensors")), want_final)
    print(
        f"2 -> 1 (optimizer only): max step difference {step_diff:.3g}, max final-weight difference "
        f"{weight_diff:.3g}"
    )
    assert step_diff <= 1e-5 and weight_diff <= 1e-5


@pytest.mark.slow
def test_fsdp_refused_resumes_name_what_would_work(tmp_path):
    """Saved on 1 process with a global batch of 3: 2 processes cannot split it, and the builtin
    backend cannot read FSDP state. Each run stops before anything in output_dir changes, with
    one paragraph naming what would work."""
    cfg = _config(tmp_path, "odd", per_device_train_batch_size=3, max_steps=2, save_steps=1)
    saved = _run(tmp_path, cfg, 1, stop=1)
    assert saved.returncode == 143 and (tmp_path / "odd" / "checkpoint-1").is_dir(), saved.stderr[-3000:]
    before = sorted(p.name for p in (tmp_path / "odd").iterdir())

    refused = _run(tmp_path, cfg, 2, resume=True)
    assert refused.returncode == 2, refused.stderr[-3000:]  # a ConfigError
    message = (
        "Cannot resume exactly on 2 processes: the checkpoint's global batch is 3 per device x 1 "
        "accumulation x 1 processes = 3 samples, and 3 is not divisible by 2. Resume on a number "
        "of processes that divides it (1, 3), or start a new run (another train.output_dir) with "
        "the batch size you want."
    )
    assert message in refused.stderr and refused.stderr.count("Cannot resume") == 1
    assert sorted(p.name for p in (tmp_path / "odd").iterdir()) == before

    # The same checkpoint on 1 process without [fsdp] (the builtin backend, which looks for an
    # optimizer.pt): refused, naming the section to keep.
    plain = write_config(
        tmp_path,
        tmp_path / "odd",
        name="plain.toml",
        per_device_train_batch_size=3,
        max_steps=2,
        save_steps=1,
    )
    plain.write_text(plain.read_text() + MODEL)
    dropped = _run(tmp_path, plain, 1, resume=True)
    assert dropped.returncode == 5, dropped.stderr[-3000:]  # a CheckpointError
    assert (
        "optimizer.pt' is missing (optimizer state). The checkpoint was saved by a run with [fsdp], "
        "which this config does not have"
    ) in dropped.stderr
    assert "Resume with [fsdp] in the config" in dropped.stderr
    assert sorted(p.name for p in (tmp_path / "odd").iterdir()) == before
