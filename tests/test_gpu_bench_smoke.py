"""benchmarks/gpu stays runnable: the CPU smoke exits 0 with true skip messages, a step that
errors makes it exit 1, and a python without torch is named, not run (exit 2). No timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "gpu"
STEPS = "cl_bf16_full,cl_bf16_trained_head,cl_fp16_scaler,cl_packing_segment_sdpa,eval_cl_vs_hf"


def smoke(tmp_path, steps, budget_s=1200, **env):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench.py"),
            "--cpu-smoke",
            "--steps",
            steps,
            "--out",
            str(out),
            "--budget-s",
            str(budget_s),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, **env},
    )
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow
def test_cpu_smoke_runs_the_trained_head_and_the_eval_comparison(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc, summary = smoke(tmp_path, STEPS, TMPDIR=str(scratch))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # every run's output folder and result file removed after (torch.compile's cache is torch's own)
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []
    results = summary["results"]
    assert not [n for n, r in results.items() if "error" in r]
    # the one skip here is true: corelooper refuses fp16 on a CPU
    assert results["cl_fp16_scaler"] == {
        "skipped": "fp16 with GradScaler needs CUDA in corelooper (it refuses fp16 on CPU)"
    }
    assert "not merged" not in proc.stdout + proc.stderr
    for step in ("cl_bf16_full", "cl_bf16_trained_head", "cl_packing_segment_sdpa"):
        assert results[step]["tokens_per_s"] > 0 and results[step]["final_loss"] is not None
    # the trained-positions head trains the same model to the same loss as the full head
    assert abs(results["cl_bf16_trained_head"]["final_loss"] - results["cl_bf16_full"]["final_loss"]) < 1e-3
    assert "cl_bf16_trained_head/cl_bf16_full" in summary["ratios"]
    ev = results["eval_cl_vs_hf"]
    assert abs(ev["corelooper"]["eval_loss"] - ev["hf_trainer"]["eval_loss"]) < 1e-4  # the same eval loss
    assert ev["hf_trainer_compute_metrics"]["eval_loss"] == ev["hf_trainer"]["eval_loss"]
    assert (
        ev["corelooper_streaming_metric"]["eval_loss"] == ev["corelooper"]["eval_loss"]
    )  # a metric adds no loss work


@pytest.mark.slow
def test_cpu_smoke_runs_the_chat_sft_rows_of_the_gpu_step(tmp_path):
    # the step's own path (rows interleaved under a deadline, run_bench's table and verdicts) at
    # the smoke size on the CPU; on a GPU it is the same code with --device cuda
    proc, summary = smoke(tmp_path, "sft_chat_peers_bf16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = summary["results"]["sft_chat_peers_bf16"]
    assert res["failed_rows"] == {} and res["reps"] >= 1
    rows = {r["method"]: r for r in res["table"]}
    assert set(rows) == {
        "hf_grouped",
        "hf_flattening",
        "trl_grouped",
        "trl_padding_free",
        "raw_padding_free",
        "cl_padding_free",
        "cl_grouped",
    }
    assert all(r["same_trained_tokens"] and r["trained_tok_per_s"] > 0 for r in rows.values())
    # the same layout and batches: the hand-written loop and corelooper's padding-free row learn the same
    assert abs(rows["cl_padding_free"]["eval_loss"] - rows["raw_padding_free"]["eval_loss"]) < 1e-3
    assert res["goals"]["corelooper_leak_free_over_trl_best"]["theirs"] in ("trl_grouped", "trl_padding_free")


@pytest.mark.slow
def test_a_step_that_times_out_keeps_the_rows_it_finished(tmp_path):
    # the H200 run of 2026-12-04 lost every chat-SFT row to the budget: a long step now writes what
    # it has after each row, and a timeout records that with the error (the run still exits 1)
    # (the smoke's one repetition of 7 rows takes ~110 s on 2 idle cores: the budget cuts it after a
    # few rows, and still after the first on a machine three times slower)
    proc, summary = smoke(tmp_path, "sft_chat_peers_bf16", budget_s=75)
    assert proc.returncode == 1
    res = summary["results"]["sft_chat_peers_bf16"]
    assert res["error"] == "timed out after 75 s" and res["partial"] is True
    # how many rows are done depends on this machine's speed; the rows done are kept (without
    # write_partial the result is the error alone)
    assert res["table"] and all(r["trained_tok_per_s"] > 0 for r in res["table"])


def test_a_row_that_runs_away_is_cut_and_recorded(tmp_path):
    import sys as _sys

    _sys.path.insert(0, str(ROOT / "benchmarks" / "sft"))
    import run_bench

    rec = run_bench.run("cl_padding_free", 0, ["--samples", "4096", "--eval-samples", "8"], timeout=3)
    assert rec["rc"] != 0 and "killed after 3 s" in rec["failed"] and rec["proc_wall_s"] < 60


@pytest.mark.slow
def test_a_step_that_errors_makes_the_run_fail(tmp_path):
    # the step's process cannot write its result (no temp folder): recorded as an error, exit 1.
    # The step is the cheapest to start (on a CPU it imports torch and finds no CUDA; a training
    # step costs ~14 s of CPU more): the driver, not the step, is what this checks, and a result
    # that would have been a skip still makes an error when it never arrives.
    step = "auto_batch_size_real_oom"
    proc, summary = smoke(tmp_path, step, TMPDIR=str(tmp_path / "missing"))
    assert proc.returncode == 1
    assert "error" in summary["results"][step]
    assert f"1 step(s) errored: {step}" in proc.stderr


def test_without_torch_the_smoke_names_what_it_needs(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    py = str(bare / "bin" / "python")
    proc = subprocess.run(
        [py, str(BENCH / "bench.py"), "--cpu-smoke"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "lacks what every step needs: torch (pip install torch)" in proc.stderr
    assert "No module named 'torch'" not in proc.stdout + proc.stderr
    # run.sh from a clone without .venv, told not to install: exit 2 and the same kind of sentence
    proc = subprocess.run(
        ["bash", str(BENCH / "run.sh"), "--cpu-smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PY": py, "SKIP_INSTALL": "1"},
    )
    assert proc.returncode == 2
    assert "lacks torch, transformers or corelooper" in proc.stderr and "scripts/setup" in proc.stderr
