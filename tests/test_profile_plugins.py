"""`corelooper run --profile-plugins`: time spent in each plugin's hooks, per hook and in total."""

from __future__ import annotations

import re

import pytest
from conftest import run_cli


@pytest.mark.slow
def test_profile_plugins_reports_each_plugin_hook_with_call_counts(tmp_path):
    steps = 7
    proc = run_cli(
        "run",
        "examples/digits/config.toml",
        "--profile-plugins",
        "--set",
        f"train.output_dir={tmp_path / 'out'}",
        "--set",
        f"train.max_steps={steps}",
        "--set",
        "train.eval_strategy='no'",
        "--set",
        "train.save_strategy='no'",
        "--set",
        "train.load_best_model_at_end=false",
        "--set",
        "train.logging_steps=3",
        env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "plugin hook time (run:" in out
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\s+(\S+)\s+(\w+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)%\s+([\d.]+)$", line)
        if m:
            rows[(m.group(1), m.group(2))] = (
                int(m.group(3)),
                float(m.group(4)),
                float(m.group(5)),
                float(m.group(6)),
            )
    # one compute_loss per micro-batch, plus the final evaluation's 2 batches (359 samples / 256)
    assert rows[("builtin", "compute_loss")][0] == steps + 2
    assert rows[("flow", "on_step_end")][0] == steps  # the builtin policy "flow" (HF's flow logic)
    assert rows[("console", "on_step_end")][0] == steps
    # logs at steps 3 and 6, the final partial window, the end-of-run summary, and the final
    # evaluation's metrics (evaluations log through on_log, as in HF)
    assert rows[("jsonl", "on_log")][0] == 5
    assert rows[("console", "on_log")][0] == 5
    # shares are of the whole run, so they can't exceed 100% and the loss provider dominates
    assert all(0 <= share <= 100 for _, _, share, _ in rows.values())
    # the first call, with its one-time imports, apart: part of the total, all of it for one call
    assert all(first <= total + 1e-6 for _, total, _, first in rows.values())
    assert rows[("builtin", "create_optimizer")][1] == rows[("builtin", "create_optimizer")][3]
    assert not any(plugin == "cli" or plugin.startswith("_") for plugin, _ in rows)  # the CLI's own object
    assert rows[("builtin", "compute_loss")][1] > rows[("jsonl", "on_log")][1]
    totals = [line for line in out.splitlines() if "(all hooks)" in line]
    assert {t.split()[0] for t in totals} >= {"builtin", "console", "jsonl"}
