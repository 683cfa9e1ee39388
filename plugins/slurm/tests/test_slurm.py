"""corelooper-slurm against a real single-node Slurm (slurm_cluster.py), and its script.

The end-to-end test submits a 2-process job with `corelooper slurm`, waits until it has trained
a few steps, sends the warning signal as Slurm would before a time limit (`scancel
--signal=USR1 --batch`), and checks: every rank saved at the same step, the job requeued itself
(Restarts=1), the restarted job resumed from that checkpoint (`--resume-from-checkpoint auto`)
and finished, and its weights and every step's loss equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TOYS = REPO / "tests" / "toys.py"
sys.path.insert(0, str(HERE))
import slurm_cluster  # noqa: E402

STEPS = 24
SLOW = "import time\n\n\ndef on_step_end(state):\n    time.sleep(0.4)  # time to send the signal mid-run\n"


def write_config(path: Path, output_dir: Path) -> Path:
    path.write_text(
        f'[model]\nfactory = "{TOYS}:mlp"\n[data]\ntrain = "{TOYS}:blobs_train"\n[train]\n'
        f'output_dir = "{output_dir}"\nmax_steps = {STEPS}\nper_device_train_batch_size = 4\n'
        'learning_rate = 0.05\nlogging_steps = 1\nsave_strategy = "steps"\nsave_steps = 1000\n'
        'eval_strategy = "no"\nlr_scheduler_type = "linear"\nseed = 3\n'
    )
    return path


def base_env(tmp: Path) -> dict[str, str]:
    """Installed plugins load (the `slurm` command is one); runs pass -p no:tensorboard."""
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    env.pop("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def corelooper(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "corelooper", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = slurm_cluster.missing_programs()
    if missing:  # the only reason to skip: scripts/setup installs them where it can (root + apt-get)
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge")
    root = tmp_path_factory.mktemp("slurm")
    cluster = slurm_cluster.start(root, base_env(root))
    yield cluster
    cluster.stop()


def test_preempted_job_saves_requeues_resumes_and_matches_an_uninterrupted_run(slurm, tmp_path):
    (tmp_path / "slow.py").write_text(SLOW)
    config = write_config(tmp_path / "job.toml", tmp_path / "job")
    env = {**slurm.env, "TMPDIR": str(tmp_path)}
    submitted = corelooper("slurm", str(config), "--nodes", "1", "--nproc-per-node", "2", "--cpus-per-task",
                           str(os.cpu_count() or 1), "--port", str(slurm_cluster._free_port()),
                           "--output", str(tmp_path / "job-%j.out"), "-p", str(tmp_path / "slow.py"),
                           "-p", "no:tensorboard", "--grace", "60", env=env, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().rsplit(" ", 1)[-1]
    metrics = tmp_path / "job" / "metrics.jsonl"
    slurm.wait_for("the job did not train 4 steps", lambda: metrics.exists() and metrics.read_text().count(
        '"loss"') >= 4, 180)
    signal_sent = slurm.run("scancel", "--signal=USR1", "--batch", job_id)
    assert signal_sent.returncode == 0, signal_sent.stderr

    # Slurm starts a requeued job no sooner than ~2 minutes later (its BeginTime: slurmd must
    # forget the killed run first; starting it earlier by hand gets "Job credential revoked").
    slurm.wait_for("the job did not finish", lambda: slurm.job(job_id).get("JobState") == "COMPLETED", 400)
    job = slurm.job(job_id)
    log = (tmp_path / f"job-{job_id}.out").read_text()
    assert job["Restarts"] == "1" and job["ExitCode"] == "0:0", (job, log[-3000:])
    assert "SIGUSR1: saving a checkpoint, then requeueing" in log and "(restart 1)" in log
    checkpoints = sorted((tmp_path / "job").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    stopped_at = int(checkpoints[0].name.split("-")[1])
    assert 4 <= stopped_at < STEPS, checkpoints  # save_steps=1000: only the signal saved it
    assert log.count(f"corelooper: stopped at step {stopped_at}") == 1  # rank 0 speaks, both ranks stop

    ref_config = write_config(tmp_path / "ref.toml", tmp_path / "ref")
    ref = corelooper("run", str(ref_config), "--nproc", "2", "-p", "no:tensorboard", env=base_env(tmp_path))
    assert ref.returncode == 0, ref.stderr[-3000:]
    final, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("job", "ref"))
    assert max((final[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    got_losses, want_losses = (_losses(tmp_path / d / "metrics.jsonl") for d in ("job", "ref"))
    assert sorted(got_losses) == list(range(1, STEPS + 1))
    assert max(abs(got_losses[s] - want_losses[s]) for s in want_losses) <= 1e-5
    assert not torch.equal(final["net.0.weight"], load_file(str(checkpoints[0] / "model.safetensors"))["net.0.weight"])


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    pairs = [(r["step"], r["loss"]) for r in rows if "loss" in r and "train_runtime" not in r]
    assert len(pairs) == len({s for s, _ in pairs}), pairs  # no step logged twice
    return dict(pairs)


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    config = write_config(tmp_path / "c.toml", tmp_path / "out")
    out = corelooper("slurm", str(config), "--nodes", "4", "--gpus-per-node", "8", "--time", "2-00:00:00",
                     "--partition", "gpu", "--signal", "SIGUSR2", "--grace", "300", "--set", "train.seed=1",
                     "--script", str(tmp_path / "job.sbatch"), "--dry-run", env=base_env(tmp_path), timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert (tmp_path / "job.sbatch").read_text().strip() == text.strip()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --partition=gpu", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR2@300", "export CORELOOPER_STOP_SIGNALS=SIGUSR2", "trap on_signal USR2",
                 '--rdzv_endpoint "$head_node:29500"', "--nproc_per_node 8", "--rdzv_backend c10d",
                 "--signals_to_handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2", "--shutdown_timeout 300",
                 'scontrol requeue "$SLURM_JOB_ID"',
                 f"-m corelooper run {config} --resume-from-checkpoint auto --set train.seed=1"):
        assert line in text, line
    # the script is valid bash
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0


def test_bad_options_are_one_paragraph_errors(tmp_path):
    config = write_config(tmp_path / "c.toml", tmp_path / "out")
    bad = corelooper("slurm", str(config), "--signal", "KILL", "--dry-run", env=base_env(tmp_path), timeout=60)
    assert bad.returncode == 2 and "--signal 'KILL' is not a signal a job can catch" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = corelooper("slurm", str(tmp_path / "nope.toml"), "--dry-run", env=base_env(tmp_path), timeout=60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    no_slurm = corelooper("slurm", str(config), env={**base_env(tmp_path), "PATH": str(tmp_path)}, timeout=60)
    assert no_slurm.returncode == 2 and "sbatch was not found on PATH" in no_slurm.stderr
    assert "--dry-run" in no_slurm.stderr and "Traceback" not in no_slurm.stderr
