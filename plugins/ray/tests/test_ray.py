"""corelooper-ray on a real local Ray cluster (2 CPUs, 2 Ray Train workers), as a CLI subprocess.

A plugin SIGKILLs the rank-1 worker process at step 8 (once): a real worker death mid-run. Ray
Train (``max_failures = 1``) restarts the worker group, which resumes from the checkpoint it had
reported (step 6), and the run ends with the weights and per-step losses of an uninterrupted
2-process torchrun run of the same config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.cluster  # starts a scheduler or rehearses a cluster

REPO = Path(__file__).resolve().parents[3]
TOYS = REPO / "tests" / "toys.py"

KILLER = """
import os
import signal
from pathlib import Path

MARK = Path(__file__).with_suffix(".killed")


def on_step_end(state):
    if os.environ.get("RANK") == "1" and state.global_step == 8 and not MARK.exists():
        MARK.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)  # the worker process dies, as on a lost node
"""


def write_config(path: Path, output_dir: Path, ray: str = "") -> Path:
    path.write_text(
        f'[model]\nfactory = "{TOYS}:mlp"\n[data]\ntrain = "{TOYS}:blobs_train"\n[train]\n'
        f'output_dir = "{output_dir}"\nmax_steps = 12\nper_device_train_batch_size = 4\n'
        'learning_rate = 0.05\nlogging_steps = 1\nsave_strategy = "steps"\nsave_steps = 3\n'
        f'eval_strategy = "no"\nlr_scheduler_type = "linear"\nseed = 3\n{ray}'
    )
    return path


def corelooper(tmp: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # Ray's session folder holds AF_UNIX sockets (at most 107 bytes of path): a short one
    with tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp") as ray_tmp:
        env = {
            **os.environ,
            "TMPDIR": str(tmp),
            "RAY_TMPDIR": ray_tmp,
            "OMP_NUM_THREADS": "1",
            "PYTHONHASHSEED": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray Train's controller polls its workers every 2 s (its default) to see one died or
            # all finished: every 0.5 s here, so the restart and the end come ~4 s sooner
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        }
        env.pop("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", None)  # `corelooper ray` comes from this plugin
        return subprocess.run(
            [sys.executable, "-m", "corelooper", *args, "-p", "no:tensorboard"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    pairs = [(r["step"], r["loss"]) for r in rows if "loss" in r and "train_runtime" not in r]
    assert len(pairs) == len({s for s, _ in pairs}), pairs  # the resume dropped the replayed steps
    return dict(pairs)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_matches_an_uninterrupted_one(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    ray = (
        f"[ray]\nnum_workers = 2\nmax_failures = 1\nnum_cpus = 2\n"
        f'storage_path = "{tmp_path / "ray"}"\nname = "digits"\n'
    )
    config = write_config(tmp_path / "ray.toml", tmp_path / "run", ray)
    run = corelooper(tmp_path, "ray", str(config), "-p", str(tmp_path / "killer.py"))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    assert (tmp_path / "killer.killed").exists()  # rank 1 really died at step 8
    resumed = [line for line in out.splitlines() if "restarted after a failure; resuming from" in line]
    # the newest complete checkpoint, of step 6: Ray's copy, or output_dir's checkpoint-6 when Ray
    # had not registered that report yet when the worker died (it then names step 3)
    assert len(resumed) == 1, out[-5000:]
    resumed_from = Path(resumed[0].split("resuming from ", 1)[1].strip())
    assert json.loads((resumed_from / "loop_state.json").read_text())["global_step"] == 6, resumed[0]
    assert "corelooper-ray: finished" in out and "'step': 12" in out
    snapshot = json.loads((tmp_path / "ray" / "digits" / "checkpoint_manager_snapshot.json").read_text())
    steps = [c["metrics"]["step"] for c in snapshot["checkpoint_results"]]
    assert steps[-2:] == [9, 12] and set(steps) <= {3, 6, 9, 12}, steps  # reported to Ray, with metrics
    last = tmp_path / "ray" / "digits" / snapshot["checkpoint_results"][-1]["checkpoint_dir_name"]
    assert (last / "manifest.json").is_file() and (last / "rng_state_1.pth").is_file()

    ref = corelooper(
        tmp_path, "run", str(write_config(tmp_path / "ref.toml", tmp_path / "ref")), "--nproc", "2"
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("run", "ref"))
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    got_losses, want_losses = (
        _losses(tmp_path / "run" / "metrics.jsonl"),
        _losses(tmp_path / "ref" / "metrics.jsonl"),
    )
    assert sorted(got_losses) == list(range(1, 13))
    assert max(abs(got_losses[s] - want_losses[s]) for s in want_losses) <= 1e-5


@pytest.mark.slow
def test_a_bad_ray_section_is_a_config_error_before_ray_starts(tmp_path):
    config = write_config(tmp_path / "bad.toml", tmp_path / "out", "[ray]\nnum_worker = 2\n")
    bad = corelooper(tmp_path, "ray", str(config), timeout=120)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "num_worker" in bad.stderr and "num_workers" in bad.stderr and "Traceback" not in bad.stderr


def test_help_lists_the_command_without_importing_ray_or_torch():
    code = (
        "import sys\nfrom corelooper.cli.app import main\nsys.argv = ['corelooper', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('IMPORTED', sorted(m for m in ('ray', 'torch') if m in sys.modules))\n"
    )
    env = {**os.environ}
    env.pop("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", None)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert " ray " in r.stdout and " slurm " in r.stdout and "IMPORTED []" in r.stdout, r.stdout
