"""The benchmarks' own logic: goal verdicts, the physical-limit baseline (no timed assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def run_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH / "overhead"))
    import run_bench

    return run_bench


def test_a_goal_whose_interval_crosses_it_is_inconclusive(run_bench, capsys):
    assert run_bench.verdict(1.01, 1.02, [0.99, 1.03]) == "inconclusive"  # median under, interval across
    assert run_bench.verdict(1.03, 1.02, [1.00, 1.05]) == "inconclusive"  # median over, interval across
    assert run_bench.verdict(1.00, 1.02, [0.98, 1.02]) == "met"
    assert run_bench.verdict(1.05, 1.02, [1.03, 1.07]) == "NOT met"
    assert run_bench.verdict(1.00, 1.02) == "met" and run_bench.verdict(None, 1.02) == "not measured"
    row = dict(workload="A", n=5, loop_over_base=1.01, loop_over_base_ci95=[0.99, 1.03], proc_over_base=1.0,
               first_step_later_s=0.01, loop_median_over_base_median=1.01)
    table = [dict(row, config="corelooper"), dict(row, config="corelooper (vs the limit)", loop_over_base_ci95=[0.97, 1.0])]
    goals = run_bench.goals(table)
    printed = capsys.readouterr().out
    assert goals["loop_over_base"]["verdict"] == "inconclusive" and goals["loop_over_base"]["met"] is None
    assert goals["vs_limit"]["loop_over_base"]["verdict"] == "met"
    assert "goals (A, corelooper vs raw --fused): loop_over_base 1.01 [95% 0.990-1.030] (goal <= 1.02: inconclusive)" in printed
    assert "goals (A, corelooper (vs the limit) vs raw --fused --helpers): loop_over_base 1.01" in printed


def test_the_physical_limit_row_trains_bit_for_bit_as_the_hand_written_loop():
    # raw.py --helpers clips and clears with corelooper.gradients instead of torch's calls: the
    # same final weights, bit for bit, or it would not be the same work.
    out = {}
    for flags in ([], ["--helpers"]):
        proc = subprocess.run([sys.executable, "raw.py", "A", "--fused", *flags], cwd=BENCH / "overhead",
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[tuple(flags)] = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, helpers = out[()], out[("--helpers",)]
    assert helpers["variant"] == "fused+helpers" and helpers["same_work_check"]
    assert helpers["weights_sha1"] == plain["weights_sha1"]
    assert helpers["logged_losses"] == plain["logged_losses"]
