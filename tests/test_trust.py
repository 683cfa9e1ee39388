"""Runs you can trust (issue 14), through the real CLI: verified checkpoints with fallback, one
run per output_dir, relocatable runs, I/O errors named as I/O on a real tmpfs, signals at
start-up, --set on resume, no pickle from a checkpoint, kill -9 anywhere."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from run_here import train_here

from corelooper.checkpoints.lock import RunLock
from corelooper.checkpoints.manifest import MANIFEST, write_manifest

TASK = """
import os, time
import torch
from torch import nn


class Samples(torch.utils.data.Dataset):
    def __init__(self, n=32, bad_from=None):
        self.n, self.bad_from = n, bad_from

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        if self.bad_from is not None and i >= self.bad_from:
            x = x * float("inf")
        return {"x": x, "labels": torch.tensor(i % 3)}


class Net(nn.Module):
    def __init__(self, hidden, blow_after=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Linear(hidden, 3))
        self.calls, self.blow_after = 0, blow_after

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        if self.blow_after is not None and self.calls > self.blow_after:
            out = out * float("inf")  # from this forward on: inf loss, NaN gradients and weights
        return out


def build(hidden=16, sleep=0.0, blow_after=None):
    time.sleep(sleep)
    torch.manual_seed(0)
    return Net(hidden, blow_after)


def train_set(bad_from=None, **_):
    return Samples(32, bad_from)


def eval_set(**_):
    return Samples(16)
"""


def write_project(root: Path, out: Path, extra: str = "", **train) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "task.py").write_text(textwrap.dedent(TASK))
    keys = {
        "max_steps": 4,
        "per_device_train_batch_size": 8,
        "save_steps": 2,
        "learning_rate": 0.01,
        "logging_steps": 1,
        "max_grad_norm": 0.0,
        **train,
    }
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
    (root / "config.toml").write_text(f'''
[model]
factory = "task.py:build"

[data]
train = "task.py:train_set"
{extra}
[train]
output_dir = "{out}"
{body}
''')
    return root / "config.toml"


def cli(root: Path, *args: str, timeout: float = 120, cmd: str = "run") -> subprocess.CompletedProcess:
    env = {**os.environ, "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONHASHSEED": "0"}
    argv = [sys.executable, "-m", "corelooper", cmd, *(["config.toml"] if cmd == "run" else []), *args]
    return subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def one_paragraph(result, code: int, *needles: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """checkpoint-2, checkpoint-4 and the final model, once (in-process: the tests resume it
    through the CLI)."""
    root = tmp_path_factory.mktemp("run")
    train_here(write_project(root, root / "out"))
    assert (root / "out" / "model.safetensors").is_file()
    return root


@pytest.fixture(scope="module")
def resumed_over_debris(finished, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of the finished run, left as kills leave one: the lock file of a dead run (its PID
    written, no flock held), a temp checkpoint-6 whose manifest write was cut short (a kill, or
    ENOSPC), a half-deleted checkpoint and a stray temp file (a kill at the final model's rename);
    then resumed to step 6 by the CLI. One run serves the three tests that check what start-up did
    with each (it was three runs)."""
    root = tmp_path_factory.mktemp("debris") / "proj"
    shutil.copytree(finished, root)
    write_project(root, root / "out")
    out = root / "out"
    (out / ".corelooper.lock").write_text('{"pid": 999999, "host": "gone"}\n')
    shutil.copytree(out / "checkpoint-4", out / ".tmp-checkpoint-6")
    (out / ".tmp-checkpoint-6" / MANIFEST).write_text("")
    shutil.copytree(out / "checkpoint-2", out / ".deleting-checkpoint-1")
    (out / ".tmpab12cd").write_bytes(os.urandom(4096))
    return root, cli(root, "--resume-from-checkpoint", "latest", "--set", "train.max_steps=6")


@pytest.fixture
def project(finished, tmp_path) -> Path:
    root = tmp_path / "proj"
    shutil.copytree(finished, root)
    write_project(root, root / "out")
    return root


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


# -- checkpoints verified by content ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng_state_0.pth", "loop_state.json"])
def test_same_size_corruption_is_caught(project, name):
    ckpt = project / "out" / "checkpoint-4"
    if name == "loop_state.json":  # an edited global_step, same length
        path = ckpt / name
        path.write_text(path.read_text().replace('"global_step": 4', '"global_step": 5'))
    else:
        flip_byte(ckpt / name)
    verify = cli(project, str(project / "out"), cmd="verify")
    assert verify.returncode == 5
    assert f"checkpoint-4: FAILED: {name} fails its checksum" in verify.stdout
    assert "checkpoint-2: ok" in verify.stdout and "latest: checkpoint-2" in verify.stdout
    alone = cli(project, str(ckpt), cmd="verify")  # the checkpoint alone: the same line, the same exit
    assert (
        alone.returncode == 5 and alone.stdout.strip() == f"checkpoint-4: FAILED: {name} fails its checksum"
    )
    named = cli(project, "--resume-from-checkpoint", str(ckpt))
    one_paragraph(named, 5, str(ckpt / name), "does not match its checksum")
    latest = cli(project, "--resume-from-checkpoint", "latest")
    assert latest.returncode == 0, latest.stderr
    assert (
        f"resuming from checkpoint-2; skipped newer checkpoint-4 ({name} fails its checksum)" in latest.stderr
    )


@pytest.mark.slow
def test_temp_folder_with_a_manifest_is_never_promoted(resumed_over_debris):
    root, result = resumed_over_debris  # .tmp-checkpoint-6: a kill (or ENOSPC) during the manifest write
    out = root / "out"
    assert result.returncode == 0, result.stderr
    assert not (out / ".tmp-checkpoint-6").exists()
    assert json.loads((out / "checkpoint-6" / "loop_state.json").read_text())["global_step"] == 6
    assert cli(root, str(out), cmd="verify").returncode == 0


@pytest.mark.slow
def test_startup_clears_half_deleted_folders_and_stray_tmp_files(resumed_over_debris):
    root, result = resumed_over_debris  # .tmpab12cd: a kill at the final model's rename
    out = root / "out"
    assert result.returncode == 0, result.stderr
    assert not (out / ".deleting-checkpoint-1").exists() and not (out / ".tmpab12cd").exists()


def test_rotation_renames_away_before_deleting(tmp_path):
    from corelooper.checkpoints.run_dir import list_checkpoints, rotate_checkpoints

    for n in (1, 2, 3):
        (tmp_path / f"checkpoint-{n}").mkdir()
        (tmp_path / f"checkpoint-{n}" / "f").write_text("x")
    calls = []
    real = shutil.rmtree

    def spy(path, *a, **k):
        calls.append(Path(path).name)
        real(path, *a, **k)

    shutil.rmtree = spy
    try:
        deleted = rotate_checkpoints(tmp_path, 1, keep=tmp_path / "checkpoint-3")
    finally:
        shutil.rmtree = real
    assert [p.name for p in deleted] == ["checkpoint-1", "checkpoint-2"]
    assert calls == [".deleting-checkpoint-1", ".deleting-checkpoint-2"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]


# -- non-finite weights ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_nonfinite_weights_are_never_saved_and_the_finite_checkpoint_survives(tmp_path):
    """The model's output is inf from step 3: its weights turn NaN. With save_total_limit=1 the
    finite checkpoint-2 must survive, and neither checkpoint-4 nor a final model is written."""
    root = tmp_path / "p"
    write_project(root, root / "out", save_total_limit=1)
    cfg = (
        (root / "config.toml")
        .read_text()
        .replace('factory = "task.py:build"', 'factory = "task.py:build"\nargs = { blow_after = 2 }')
    )
    (root / "config.toml").write_text(cfg)
    result = cli(root)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "checkpoint-2" in result.stderr, result.stderr  # the last finite checkpoint is named
    out = root / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / "model.safetensors").exists()
    from corelooper.checkpoints.run_dir import last_finite_checkpoint

    assert last_finite_checkpoint(out) == out / "checkpoint-2"


def test_all_finite_is_one_reduction_that_sees_nan_and_inf():
    from corelooper.checkpoints.weights import all_finite

    sd = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16), "i": torch.arange(3)}
    assert bool(all_finite(sd))
    for bad in (float("nan"), float("inf"), -float("inf")):
        sd2 = dict(sd, b=torch.tensor([1.0, bad], dtype=torch.bfloat16))
        assert not bool(all_finite(sd2))
    big = {"h": torch.full((4,), 60000.0, dtype=torch.float16)}  # a norm would overflow fp16; a max does not
    assert bool(all_finite(big))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # one device and dtype: one group
        one = {"w": torch.ones(64, 64, dtype=dtype), "b": torch.zeros(64, dtype=dtype)}
        assert all_finite(one)
        for bad in (float("nan"), float("inf"), -float("inf")):
            one["b"][2] = bad
            assert not all_finite(one)
        one["b"][2] = 0.0
        one["w"][:] = (
            torch.finfo(dtype).max / 2
        )  # finite; its 2-norm screen overflows: the exact test decides
        assert not math.isfinite(float(torch.linalg.vector_norm(one["w"])))
        assert all_finite(one)
        one["w"][5, 5] = float("nan")
        assert not all_finite(one)


# -- one run per output_dir ------------------------------------------------------------------------------


@pytest.mark.slow
def test_second_run_resume_or_overwrite_into_a_locked_folder_is_refused(project, resumed_over_debris):
    out = project / "out"
    lock = RunLock.acquire(out)  # a real flock, held by this (another) process
    try:
        for args in (("--resume-from-checkpoint", "latest"), ("--set", "train.overwrite_output_dir=true")):
            result = cli(project, *args)
            one_paragraph(result, 5, "in use by another run", f"PID {os.getpid()}", socket.gethostname())
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    finally:
        lock.release()
    # the lock file of a dead run (its PID written, no flock held) is simply taken over
    root, result = resumed_over_debris  # (that run's resume: one process for this and two tests above)
    assert json.loads((root / "out" / ".corelooper.lock").read_text())["pid"] != 999999
    assert result.returncode == 0, result.stderr


# -- relocatable runs -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_moved_run_folder_resumes_and_finishes(tmp_path):
    root = tmp_path / "a"
    write_project(
        root,
        root / "out",
        extra='eval = "task.py:eval_set"\n',
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
    )
    result = cli(root, "--set", "train.max_steps=4")
    assert result.returncode == 0, result.stderr
    (root / "out" / "model.safetensors").unlink()  # as if it were stopped at step 4
    moved = tmp_path / "b"
    shutil.move(str(root), str(moved))
    state = json.loads((moved / "out" / "checkpoint-4" / "loop_state.json").read_text())
    assert state["best_model_checkpoint"] in ("checkpoint-2", "checkpoint-4")  # a name, not a path
    result = cli(moved, "--resume-from-checkpoint", "latest", "--set", f'train.output_dir="{moved / "out"}"')
    assert result.returncode == 0, result.stderr
    assert (moved / "out" / "model.safetensors").is_file()
    assert "resume: train.max_steps 4 -> 6 (applied)" in result.stderr


# -- I/O errors named as I/O ------------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def mount(size: str, ro: bool = False) -> Path:
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True, text=True
        )
        if r.returncode:
            pytest.fail(f"mount tmpfs failed (the tests need root): {r.stderr}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.slow
def test_disk_full_on_a_real_tmpfs(tmp_path, tmpfs):
    disk = tmpfs("160k")
    root = tmp_path / "p"
    write_project(root, disk / "out", max_steps=60, save_steps=1)
    cfg = (
        (root / "config.toml")
        .read_text()
        .replace('factory = "task.py:build"', 'factory = "task.py:build"\nargs = { hidden = 256 }')
    )
    (root / "config.toml").write_text(cfg)
    result = cli(root)
    one_paragraph(result, 5, "disk full (ENOSPC, errno 28) while", str(disk / "out"), "is intact")
    assert "the model" not in result.stderr
    ckpts = sorted((disk / "out").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert ckpts, "at least one checkpoint fit"
    assert f"{ckpts[-1].name} is intact" in result.stderr
    verify = cli(root, str(disk / "out"), cmd="verify")
    assert f"{ckpts[-1].name}: ok" in verify.stdout, verify.stdout


@pytest.mark.slow
def test_disk_full_while_logging_is_named_as_io(tmp_path, tmpfs):
    """12 KiB of tmpfs: the lock file and config.toml take a page each, metrics.jsonl fills the third."""
    disk = tmpfs("12k")
    root = tmp_path / "p"
    write_project(root, disk / "out", max_steps=400, save_strategy="no")
    result = cli(root)
    one_paragraph(result, 5, "disk full (ENOSPC, errno 28) while writing metrics.jsonl", str(disk / "out"))
    assert "plugin" not in result.stderr.lower() and "the model" not in result.stderr


@pytest.mark.slow
def test_read_only_output_dir_and_a_file_in_its_place(tmp_path, tmpfs):
    ro = tmpfs("1m", ro=True)
    root = tmp_path / "p"
    write_project(root, ro / "out")
    one_paragraph(cli(root), 5, "read-only file system (EROFS, errno 30)", str(ro / "out"))
    (tmp_path / "afile").write_text("x")
    write_project(root, tmp_path / "afile")
    one_paragraph(cli(root), 5, f"{tmp_path / 'afile'!s}' is a file, not a folder")


@pytest.mark.slow
def test_corrupt_config_in_a_checkpoint_and_a_binary_config(project):
    ckpt = project / "out" / "checkpoint-4"
    (ckpt / "config.toml").write_bytes(b"\xff\xfe\x00garbage")
    write_manifest(ckpt)  # the manifest agrees: the reader itself must name the file
    one_paragraph(
        cli(project, "--resume-from-checkpoint", str(ckpt)),
        5,
        str(ckpt / "config.toml"),
        "UnicodeDecodeError",
    )
    (project / "config.toml").write_bytes(os.urandom(64) + b"\xff")
    one_paragraph(cli(project), 2, "config.toml", "not valid TOML")


# -- signals and settings on resume -----------------------------------------------------------------------


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 75), (signal.SIGINT, 76)])
def test_a_signal_during_startup_exits_75_or_76_without_a_traceback(tmp_path, sig, code):
    root = tmp_path / "p"
    write_project(root, root / "out")
    (root / "config.toml").write_text(
        (root / "config.toml")
        .read_text()
        .replace('factory = "task.py:build"', 'factory = "task.py:build"\nargs = { sleep = 6.0 }')
    )
    env = {**os.environ, "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "corelooper", "run", "config.toml"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3.0)  # the model factory sleeps 6 s: start-up, after the handlers are in
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert (
        f"{sig.name} received outside training" in err and "no checkpoint" in err and "Traceback" not in err
    )
    assert not list((root / "out").glob("checkpoint-*")) if (root / "out").exists() else True


@pytest.mark.slow
def test_learning_rate_override_on_resume_is_applied_and_optimizer_change_refused(project):
    out = project / "out"
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lr3 = next(r["learning_rate"] for r in first if r.get("step") == 3 and "learning_rate" in r)
    refused = cli(
        project, "--resume-from-checkpoint", str(out / "checkpoint-2"), "--set", 'train.optim="sgd"'
    )
    one_paragraph(refused, 2, "train.optim", "-> 'sgd'", "drop these overrides")
    result = cli(
        project, "--resume-from-checkpoint", str(out / "checkpoint-2"), "--set", "train.learning_rate=0.001"
    )
    assert result.returncode == 0, result.stderr
    assert "resume: train.learning_rate 0.01 -> 0.001 (applied)" in result.stderr
    again = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    new3 = next(r["learning_rate"] for r in again if r.get("step") == 3 and "learning_rate" in r)
    assert new3 == pytest.approx(lr3 / 10, rel=1e-9)  # the schedule's position kept, scaled


# -- no pickle from a checkpoint ---------------------------------------------------------------------------


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def resume_here(project: Path, ckpt: Path) -> str:
    """The error of ``corelooper run config.toml --resume-from-checkpoint CKPT`` in ``project``,
    from this process (what the CLI prints after "corelooper: error: "); fails unless it is the
    exit-5 kind (the CLI exits with a CorelooperError's exit_code, 1 for anything else)."""
    from corelooper.config import Config
    from corelooper.errors import CorelooperError
    from corelooper.loop import Loop

    cfg = Config.load(project / "config.toml").replace("train", resume_from_checkpoint=str(ckpt))
    with pytest.MonkeyPatch.context() as mp, pytest.raises(CorelooperError) as refused:
        mp.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
        with Loop(config=cfg) as loop:  # as the CLI's run builds it
            loop.train()
    assert refused.value.exit_code == 5, refused.value
    return str(refused.value)


@pytest.mark.slow
def test_a_payload_in_every_file_of_a_checkpoint_never_runs(project, tmp_path):
    """Each file's reader is tried in this process, through the Loop the CLI builds (a CLI process
    per file was ~10 s of start-up each); the optimizer's file also goes through the real CLI end
    to end, which must print that same error."""
    ckpt = project / "out" / "checkpoint-4"
    marker = tmp_path / "PWNED"
    errors = {}
    for path in sorted(p for p in ckpt.iterdir() if p.name != MANIFEST):
        original = path.read_bytes()
        torch.save({"state": Payload(str(marker)), "x": torch.ones(1)}, path)
        write_manifest(ckpt)  # the manifest agrees: only the readers stand between payload and resume
        errors[path.name] = resume_here(project, ckpt)  # exit 5
        assert not marker.exists(), f"a payload in {path.name} ran"
        assert str(path) in errors[path.name] or path.name in errors[path.name], errors[path.name]
        path.write_bytes(original)
    path = ckpt / "optimizer.pt"
    torch.save({"state": Payload(str(marker)), "x": torch.ones(1)}, path)
    write_manifest(ckpt)
    result = cli(project, "--resume-from-checkpoint", str(ckpt))
    assert not marker.exists(), "a payload in optimizer.pt ran"
    one_paragraph(result, 5, f"corelooper: error: {errors['optimizer.pt']}")


# -- kill -9 anywhere --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_anywhere_resumes_bitwise_exact(tmp_path):
    from safetensors.torch import load_file

    ref_root, root = tmp_path / "ref", tmp_path / "run"
    steps = 24
    write_project(
        ref_root,
        ref_root / "out",
        max_steps=steps,
        save_steps=1,
        save_total_limit=2,
        per_device_train_batch_size=4,
    )
    write_project(
        root, root / "out", max_steps=steps, save_steps=1, save_total_limit=2, per_device_train_batch_size=4
    )
    train_here(ref_root / "config.toml")  # the reference: the same Loop in-process, one process less
    env = {**os.environ, "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONHASHSEED": "0"}
    rng = random.Random(14)
    kills = 0
    for _ in range(6):
        resume = ["--resume-from-checkpoint", "latest"] if list((root / "out").glob("checkpoint-*")) else []
        proc = subprocess.Popen(
            [sys.executable, "-m", "corelooper", "run", "config.toml", *resume],
            cwd=root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(rng.uniform(1.5, 4.0))
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.wait(timeout=60)
    resume = ["--resume-from-checkpoint", "latest"] if list((root / "out").glob("checkpoint-*")) else []
    final = subprocess.run(
        [sys.executable, "-m", "corelooper", "run", "config.toml", *resume],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if final.returncode != 0 and "already holds a run" in final.stderr:  # finished before: nothing to do
        pass
    else:
        assert final.returncode == 0, final.stderr
    assert kills >= 1
    ref = load_file(ref_root / "out" / "model.safetensors")
    got = load_file(root / "out" / "model.safetensors")
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


# -- config problems known at start-up -------------------------------------------------------------------


@pytest.mark.slow
def test_eval_without_eval_data_and_an_impossible_best_metric_fail_at_startup(tmp_path):
    root = tmp_path / "p"
    write_project(root, root / "out", eval_strategy="steps", eval_steps=2)
    one_paragraph(cli(root), 2, "train.eval_strategy = 'steps', but there is no evaluation data")
    assert not list((root / "out").glob("checkpoint-*")) if (root / "out").exists() else True
    write_project(
        root,
        root / "out",
        extra='eval = "task.py:eval_set"\n',
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="accuracy",
    )
    one_paragraph(cli(root), 2, "metric_for_best_model = 'accuracy'", "no compute_metrics is set")
    assert not list((root / "out").glob("checkpoint-*"))


def _check_finite_on_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo processes: rank 1's weights hold a NaN, rank 0's are finite."""
    import atexit

    import torch.distributed as dist

    from corelooper.backends.base import TorchDistributedCollectives, settle_process_group_threads
    from corelooper.checkpoints.checkpoint import NonFiniteWeights, check_finite

    atexit.register(
        settle_process_group_threads
    )  # as every backend does (a spawned child exits through teardown)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    backend = TorchDistributedCollectives()
    backend._set_rank_attributes(on_cuda=False)
    state = {"w": torch.ones(8, 8), "b": torch.tensor([0.0, float("nan") if rank == 1 else 1.0])}
    try:
        check_finite(state, backend, "checkpoint checkpoint-3", Path(out))
        verdict = "written"
    except NonFiniteWeights:
        verdict = "refused"
    check_finite({"w": torch.ones(2)}, backend, "checkpoint checkpoint-4", Path(out))  # all finite: no raise
    Path(out, f"rank{rank}").write_text(verdict)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_to_refuse_weights_when_one_rank_holds_a_nan(tmp_path):
    """Sharded weights: the rank that sees a NaN and the ranks that do not must all refuse
    (one reduce), or the others would wait for it in the next collective."""
    from cluster_task import free_port

    torch.multiprocessing.spawn(_check_finite_on_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["refused", "refused"]
