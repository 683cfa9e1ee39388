"""``corelooper run --nproc 2`` stopped by signals, and killed, as a real launcher + 2 workers.

- SIGINT to the launcher (ZeRO-3, ``--verbose``): every rank finishes step 3, one checkpoint,
  exit 130; the third-party warnings --verbose asks for are shown.
- SIGTERM to rank 1 only (ZeRO-3, quiet by default): the same stop on both ranks, exit 143,
  each message once, and none of DeepSpeed's / torch's warnings and banners.
- ``kill -9`` of the launcher: both workers are gone within 10 s and write nothing more.

A plugin pauses every rank inside step 3 (and writes its pid) until the test says go.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corelooper.checkpoints.checkpoint import list_checkpoints

TASK = """
import torch
from torch import nn


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.randint(0, 3, (), generator=g)}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


def build():
    torch.manual_seed(0)
    return Net()


def train_set(**_):
    return Samples()
"""

PLUGIN = """
import json
import os
import time
from pathlib import Path

DIR = Path(os.environ["CTL_DIR"])


def on_step_end(state):
    if state.global_step == 3:
        rank = os.environ["RANK"]
        (DIR / f"in_step.{rank}").write_text(str(os.getpid()))
        end = time.time() + 120
        while not (DIR / "go").exists() and time.time() < end:
            time.sleep(0.02)


def on_train_end(state):
    if state.is_world_process_zero:
        (DIR / "train_end.json").write_text(json.dumps({"preempted": state.preempted, "step": state.global_step}))
"""

CONFIG = """
[model]
factory = "task.py:build"
[data]
train = "task.py:train_set"
[train]
output_dir = "out"
max_steps = 8
per_device_train_batch_size = 4
logging_steps = 1
save_strategy = "steps"
save_steps = 4
disable_tqdm = true
[plugins]
local = ["pause.py"]
"""


def project(tmp_path: Path, deepspeed: bool) -> Path:
    root = tmp_path / "proj"
    (root / "ctl").mkdir(parents=True)
    (root / "task.py").write_text(TASK)
    (root / "pause.py").write_text(PLUGIN)
    (root / "config.toml").write_text(CONFIG + ("[deepspeed]\nzero_stage = 3\n" if deepspeed else ""))
    return root


def start(root: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(root), "CTL_DIR": str(root / "ctl"), "PYTHONHASHSEED": "0"}
    env.pop("OMP_NUM_THREADS", None)  # torchrun's banner about it must not show
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "corelooper",
            "run",
            "config.toml",
            "--nproc",
            "2",
            "-p",
            "no:tensorboard",
            *extra,
        ],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def paused_pids(root: Path, proc: subprocess.Popen, timeout: float = 240) -> list[int]:
    """Wait until both ranks pause inside step 3; their pids."""
    end = time.time() + timeout
    files = [root / "ctl" / f"in_step.{r}" for r in (0, 1)]
    while not all(f.exists() and f.read_text() for f in files):
        if proc.poll() is not None or time.time() > end:
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"the run never reached step 3 (exit {proc.returncode}):\n{err[-4000:]}")
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def wait_exited(pids: list[int], hang_guard_s: float = 300) -> None:
    """Block until each process has exited (its pidfd becomes readable then, zombie or not); a
    survivor only makes it return after ``hang_guard_s``, so the test fails instead of hanging."""
    import select

    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], hang_guard_s)
        finally:
            os.close(fd)


def assert_stopped_once(root: Path, code: int, out: str, err: str, want: int) -> None:
    assert code == want, err[-4000:]
    assert [p.name for p in list_checkpoints(root / "out")] == ["checkpoint-3"]
    assert json.loads((root / "ctl" / "train_end.json").read_text()) == {"preempted": True, "step": 3}
    assert not (root / "out" / "model.safetensors").exists()  # interrupted: no final model
    assert err.count("stopped at step 3; checkpoint saved") == 1, err[-3000:]
    assert out.count("saved ") == 1 and out.count("corelooper: training") == 1, out
    for noise in ("Traceback", "SignalException", "error", "ChildFailedError"):
        assert noise not in err, err[-3000:]


@pytest.mark.slow
def test_sigint_to_the_launcher_stops_every_rank_after_one_checkpoint(tmp_path):
    pytest.importorskip("deepspeed")
    root = project(tmp_path, deepspeed=True)
    proc = start(root, "--verbose")
    paused_pids(root, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    (root / "ctl" / "go").touch()
    code, out, err = finish(proc)
    assert_stopped_once(root, code, out, err, 130)
    assert err.count("SIGINT received") == 1, err[-3000:]
    assert "FutureWarning" in err  # --verbose: torch.distributed's deprecations under ZeRO-3 are shown


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_every_rank_quietly(tmp_path):
    pytest.importorskip("deepspeed")
    root = project(tmp_path, deepspeed=True)
    proc = start(root)
    pids = paused_pids(root, proc)
    os.kill(pids[1], signal.SIGTERM)
    time.sleep(0.5)
    (root / "ctl" / "go").touch()
    code, out, err = finish(proc)
    assert_stopped_once(root, code, out, err, 143)
    for noise in ("Warning", "[WARNING]", "[INFO]", "OMP_NUM_THREADS", "DeepSpeed"):
        assert noise not in err + out, (err + out)[-3000:]


@pytest.mark.slow
def test_kill_9_of_the_launcher_leaves_no_worker_behind(tmp_path):
    root = project(tmp_path, deepspeed=False)
    proc = start(root)
    pids = paused_pids(root, proc)
    proc.kill()
    proc.communicate(timeout=30)
    (root / "ctl" / "go").touch()  # a surviving worker would now train on and save checkpoint-4
    # a worker gone has written all it ever will: wait for both to exit (they die at once, by
    # PR_SET_PDEATHSIG), then look at what is on disk
    wait_exited(pids)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not survivors
    assert list_checkpoints(root / "out") == []
    assert not (root / "ctl" / "train_end.json").exists()
