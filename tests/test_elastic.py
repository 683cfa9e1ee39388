"""Elastic resume: a run saved on N processes continues on M != N with the same global batch and
the same global sample order (the corelooper-elastic-resume plugin, data.BatchLoader's global position);
without the plugin, such a checkpoint is refused (exit 5).

The end-to-end test is the issue's: 2 processes -> preempted (SIGTERM) at step 6 -> resumed on 1
-> preempted at step 9 -> resumed on 2 -> final weights equal an uninterrupted 2-process run to
1e-5, and every step's loss equals that run's (a repeated or skipped sample would change both).
"""

from __future__ import annotations

import json
import subprocess
import sys

import corelooper_elastic_resume
import pytest
import torch
from cluster_task import ELASTIC, REPO, STOP_PLUGIN, claim_two_processes, env, max_diff, write_config
from safetensors.torch import load_file

from corelooper.data.loader import BatchLoader
from corelooper.errors import CheckpointError, ConfigError


def _run(tmp_path, config, nproc: int, stop: int = 0, resume: bool = False):
    args = [
        sys.executable,
        "-m",
        "corelooper",
        "run",
        str(config),
        "-p",
        str(tmp_path / "stop_at.py"),
        *ELASTIC,
    ]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    if resume:
        args += ["--resume-from-checkpoint", "latest"]
    return subprocess.run(
        args,
        cwd=REPO,
        env={**env(tmp_path), "STOP_AT_STEP": str(stop)},
        capture_output=True,
        text=True,
        timeout=240,
    )


def _step_losses(run_dir) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(x["step"], x["loss"]) for x in lines if "loss" in x and "train_runtime" not in x]
    assert len({s for s, _ in losses}) == len(losses), losses  # each step logged once
    return dict(losses)


def test_two_then_one_then_two_processes_equals_an_uninterrupted_run(tmp_path):
    (tmp_path / "stop_at.py").write_text(STOP_PLUGIN)
    # 64 samples, global batch 8: 8 steps an epoch; stops at 6 (epoch 0) and 9 (epoch 1)
    ref_cfg = write_config(tmp_path, tmp_path / "ref", name="ref.toml")
    cfg = write_config(tmp_path, tmp_path / "run", name="run.toml")
    ref = _run(tmp_path, ref_cfg, 2)
    assert ref.returncode == 0, ref.stderr[-3000:]

    first = _run(tmp_path, cfg, 2, stop=6)
    assert first.returncode != 0 and (tmp_path / "run" / "checkpoint-6").is_dir(), first.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoint-9").exists()
    one = _run(tmp_path, cfg, 1, stop=9, resume=True)
    assert one.returncode == 143, one.stderr[-3000:]
    assert (
        "saved with 4 per device x 1 accumulation x 2 processes = 8; on 1 processes: "
        "4 per device x 2 accumulation x 1 processes = 8"
    ) in one.stdout
    assert "continuing after sample 48 of epoch 0" in one.stdout
    assert "batch 4 x 2 accumulation x 1 processes" in one.stdout
    last = _run(tmp_path, cfg, 2, resume=True)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "continuing after sample 8 of epoch 1" in last.stdout  # step 9 = 1 step into epoch 1

    got, want = _step_losses(tmp_path / "run"), _step_losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, 13)) == sorted(want)
    assert max(abs(got[s] - want[s]) for s in want) <= 1e-5, (got, want)
    final = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert max_diff(final, load_file(str(tmp_path / "ref" / "model.safetensors"))) <= 1e-5
    start = load_file(str(tmp_path / "run" / "checkpoint-6" / "model.safetensors"))
    assert max_diff(final, start) > 1e-3


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


def test_a_plugin_is_configured_with_the_config_the_resumed_run_uses(tmp_path):
    """2 processes -> preempted -> resumed on 1: the plugins are configured with the settled
    geometry (4 x 2 accumulation), and the run never replaces that config."""
    (tmp_path / "stop_at.py").write_text(STOP_PLUGIN)
    (tmp_path / "config_recorder.py").write_text(CONFIG_RECORDER)
    cfg = write_config(tmp_path, tmp_path / "run", max_steps=6)
    extra = ["-p", str(tmp_path / "config_recorder.py"), *ELASTIC]
    record = tmp_path / "record.jsonl"

    def run(nproc: int, stop: int, resume: bool):
        args = [
            sys.executable,
            "-m",
            "corelooper",
            "run",
            str(cfg),
            "-p",
            str(tmp_path / "stop_at.py"),
            *extra,
        ]
        args += ["--nproc", str(nproc)] if nproc > 1 else []
        args += ["--resume-from-checkpoint", "latest"] if resume else []
        return subprocess.run(
            args,
            cwd=REPO,
            env={**env(tmp_path), "STOP_AT_STEP": str(stop), "CONFIG_RECORD": str(record)},
            capture_output=True,
            text=True,
            timeout=240,
        )

    first = run(2, stop=3, resume=False)
    assert first.returncode != 0 and (tmp_path / "run" / "checkpoint-3").is_dir(), first.stderr[-3000:]
    one = run(1, stop=0, resume=True)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "on 1 processes: 4 per device x 2 accumulation x 1 processes = 8" in one.stdout
    records = [json.loads(line) for line in record.read_text().splitlines()]
    assert records == [
        {"configured": [4, 1], "running": [4, 1], "same_config": True, "world": 2},
        {"configured": [4, 2], "running": [4, 2], "same_config": True, "world": 1},
    ]


def test_the_global_position_continues_the_order_on_another_world_size():
    """Two ranks consume 3 micro-batches (24 samples); one rank, told to skip those 24 samples,
    reads exactly the rest of the same permutation: nothing repeated, nothing skipped."""
    data = torch.utils.data.TensorDataset(torch.arange(64))
    two = [BatchLoader(data, 4, seed=5, num_replicas=2, rank=r) for r in (0, 1)]
    seen = [i for step in range(3) for loader in two for i in loader.batch_indices()[step]]
    one = BatchLoader(data, 4, seed=5)
    one.skip_samples(len(seen))
    rest = [int(i) for (batch,) in one for i in batch]
    assert len(seen) == 24 and sorted(seen + rest) == list(range(64))
    assert seen + rest == BatchLoader(data, 64, seed=5).batch_indices()[0]  # the epoch's order


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


# -- without the elastic plugin: the same world size resumes, another one is refused -------------


def test_without_the_plugin_another_world_size_is_refused_naming_both(run_loop, make_loop, tmp_path):
    run_loop(max_steps=8)
    claim_two_processes(tmp_path / "run" / "checkpoint-4")
    loop = make_loop(max_steps=8)  # no elastic plugin: no provider answers resume_position
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint-4 was saved on 2 processes and this run has 1.*no "
        r"loaded plugin adapts it.*`resume_position`.*Resume on 2 "
        r"processes.*ignore_data_skip = true",
    ):
        loop.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    restarted = make_loop(max_steps=8, ignore_data_skip=True)  # the fix the message names
    restarted.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert restarted.state.global_step == 8


def test_without_the_plugin_the_cli_exits_5_and_the_same_world_size_resumes(tmp_path):
    (tmp_path / "stop_at.py").write_text(STOP_PLUGIN)
    cfg = write_config(tmp_path, tmp_path / "run", max_steps=6)
    base = [sys.executable, "-m", "corelooper", "run", str(cfg), "-p", str(tmp_path / "stop_at.py")]

    def run(*extra, stop=0):  # installed plugins loaded, as a user has them; elastic_resume blocked
        return subprocess.run(
            [*base, "-p", "no:elastic_resume", *extra],
            cwd=REPO,
            env={**env(tmp_path), "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "", "STOP_AT_STEP": str(stop)},
            capture_output=True,
            text=True,
            timeout=240,
        )

    first = run(stop=3)
    assert first.returncode != 0 and (tmp_path / "run" / "checkpoint-3").is_dir(), first.stderr[-3000:]
    same = run("--resume-from-checkpoint", "latest")
    assert same.returncode == 0, same.stderr[-3000:]
    claim_two_processes(tmp_path / "run" / "checkpoint-3")
    other = run("--resume-from-checkpoint", str(tmp_path / "run" / "checkpoint-3"))
    assert other.returncode == 5, other.stderr[-3000:]
    assert "was saved on 2 processes and this run has 1" in other.stderr
    assert "no loaded plugin adapts it" in other.stderr and "Traceback" not in other.stderr


def test_a_resume_config_provider_that_raises_is_named(run_loop, make_loop, tmp_path):
    """resume_config runs before the Loop exists (the config is settled first): a plugin's error
    there names the plugin and the hook, as in training."""

    class Broken:
        name = "broken_resume"

        def resume_config(self, config, directory):
            raise RuntimeError("cannot read the geometry")

    run_loop(max_steps=4)
    with pytest.raises(Exception) as e:
        make_loop([Broken()], max_steps=8, resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert type(e.value).__name__ == "PluginError", e.value
    assert "Plugin 'broken_resume' raised in hook 'resume_config'" in str(e.value)
    assert "RuntimeError: cannot read the geometry" in str(e.value)
