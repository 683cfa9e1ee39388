"""Hangs: 2 real processes (gloo); rank 1 sleeps in a hook, the watchdog ends the run with a report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from doctor_fixtures import _only_named_plugins  # noqa: F401  (autouse)

HERE = Path(__file__).parent
HANG_TIMEOUT = 8.0
SLEEP_LINE = next(
    n
    for n, line in enumerate((HERE / "hang_task.py").read_text().splitlines(), 1)
    if "time.sleep(600)" in line
)
START_UP = 90  # two torch processes starting on a loaded 2-core machine


def _config(tmp_path: Path, hang_timeout: float = HANG_TIMEOUT, ddp_timeout: int = 1800) -> Path:
    task = HERE / "hang_task.py"
    path = tmp_path / "config.toml"
    path.write_text(f"""
[model]
factory = "{task}:model"
[data]
train = "{task}:train"
[train]
output_dir = "{tmp_path / "run"}"
max_steps = 6
per_device_train_batch_size = 4
logging_steps = 1
save_strategy = "no"
disable_tqdm = true
ddp_timeout = {ddp_timeout}
[plugins]
enable = ["doctor"]
local = ["{task}"]
[doctor]
hang_timeout = {hang_timeout}
""")
    return path


def _run(tmp_path: Path, config: Path, timeout: float) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"}
    env.update(
        TMPDIR=str(tmp_path), PYTHONPATH=f"{HERE}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1"
    )
    corelooper = Path(sys.executable).parent / "corelooper"
    proc = subprocess.run(
        [str(corelooper), "run", str(config), "--nproc", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_rank_stuck_in_a_hook_ends_the_run_with_one_paragraph(tmp_path):
    # both ranks must be gone within hang_timeout + 30 s of the hang (plus start-up)
    returncode, out = _run(tmp_path, _config(tmp_path), START_UP + HANG_TIMEOUT + 30)
    assert returncode != 0, out
    doctor = tmp_path / "run" / "doctor"
    report = (doctor / "hang-report.txt").read_text()
    assert f"rank 1 has been in on_step_end (hang_task.py:{SLEEP_LINE})" in report, report
    assert "at step 3 while rank 0 waits in all_reduce at step 3" in report, report
    assert report.strip() in out  # said once, by rank 0
    for rank in (0, 1):
        stacks = (doctor / f"hang-rank{rank}.txt").read_text()
        assert "Thread" in stacks and "most recent call first" in stacks
    assert 'File "' in (doctor / "hang-rank1.txt").read_text()
    assert f'hang_task.py", line {SLEEP_LINE} in on_step_end' in (doctor / "hang-rank1.txt").read_text()
    # and the post-mortem shows it
    env = {k: v for k, v in os.environ.items() if k != "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"}
    post = subprocess.run(
        [str(Path(sys.executable).parent / "corelooper"), "doctor", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert report.strip() in post.stdout and "advice: hang: read the stacks" in post.stdout
    assert "not finished: it hung (the report is below)" in post.stdout


@pytest.mark.slow
def test_ddp_timeout_reaches_the_process_group(tmp_path):
    """Watchdog off: the gloo collective itself gives up after train.ddp_timeout seconds."""
    returncode, out = _run(tmp_path, _config(tmp_path, hang_timeout=0.0, ddp_timeout=5), START_UP + 60)
    assert returncode != 0, out
    assert "Timed out waiting 5000ms" in out, out
    assert not (tmp_path / "run" / "doctor" / "hang-report.txt").exists()


def test_watchdog_timeout_follows_the_median_step_inside_steps_only(tmp_path):
    from corelooper_doctor.hang import Watchdog

    w = Watchdog(str(tmp_path), 0, 1, timeout=300.0, step_factor=20.0)
    assert w.effective_timeout() == 300.0  # the first step: compilation, warm-up
    for t in (2.0, 2.5, 3.0):
        w.step_time(t)
    w.long_phase = False  # inside a step
    assert w.effective_timeout() == 50.0  # 20 x median 2.5 s
    w.step_times[:] = [0.01] * 3
    assert w.effective_timeout() == 30.0  # never under 30 s
    w.long_phase = True  # between steps: evaluation, checkpoints
    assert w.effective_timeout() == 300.0


def test_one_process_hang_writes_its_stack_and_exits_non_zero(tmp_path):
    import threading

    from corelooper_doctor.hang import EXIT_CODE, Watchdog

    codes, done = [], threading.Event()

    def fake_exit(code):  # os._exit would end pytest; the rest is the real thread and files
        codes.append(code)
        done.set()

    w = Watchdog(str(tmp_path), 0, 1, timeout=0.5, step_factor=0.0, exit_fn=fake_exit)
    w.progress(7, "on_step_end")
    w.start()
    assert done.wait(30)
    assert codes == [EXIT_CODE]
    report = (tmp_path / "doctor" / "hang-report.txt").read_text()
    assert report.startswith("doctor: the run hung: rank 0 has been in ")
    assert "at step 7" in report
    assert "most recent call first" in (tmp_path / "doctor" / "hang-rank0.txt").read_text()
