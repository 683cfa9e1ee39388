"""``corelooper doctor RUN_DIR``: the post-mortem, through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from doctor_fixtures import _only_named_plugins  # noqa: F401  (autouse)
from doctor_toys import OomAt, make_loop, samples
from test_spikes import SPIKE_STEP, _data, _linear

from corelooper.errors import TrainingError

CORELOOPER = Path(sys.executable).parent / "corelooper"
HERE = Path(__file__).parent


def doctor(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"}
    env["PYTHONPATH"] = (
        f"{HERE}{os.pathsep}{env.get('PYTHONPATH', '')}"  # a replay imports cli_task's factories
    )
    return subprocess.run(
        [str(CORELOOPER), "doctor", *map(str, args)], capture_output=True, text=True, env=env, timeout=120
    )


def test_post_mortem_of_a_run_with_a_spike_and_its_plot(tmp_path):
    make_loop(tmp_path, _linear(), _data(), logging_steps=1, max_steps=16, learning_rate=0.01).train()
    run = tmp_path / "run"
    proc = doctor(run, "--plot")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "finished: step 16 in " in out and "logs: 16 windows, last at step 16" in out
    assert f"loss spike at step {SPIKE_STEP}:" in out
    assert "memory peak:" in out and "(RSS)" in out
    assert "memory breakdown: parameters 20 B" in out
    assert "time split: data" in out and "slowest phase:" in out
    assert "samples/s:" in out
    assert "advice: loss spikes: lower the learning rate" in out
    png = run / "doctor" / "doctor.png"
    from PIL import Image

    with Image.open(png) as im:
        assert im.size[0] > 500 and im.info["Description"] == "panels: loss, grad_norm, memory, time_split"


def test_post_mortem_of_an_oom(tmp_path):
    with pytest.raises(TrainingError):
        make_loop(tmp_path, OomAt(at_call=3), samples()).train()
    out = doctor(tmp_path / "run").stdout
    assert "not finished: out of memory (the report is below); no run summary" in out
    assert "doctor: out of memory at step 3 during forward" in out
    assert "advice: out of memory" in out


def test_not_a_run_folder_is_one_paragraph_and_exit_code_4(tmp_path):
    proc = doctor(tmp_path / "missing")
    assert proc.returncode == 4
    assert "is not a folder: pass a run's output_dir" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_doctor_is_listed_and_help_imports_no_torch():
    env = {k: v for k, v in os.environ.items() if k != "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"}
    code = (
        "import sys; from corelooper.cli.app import main; sys.argv = ['corelooper', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert " doctor " in proc.stdout
    assert proc.stdout.strip().endswith("False")


def corelooper_run(
    tmp_path: Path, name: str, *args, model: str = "model", train: str = "train", extra: str = ""
) -> subprocess.CompletedProcess:
    """``corelooper run`` of a toy classifier (cli_task.py) with the installed doctor, as a user
    runs it."""
    task = HERE / "cli_task.py"
    config = tmp_path / f"{name}.toml"
    config.write_text(f"""
[model]
factory = "{task}:{model}"
[data]
train = "{task}:{train}"
[train]
output_dir = "{tmp_path / name}"
max_steps = 8
per_device_train_batch_size = 8
logging_steps = 2
save_strategy = "no"
{extra}
[plugins]
enable = ["doctor"]
""")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "CORELOOPER_VERBOSE")
    }
    env.update(PYTHONPATH=f"{HERE}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return subprocess.run(
        [str(CORELOOPER), "run", str(config), *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.slow
def test_console_lines_show_the_training_essentials_and_verbose_shows_all(tmp_path):
    quiet = corelooper_run(tmp_path, "quiet")
    assert quiet.returncode == 0, quiet.stderr
    lines = [x for x in quiet.stdout.splitlines() if x.startswith("[step ") and " loss=" in x]
    assert len(lines) == 4
    for line in lines:
        assert "grad_norm=" in line and "learning_rate=" in line and "samples_per_second=" in line
        assert "doctor/" not in line and "time_share" not in line and "memory" not in line
    # the loggers still get every key
    records = [json.loads(x) for x in (tmp_path / "quiet" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert len(logged) == 4 and all(
        "doctor/time_share_data" in r and "doctor/memory_peak_rss_gb" in r for r in logged
    )
    # and the console has the run's split once, at the end
    assert quiet.stderr.count("doctor: time split of 6 steps (after the first window): data ") == 1
    verbose = corelooper_run(tmp_path, "verbose", "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    lines = [x for x in verbose.stdout.splitlines() if x.startswith("[step ") and " loss=" in x]
    assert len(lines) == 4 and all(
        " doctor/time_share_data=" in x and " doctor/memory_peak_rss_gb=" in x for x in lines
    )


@pytest.mark.slow
def test_post_mortem_and_replay_of_a_run_from_the_command_line(tmp_path):
    run = corelooper_run(
        tmp_path, "overflow", model="square_model", train="overflow_train", extra='on_nonfinite = "skip_step"'
    )
    assert run.returncode == 0, run.stderr
    step = next((tmp_path / "overflow" / "doctor").glob("step-*")).name
    out = doctor(tmp_path / "overflow").stdout
    assert "finished: step 8 in " in out and "logs: 4 windows, last at step 8" in out
    assert f"non-finite at step {step[5:]} (skip_step): 'body.1' [Square] forward output" in out
    assert f"re-explain it with --replay {step}" in out
    replayed = doctor(tmp_path / "overflow", "--replay", step)
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout)["module"] == "body.1"


def test_the_throughput_trend_is_in_plain_numbers():
    """``tokens/s: 13380 in the first quarter …, 3538 in the last`` (not ``1.338e+04``)."""
    from corelooper_doctor.postmortem import _trend

    logs = [{"tokens_per_second": v} for v in (500.0, 13380.0, 13380.0, 9000.0, 3538.0, 3538.0)]
    assert (
        _trend(logs)
        == "tokens/s: 13380 in the first quarter of the logs (after the first), 3538 in the last (-74%)"
    )
    slow = [{"samples_per_second": v} for v in (1.0, 2.5, 2.5, 1.25, 1.25)]
    assert _trend(slow).startswith(
        "samples/s: 2.5 in the first quarter"
    ) and "1.25 in the last (-50%)" in _trend(slow)
