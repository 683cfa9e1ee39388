"""corelooper-testing, the pytest plugin for plugin authors: its fixtures drive real Loops (the tiny
task on CPU), its recorder sees every hook in order, SigtermAt sends a real signal, and importing it
(pytest does, in every project that installs it) imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from corelooper_testing import SigtermAt, tiny_task

from corelooper.plugins import installed_entry_points


def test_the_pytest_plugin_imports_no_torch():
    # pytest loads corelooper_testing in every run of every project that has corelooper-testing installed
    code = "import sys, corelooper_testing; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_recorder_sees_every_event_in_order_and_what_providers_returned(run_loop, hook_recorder):
    loop = run_loop([hook_recorder])
    names = [n for n in hook_recorder.names() if n.startswith("on_")]
    assert names[:3] == ["on_init_end", "on_train_begin", "on_epoch_begin"]
    assert names[-3:] == ["on_epoch_end", "on_log", "on_train_end"]  # the summary log comes last
    counts = {
        n: hook_recorder.count(n)
        for n in (
            "on_step_begin",
            "on_step_end",
            "on_before_backward",
            "on_optimizer_step",
            "on_log",
            "on_evaluate",
            "on_save",
        )
    }
    assert counts == {
        "on_step_begin": 8,
        "on_step_end": 8,
        "on_before_backward": 8,
        "on_optimizer_step": 8,
        "on_log": 5 + 2,
        "on_evaluate": 2,
        "on_save": 2,
    }  # each evaluation logs too (HF)
    assert [c.global_step for c in hook_recorder.calls_of("on_step_end")] == list(range(1, 9))
    # arguments are snapshots: each on_log call kept its own logs
    logs = [c["logs"] for c in hook_recorder.calls_of("on_log")]
    assert loop.state.log_history == [
        {**log, "step": c.global_step} for log, c in zip(logs, hook_recorder.calls_of("on_log"), strict=True)
    ]
    saves = hook_recorder.calls_of("on_save")
    assert [c["checkpoint_dir"].name for c in saves] == ["checkpoint-4", "checkpoint-8"]
    assert hook_recorder.last("on_evaluate")["metrics"] == loop.evaluate()
    # providers: the call and the answer (8 training micro-batches + 1 eval batch per evaluation)
    assert hook_recorder.count("compute_loss") == 8 + 2 + 1
    assert len(hook_recorder.last("train_dataloader").result) == 8  # 64 samples / batch 8
    assert hook_recorder.last("create_optimizer").result.defaults["lr"] == 0.05
    with pytest.raises(LookupError, match="never called"):
        hook_recorder.last("on_substep_end")


def test_run_loop_loads_installed_plugins_only_when_asked(run_loop, tmp_path):
    installed = {ep.name for ep in installed_entry_points()}
    isolated = run_loop(output_dir=tmp_path / "isolated")
    assert not installed & set(isolated.plugins.info)
    autoload = run_loop(output_dir=tmp_path / "autoload", autoload=True)
    assert installed <= set(autoload.plugins.info)


def test_sigterm_at_preempts_with_a_real_signal_and_resume_finishes_the_run(run_loop, tmp_path):
    stopped = run_loop([SigtermAt(at_step=3)], output_dir=tmp_path / "run")
    assert stopped.state.preempted and stopped.state.global_step == 3
    assert (tmp_path / "run" / "checkpoint-3").is_dir() and not (
        tmp_path / "run" / "model.safetensors"
    ).exists()
    resumed = run_loop(output_dir=tmp_path / "run", resume="latest")
    assert resumed.state.global_step == 8 and (tmp_path / "run" / "model.safetensors").is_file()


def test_train_args_and_make_loop_give_a_quick_untrained_loop(train_args, make_loop, tmp_path):
    args = train_args(max_steps=2)
    assert (args.output_dir, args.save_strategy, args.max_steps) == (str(tmp_path / "out"), "no", 2)
    loop = make_loop()
    assert loop.state.global_step == 0 and loop.args.output_dir == str(tmp_path / "run")


def test_the_tiny_task_is_seeded_and_learnable(run_loop):
    def inputs(seed):
        return [tiny_task(seed=seed)[1][i]["x"].tolist() for i in range(8)]

    assert inputs(3) == inputs(3) != inputs(4)
    loop = run_loop()
    losses = [h["loss"] for h in loop.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]  # 8 steps of the tiny task learn something
