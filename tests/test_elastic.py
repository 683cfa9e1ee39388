"""Resuming on another number of processes, in the core: data.BatchLoader's global position
continues the sample order on any world size; without a plugin that adapts the checkpoint (a
``resume_position`` provider), such a checkpoint is refused naming both sizes (exit 5 from the CLI),
and a ``resume_config`` provider that raises is named. The resumes through corelooper-elastic-resume
(2 -> 1 -> 2 processes equal to an uninterrupted run): plugins/elastic_resume/tests.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from cluster_task import REPO, STOP_PLUGIN, claim_two_processes, env, write_config

from corelooper.data.loader import BatchLoader
from corelooper.errors import CheckpointError


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


# -- without the elastic plugin: the same world size resumes, another one is refused -------------


@pytest.mark.distributed
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


@pytest.mark.slow
@pytest.mark.distributed
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
