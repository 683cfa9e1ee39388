"""``corelooper doctor RUN_DIR``: the post-mortem, through the real command line."""

from __future__ import annotations

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


def doctor(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"}
    return subprocess.run([str(CORELOOPER), "doctor", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_post_mortem_of_a_run_with_a_spike_and_its_plot(tmp_path):
    make_loop(tmp_path, _linear(), _data(), logging_steps=1, max_steps=16, learning_rate=0.01).train()
    run = tmp_path / "run"
    proc = doctor(run, "--plot")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "logs: 16 windows, last at step 16" in out
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
    assert "doctor: out of memory at step 3 during forward" in out
    assert "advice: out of memory" in out


def test_not_a_run_folder_is_one_paragraph_and_exit_code_4(tmp_path):
    proc = doctor(tmp_path / "missing")
    assert proc.returncode == 4
    assert "is not a folder: pass a run's output_dir" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_doctor_is_listed_and_help_imports_no_torch():
    env = {k: v for k, v in os.environ.items() if k != "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"}
    code = ("import sys; from corelooper.cli.app import main; sys.argv = ['corelooper', '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert " doctor " in proc.stdout
    assert proc.stdout.strip().endswith("False")
