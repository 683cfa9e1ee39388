"""Preemption and hard kills, on the real CLI in a subprocess.

- SIGTERM to ``corelooper run``: the step finishes, a checkpoint is written (a second SIGTERM and
  a SIGINT arrive *during* that save), ``on_train_end`` sees ``state.preempted``, exit 143;
  resuming ends bitwise-equal to an uninterrupted run, with the same per-step losses.
- ``kill -9`` while a checkpoint is being written (a plugin pauses inside ``state_dict``): the
  previous checkpoint is intact, the half-written one is never picked up, and the resume is exact.
- In-process: SIGINT through the Python API, handlers restored, no handler outside the main thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from corelooper.checkpoints.checkpoint import MANIFEST, list_checkpoints

STEPS = 12

TASK = """
import torch
from torch import nn


class Samples(torch.utils.data.Dataset):
    def __init__(self, n=40):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Dropout(0.3), nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)


def build(hidden=16):
    return Net(hidden)


def train_set(**_):
    return Samples()
"""

# A plugin the tests steer through files in $CKPT_TEST_DIR: it pauses inside a step or inside a
# checkpoint save (its state_dict) until told to go on, and records what on_train_end saw.
PLUGIN = """
import json
import os
import time
from pathlib import Path

DIR = Path(os.environ["CKPT_TEST_DIR"])
STEP = [0]


def _wait(name, timeout=60):
    end = time.time() + timeout
    while not (DIR / name).exists() and time.time() < end:
        time.sleep(0.01)


def on_step_end(state):
    STEP[0] = state.global_step
    if str(state.global_step) == os.environ.get("PAUSE_AT_STEP"):
        (DIR / "in_step").touch()
        _wait("go")


def state_dict():
    if str(STEP[0]) == os.environ.get("PAUSE_IN_SAVE_AT"):
        (DIR / "in_save").touch()
        _wait("go2", timeout=float(os.environ.get("SAVE_PAUSE", "60")))
    return {"step": STEP[0]}


def load_state_dict(d):
    STEP[0] = d["step"]


def corelooper_configure(plugins):
    import sys

    plugins.register_for_checkpointing("plugin", sys.modules[__name__])


def on_train_end(state):
    (DIR / "train_end.json").write_text(json.dumps({"preempted": state.preempted, "step": state.global_step}))
"""

CONFIG = f"""
[model]
factory = "task.py:build"
args = {{ hidden = 16 }}

[data]
train = "task.py:train_set"

[train]
output_dir = "out"
max_steps = {STEPS}
per_device_train_batch_size = 4
gradient_accumulation_steps = 2
learning_rate = 0.01
logging_steps = 1
save_steps = 4
seed = 7

[plugins]
local = ["plugin.py"]
"""


def make_project(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "task.py").write_text(textwrap.dedent(TASK))
    (root / "plugin.py").write_text(textwrap.dedent(PLUGIN))
    (root / "config.toml").write_text(CONFIG)
    (root / "ctl").mkdir()
    return root


def env_for(root: Path, **extra) -> dict:
    return {
        **os.environ,
        "CKPT_TEST_DIR": str(root / "ctl"),
        "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTHONHASHSEED": "0",
        **extra,
    }


def corelooper(root: Path, *args: str, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "corelooper", "run", "config.toml", *args],
        cwd=root,
        env=env_for(root, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"process exited ({proc.returncode}) before {path.name}: {proc.stderr.read()}"
            )
        if time.time() > end:
            proc.kill()
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.02)


def step_losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["event"] == "log" and "train_runtime" not in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run of the same config (in-process: same code, one subprocess less)."""
    from corelooper.config import Config
    from corelooper.loop import Loop

    root = make_project(tmp_path_factory.mktemp("ref") / "proj")
    saved_env, cwd = dict(os.environ), os.getcwd()
    os.environ.update(CKPT_TEST_DIR=str(root / "ctl"), CORELOOPER_DISABLE_PLUGIN_AUTOLOAD="1")
    try:
        os.chdir(root)
        Loop(config=Config.load(root / "config.toml"), blocked_plugins=["console"]).train()
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return root / "out"


def assert_same_final_model(out: Path, reference: Path) -> None:
    a, b = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_sigterm_saves_and_resume_is_exact(tmp_path, reference):
    root = make_project(tmp_path / "proj")
    ctl, out = root / "ctl", root / "out"
    proc = corelooper(root, PAUSE_AT_STEP="5", PAUSE_IN_SAVE_AT="5")
    wait_for(ctl / "in_step", proc)  # inside step 5 (after its optimizer step)
    proc.send_signal(signal.SIGTERM)
    (ctl / "go").touch()
    wait_for(ctl / "in_save", proc)  # the preemption checkpoint is being written
    proc.send_signal(signal.SIGTERM)  # impatient scheduler / user: must not corrupt it
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    (ctl / "go2").touch()
    code, err = finish(proc)
    assert code == 143, err
    assert "SIGTERM received" in err and "received again" in err
    assert "--resume-from-checkpoint latest" in err
    assert json.loads((ctl / "train_end.json").read_text()) == {"preempted": True, "step": 5}
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-4", "checkpoint-5"]
    assert (out / "checkpoint-5" / MANIFEST).exists()
    assert not (out / "model.safetensors").exists()  # not finished: no final model
    state = json.loads((out / "checkpoint-5" / "loop_state.json").read_text())
    assert state["global_step"] == 5 and state["preempted"] is True

    for f in ("in_step", "in_save", "train_end.json"):
        (ctl / f).unlink()
    code, err = finish(corelooper(root, "--resume-from-checkpoint", "latest"))
    assert code == 0, err
    assert json.loads((ctl / "train_end.json").read_text()) == {"preempted": False, "step": STEPS}
    assert_same_final_model(out, reference)
    assert step_losses(out) == step_losses(reference)
    assert sorted(step_losses(out)) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_kill_9_during_save_keeps_previous_checkpoint(tmp_path, reference):
    root = make_project(tmp_path / "proj")
    ctl, out = root / "ctl", root / "out"
    proc = corelooper(root, PAUSE_IN_SAVE_AT="8", SAVE_PAUSE="120")
    wait_for(ctl / "in_save", proc)  # checkpoint-8 is half written (weights, optimizer, ... on disk)
    before = {p.name: p.read_bytes() for p in (out / "checkpoint-4").iterdir()}
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    tmp = out / ".tmp-checkpoint-8"
    # plugin states are collected before the temp folder is made (the loop hands them to
    # save_checkpoint): a kill there leaves no folder, or one without a manifest
    assert not tmp.exists() or not (tmp / MANIFEST).exists()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-4"]
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-4").iterdir()} == before

    code, err = finish(corelooper(root, "--resume-from-checkpoint", "latest"))
    assert code == 0, err
    assert not tmp.exists()  # debris of the killed save is cleared
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    assert_same_final_model(out, reference)
    # metrics.jsonl reads as one run: the killed run's records after checkpoint-4 were dropped
    logged = [
        json.loads(line)["step"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["event"] == "log" and "loss" in json.loads(line)
    ]
    assert logged == list(range(1, STEPS + 1))
    assert step_losses(out) == step_losses(reference)


# -- in-process -------------------------------------------------------------------------------


@pytest.fixture
def _no_autoload(monkeypatch):
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")


def _loop(out: Path, plugins=()):
    import toys

    from corelooper.config import TrainArgs
    from corelooper.loop import Loop

    args = TrainArgs(
        output_dir=str(out),
        max_steps=8,
        save_strategy="no",
        per_device_train_batch_size=8,
        logging_steps=1,
        learning_rate=1e-2,
    )
    torch.manual_seed(0)
    return Loop(toys.mlp(), args, train_dataset=toys.Blobs(64), plugins=plugins, blocked_plugins=["console"])


class SelfSignal:
    name = "self_signal"

    def __init__(self, at: int, sig=signal.SIGINT):
        self.at, self.sig, self.ended_preempted = at, sig, None

    def on_step_end(self, state):
        if state.global_step == self.at:
            os.kill(os.getpid(), self.sig)

    def on_train_end(self, state):
        self.ended_preempted = state.preempted


@pytest.mark.usefixtures("_no_autoload")
def test_sigint_in_python_api_saves_and_restores_handlers(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    plugin = SelfSignal(at=3)
    loop = _loop(tmp_path / "out", [plugin])
    state = loop.train()  # save_strategy = "no": a preemption still writes its checkpoint
    assert state.preempted and state.global_step == 3 and plugin.ended_preempted is True
    assert state.stop_signal == signal.SIGINT  # the CLI exits with 128 + 2 = 130
    assert [p.name for p in list_checkpoints(tmp_path / "out")] == ["checkpoint-3"]
    assert {s: signal.getsignal(s) for s in before} == before
    # resume to the end, then compare with a straight run
    resumed = _loop(tmp_path / "out")
    resumed.train(resume_from_checkpoint="latest")
    straight = _loop(tmp_path / "straight")
    straight.train()
    a, b = resumed.model.state_dict(), straight.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.usefixtures("_no_autoload")
def test_train_in_a_thread_installs_no_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    result = {}

    def work():
        try:
            result["state"] = _loop(tmp_path / "out").train()
        except BaseException as e:  # would be "signal only works in main thread"
            result["error"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=120)
    assert "error" not in result, result.get("error")
    assert result["state"].global_step == 8
    assert signal.getsignal(signal.SIGTERM) is before


# -- two processes (gloo): the ranks agree on the step to stop at ---------------------------------

# Run in a fresh interpreter: accelerate's debug_launcher forks, and forking a process whose torch
# thread pools already ran (this pytest process) can deadlock the children.
DDP_SCRIPT = """
import json, os, signal, sys
from pathlib import Path

import torch

sys.path.insert(0, {tests!r})
os.environ["CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"] = "1"


def run(out, results, stop_at, resume):
    import toys
    from corelooper.config import TrainArgs
    from corelooper.loop import Loop

    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))

    class SignalRank0:  # only rank 0 is signalled: rank 1 must learn it through the all-reduce
        name = "signal_rank0"

        def on_step_end(self, state):
            if rank == 0 and state.global_step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)

    args = TrainArgs(output_dir=out, max_steps=8, save_strategy="no", per_device_train_batch_size=4,
                     logging_steps=1, learning_rate=1e-2)
    torch.manual_seed(0)
    loop = Loop(toys.mlp(), args, train_dataset=toys.Blobs(64), plugins=[SignalRank0()],
                blocked_plugins=["console"])
    state = loop.train(resume_from_checkpoint=resume)
    params = torch.cat([p.detach().flatten() for p in loop.model.parameters()]).tolist()
    Path(results, f"rank{{loop.backend.process_index}}.json").write_text(json.dumps(
        {{"preempted": state.preempted, "step": state.global_step, "params": params}}))


if __name__ == "__main__":
    from accelerate import debug_launcher

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # its lazy imports, once, before forking
    tmp = Path(sys.argv[1])
    for name, out, stop_at, resume in (("stopped", "out", 3, None), ("resumed", "out", None, "latest"),
                                       ("straight", "straight", None, None)):
        (tmp / name).mkdir()
        debug_launcher(run, args=(str(tmp / out), str(tmp / name), stop_at, resume), num_processes=2)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_stop_at_the_same_step_and_resume_exactly(tmp_path):
    script = tmp_path / "ddp_preempt.py"
    script.write_text(DDP_SCRIPT.format(tests=str(Path(__file__).parent)))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = {
        name: {r: json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in (0, 1)}
        for name in ("stopped", "resumed", "straight")
    }
    stopped, resumed, straight = res["stopped"], res["resumed"], res["straight"]
    assert stopped[0]["preempted"] and stopped[1]["preempted"]
    assert stopped[0]["step"] == stopped[1]["step"] == 3
    ckpt = tmp_path / "out" / "checkpoint-3"
    assert (ckpt / "rng_state_0.pth").exists() and (ckpt / "rng_state_1.pth").exists()
    for r in (0, 1):
        assert resumed[r]["step"] == straight[r]["step"] == 8 and not resumed[r]["preempted"]
        assert resumed[r]["params"] == straight[r]["params"]


def _lagged_agreement_worker(rank: int, port: int, lags, signal_rank: int, signal_step: int, out) -> None:
    import torch.distributed as dist

    from corelooper.builtin.preemption import Preemption

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # The two attributes Preemption.requested reads; the collective under it is real gloo.
    backend = type("Backend", (), {"num_processes": 2, "device": torch.device("cpu")})()
    for lag in lags:  # a fresh Preemption per lag, as each run makes its own (CPU: no work left pending)
        p = Preemption(lag)
        answers = []
        for step in range(1, 10):
            if rank == signal_rank and step == signal_step:
                p.signum = signal.SIGTERM  # what the handler notes; only this rank got the signal
            answers.append(p.requested(backend))
        out.put((lag, rank, answers))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def lagged_agreement() -> dict[int, dict[int, list[bool]]]:
    """``{lag: {rank: answers}}`` for lags 0 and 2, one after the other on one pair of spawned gloo
    processes (a pair per lag paid two more interpreter and torch start-ups)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    lags = (0, 2)
    procs = [ctx.Process(target=_lagged_agreement_worker, args=(r, port, lags, 1, 3, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, dict[int, list[bool]]] = {lag: {} for lag in lags}
    for _ in range(len(lags) * len(procs)):
        lag, rank, answers = out.get(timeout=120)
        results[lag][rank] = answers
    for p in procs:
        p.join(timeout=60)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, 2])
def test_ranks_agree_on_the_stop_step_with_and_without_the_accelerator_lag(lag, lagged_agreement):
    """The accelerator path (a flag reduced asynchronously, read ``lag`` steps later, so no step
    waits for the device) on 2 real gloo processes: a signal on rank 1 at step 3 stops both ranks
    at step 3 + lag, the same step on both. (Pinned memory and CUDA events exist only on a GPU:
    on the CPU the same code copies synchronously.)"""
    first_stop = {rank: answers.index(True) + 1 for rank, answers in lagged_agreement[lag].items()}
    assert first_stop == {0: 3 + lag, 1: 3 + lag}
