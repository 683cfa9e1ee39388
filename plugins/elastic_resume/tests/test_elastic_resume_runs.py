"""Elastic resume through corelooper-elastic-resume: a run saved on N processes continues on
M != N with the same global batch and the same global sample order (the loader's global position,
and the refusal without this plugin, exit 5: tests/test_elastic.py).

The end-to-end test is the issue's: 2 processes -> preempted (SIGTERM) at step 6 -> resumed on 1
-> preempted at step 9 -> resumed on 2 -> final weights equal an uninterrupted 2-process run to
1e-5, and every step's loss equals that run's (a repeated or skipped sample would change both).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import corelooper_elastic_resume
import pytest
from safetensors.torch import load_file

from corelooper.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from cluster_task import (  # noqa: E402
    ELASTIC,
    REPO,
    STOP_PLUGIN,
    claim_two_processes,
    env,
    max_diff,
    write_config,
)


def _run(tmp_path, config, nproc: int, record: Path, stop: int = 0, resume: bool = False):
    """``corelooper run`` with the stop and config-recorder plugins (written to tmp_path)."""
    args = [
        sys.executable,
        "-m",
        "corelooper",
        "run",
        str(config),
        "-p",
        str(tmp_path / "stop_at.py"),
        "-p",
        str(tmp_path / "config_recorder.py"),
        *ELASTIC,
    ]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    if resume:
        args += ["--resume-from-checkpoint", "latest"]
    return subprocess.run(
        args,
        cwd=REPO,
        env={**env(tmp_path), "STOP_AT_STEP": str(stop), "CONFIG_RECORD": str(record)},
        capture_output=True,
        text=True,
        timeout=240,
    )


def _step_losses(run_dir) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(x["step"], x["loss"]) for x in lines if "loss" in x and "train_runtime" not in x]
    assert len({s for s, _ in losses}) == len(losses), losses  # each step logged once
    return dict(losses)


CONFIG_RECORDER = """
import json
import os


class Recorder:
    def __init__(self, config):
        self.config = config  # as a plugin keeps what it was configured with

    def on_train_begin(self, loop, state):
        if state.is_world_process_zero:
            geometry = lambda a: [a.per_device_train_batch_size, a.gradient_accumulation_steps]
            record = {"configured": geometry(self.config.train), "running": geometry(loop.args),
                      "same_config": self.config is loop.config, "world": state.world_size}
            with open(os.environ["CONFIG_RECORD"], "a") as f:
                f.write(json.dumps(record) + "\\n")


def corelooper_configure(config, plugins):
    plugins.register(Recorder(config), "config_recorder.run")
"""


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory):
    """The issue's run, once for the module's two end-to-end tests (4 real launches, the suite's
    time: issue 50). 64 samples, global batch 8: 8 steps an epoch; stops at 6 (epoch 0) and 9 (epoch 1).
    Every run (reference included) loads CONFIG_RECORDER, which only writes what its plugin was
    configured with at on_train_begin: record.jsonl gets one line per launch of the resumed run."""
    tmp = tmp_path_factory.mktemp("elastic")
    (tmp / "stop_at.py").write_text(STOP_PLUGIN)
    (tmp / "config_recorder.py").write_text(CONFIG_RECORDER)
    ref = _run(tmp, write_config(tmp, tmp / "ref", name="ref.toml"), 2, record=tmp / "ref_record.jsonl")
    assert ref.returncode == 0, ref.stderr[-3000:]
    cfg, record = write_config(tmp, tmp / "run", name="run.toml"), tmp / "record.jsonl"
    first = _run(tmp, cfg, 2, record, stop=6)
    assert first.returncode != 0 and (tmp / "run" / "checkpoint-6").is_dir(), first.stderr[-3000:]
    assert not (tmp / "run" / "checkpoint-9").exists()
    one = _run(tmp, cfg, 1, record, stop=9, resume=True)
    assert one.returncode == 143, one.stderr[-3000:]
    last = _run(tmp, cfg, 2, record, resume=True)
    assert last.returncode == 0, last.stderr[-3000:]
    return {"tmp": tmp, "one": one, "last": last, "record": record}


@pytest.mark.slow
@pytest.mark.distributed
def test_two_then_one_then_two_processes_equals_an_uninterrupted_run(elastic_run):
    tmp, one, last = elastic_run["tmp"], elastic_run["one"], elastic_run["last"]
    assert (
        "saved with 4 per device x 1 accumulation x 2 processes = 8; on 1 processes: "
        "4 per device x 2 accumulation x 1 processes = 8"
    ) in one.stdout
    assert "continuing after sample 48 of epoch 0" in one.stdout
    assert "batch 4 x 2 accumulation x 1 processes" in one.stdout
    assert "continuing after sample 8 of epoch 1" in last.stdout  # step 9 = 1 step into epoch 1

    got, want = _step_losses(tmp / "run"), _step_losses(tmp / "ref")
    assert sorted(got) == list(range(1, 13)) == sorted(want)
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-5, (got, want)
    final = load_file(str(tmp / "run" / "model.safetensors"))
    assert max_diff(final, load_file(str(tmp / "ref" / "model.safetensors"))) <= 1e-5
    start = load_file(str(tmp / "run" / "checkpoint-6" / "model.safetensors"))
    assert max_diff(final, start) > 1e-3


@pytest.mark.slow
@pytest.mark.distributed
def test_a_plugin_is_configured_with_the_config_the_resumed_run_uses(elastic_run):
    """2 processes -> preempted -> resumed on 1 -> preempted -> resumed on 2: the plugins are
    configured with each launch's settled geometry (4 x 2 accumulation on 1 process, 4 x 1 on 2),
    and the run never replaces that config."""
    assert "on 1 processes: 4 per device x 2 accumulation x 1 processes = 8" in elastic_run["one"].stdout
    records = [json.loads(line) for line in elastic_run["record"].read_text().splitlines()]
    assert records == [
        {"configured": [4, 1], "running": [4, 1], "same_config": True, "world": 2},
        {"configured": [4, 2], "running": [4, 2], "same_config": True, "world": 1},
        {"configured": [4, 1], "running": [4, 1], "same_config": True, "world": 2},
    ]


@pytest.mark.distributed
def test_in_process_resume_keeps_the_global_batch_and_group_by_length_refuses(
    run_loop, make_loop, tmp_path, capsys
):
    run_loop(max_steps=8)
    claim_two_processes(tmp_path / "run" / "checkpoint-4")
    elastic = [corelooper_elastic_resume]
    refused = make_loop(elastic, max_steps=8, group_by_length=True, length_column_name="x")
    with pytest.raises(ConfigError, match=r"on 1 processes with train.group_by_length = true.*Resume on 2"):
        refused.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    # The config is final once plugins are configured: train(resume_from_checkpoint=...) cannot
    # change its geometry, and says how to resume (the checkpoint named in the config).
    late = make_loop(elastic, max_steps=8)
    with pytest.raises(
        ConfigError,
        match=r"needs per_device_train_batch_size = 8 and "
        r"gradient_accumulation_steps = 2.*train.resume_from_checkpoint",
    ):
        late.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert late.args.gradient_accumulation_steps == 1
    loop = make_loop(elastic, max_steps=8, resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    config = loop.config
    assert (loop.args.per_device_train_batch_size, loop.args.gradient_accumulation_steps) == (8, 2)
    out = capsys.readouterr().out
    assert (
        "was saved with 8 per device x 1 accumulation x 2 processes = 16; on 1 processes: "
        "8 per device x 2 accumulation x 1 processes = 16 (global batch kept)" in out
    )
    loop.train()
    assert loop.config is config and loop.state.global_step == 8


@pytest.mark.distributed
def test_a_resume_that_changes_the_plan_says_so_with_the_steps_and_why(run_loop, make_loop, tmp_path):
    """64 samples, 7 per device, train.dataloader_drop_last: saved on "2 processes" an epoch is 4
    micro-batches of 14 (4 steps), resumed on 1 it is 9 of 7 in steps of 2 (5 steps): two epochs
    go from 8 to 10 steps, and the warning says so when the Loop settles its config."""
    args = {"per_device_train_batch_size": 7, "dataloader_drop_last": True, "max_steps": -1}
    run_loop(num_train_epochs=2, **args)
    claim_two_processes(tmp_path / "run" / "checkpoint-4")
    elastic = [corelooper_elastic_resume]
    with pytest.warns(UserWarning) as said:
        loop = make_loop(
            elastic, num_train_epochs=2, resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"), **args
        )
    (message,) = [str(w.message) for w in said if "changes the plan" in str(w.message)]
    assert message.startswith(
        "Resuming on 1 processes changes the plan: 8 -> 10 steps, 4 -> 5 steps per epoch. "
        "The global batch is kept (14 samples per step), but the training set (64 samples) is not a "
        "whole number of global batches of 14, and an epoch has 4 micro-batches of 14 samples (the "
        "short one dropped) on 2 processes, 9 micro-batches of 7 samples (the short one dropped) on 1"
    )
    assert message.endswith("resume on 2 processes or set train.max_steps = 8.")
    loop.train()
    assert loop.state.max_steps == 10 and loop.state.steps_per_epoch == 5
