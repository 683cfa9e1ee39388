"""Run folders through the real CLI: a finished run resumed, data paths checked before the model
loads, one message for a bad JSONL line, a missing model folder. (run.json and `corelooper diff`:
plugins/run_record/tests.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TESTS, run_cli
from run_here import train_here

CONFIG = """
[model]
factory = "{model}"
[data]
train = "{train}"
collator = "{collate}"
[train]
output_dir = "{out}"
max_steps = 6
per_device_train_batch_size = 8
learning_rate = 0.05
logging_steps = 1
save_steps = 3
disable_tqdm = true
"""
QUIET = {"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}
RUN_PLUGINS = ["corelooper_hf", "corelooper_run_record"]  # cli("run", ...)'s -p modules


def write_rows(path: Path, n: int = 64) -> Path:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(4, 8, generator=g)[y] * 3 + torch.randn(n, 8, generator=g)
    path.write_text(
        "".join(
            json.dumps({"x": xi, "labels": yi}) + "\n" for xi, yi in zip(x.tolist(), y.tolist(), strict=True)
        )
    )
    return path


COLLATE = """import torch


def collate(rows):
    return {"x": torch.tensor([r["x"] for r in rows]), "labels": torch.tensor([r["labels"] for r in rows])}
"""


def config(
    folder: Path, out: str = "run", model: str = f"{TESTS}/toys.py:mlp", train: str = "rows.jsonl"
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if train == "rows.jsonl" and not (folder / train).exists():
        write_rows(folder / train)
    (folder / "rows.py").write_text(COLLATE)
    cfg = folder / "config.toml"
    cfg.write_text(
        CONFIG.format(model=model, train=train, out=folder / out, collate=folder / "rows.py:collate")
    )
    return cfg


def cli(*args, cwd: Path, **env):
    """The real CLI, with corelooper-hf (data files and model folders by path) and, for a run,
    corelooper-run-record (run.json: a resume that does nothing must not touch it either) as the
    only plugins."""
    plugins = ["-p", "corelooper_hf"] if args[0] in ("run", "eval", "predict") else []
    plugins += ["-p", "corelooper_run_record"] if args[0] == "run" else []  # = RUN_PLUGINS for a run
    return run_cli(*args, *plugins, cwd=cwd, env={**QUIET, **env}, timeout=180)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the run lock's (it names whoever last held the folder: a resume
    takes it before reading the checkpoint, so no other run writes there meanwhile)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".corelooper.lock"
    }


@pytest.mark.slow
def test_resuming_a_finished_run_does_nothing_and_a_real_resume_says_where_it_starts(tmp_path):
    cfg = config(tmp_path)
    train_here(cfg, cwd=tmp_path, plugins=RUN_PLUGINS)  # the first run; the CLI's resumes are checked
    before = snapshot(tmp_path / "run")
    again = cli("run", str(cfg), "--resume-from-checkpoint", "latest", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished at step 6: nothing to do" in again.stdout
    assert "train_runtime" not in again.stdout and "training 6 steps" not in again.stdout
    assert snapshot(tmp_path / "run") == before  # nothing written: no summary line, no model saved
    real = cli(
        "run", str(cfg), "--resume-from-checkpoint", str(tmp_path / "run" / "checkpoint-3"), cwd=tmp_path
    )
    assert real.returncode == 0, real.stderr[-3000:]
    assert "resuming from checkpoint-3 (step 3 of 6)" in real.stdout
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4, 5, 6, 6]  # steps 4-6 logged again, replacing the first run's


@pytest.mark.slow
def test_a_finished_run_whose_only_checkpoint_is_older_is_still_finished(tmp_path):
    """save_total_limit = 1 with a best checkpoint keeps only the best one (HF 5.x): here the first
    evaluation's (greater_is_better on the loss), step 2 of 6. Resuming latest or auto must not train
    steps 3-6 again over the final model; a longer plan resumes from step 2 and says so."""
    cfg = config(tmp_path)
    cfg.write_text(
        cfg.read_text().replace("save_steps = 3", "save_steps = 2")
        + (
            'eval_strategy = "steps"\neval_steps = 2\nsave_total_limit = 1\nload_best_model_at_end = true\n'
            'metric_for_best_model = "eval_loss"\ngreater_is_better = true\n'
        )
    )
    cfg.write_text(cfg.read_text().replace("[train]", 'eval = "rows.jsonl"\n[train]'))
    train_here(cfg, cwd=tmp_path, plugins=RUN_PLUGINS)  # the first run; the CLI's resumes are checked
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2"]
    assert json.loads((tmp_path / "run" / "loop_state.json").read_text())["global_step"] == 6
    before = snapshot(tmp_path / "run")
    for resume in ("latest", "auto"):
        again = cli("run", str(cfg), "--resume-from-checkpoint", resume, cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "already finished at step 6: nothing to do" in again.stdout, again.stdout
    assert snapshot(tmp_path / "run") == before
    longer = cli(
        "run", str(cfg), "--resume-from-checkpoint", "latest", "--set", "train.max_steps=8", cwd=tmp_path
    )
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert (
        "the run ended at step 6, but its newest checkpoint is checkpoint-2: steps 3-6 are trained again"
        in longer.stderr
    ), longer.stderr
    assert "resuming from checkpoint-2 (step 2 of 8)" in longer.stdout
    assert json.loads((tmp_path / "run" / "loop_state.json").read_text())["global_step"] == 8


@pytest.mark.slow
def test_a_missing_data_file_fails_before_the_model_is_built_naming_the_folder_once(tmp_path):
    marker = tmp_path / "model_built"
    (tmp_path / "slow_model.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom pathlib import Path\nfrom toys import mlp\n\n"
        f"def build(**_):\n    Path({str(marker)!r}).touch()\n    return mlp()\n"
    )
    cfg = config(tmp_path, model=f"{tmp_path}/slow_model.py:build", train="nope.jsonl")
    r = cli("run", str(cfg), cwd=tmp_path)
    assert r.returncode == 4, r.stderr[-3000:]
    assert not marker.exists()  # checked before the model (and the plugins) loaded
    assert f"data.train = 'nope.jsonl': no such file or folder (looked in {tmp_path.resolve()})." in r.stderr
    assert r.stderr.count(str(tmp_path.resolve())) == 1, r.stderr
    ev = cli("eval", str(cfg), "--checkpoint", "latest", cwd=tmp_path)
    assert ev.returncode == 4 and "nope.jsonl" in ev.stderr and not marker.exists()


@pytest.mark.slow
def test_a_malformed_jsonl_line_is_one_message_with_its_line_number(tmp_path):
    cfg = config(tmp_path)
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    lines[16] = lines[16][:-3]  # line 17 cut short
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    r = cli("run", str(cfg), cwd=tmp_path)
    assert r.returncode == 4, r.stderr[-3000:]
    assert "data.train: rows.jsonl, line 17: not valid JSON" in r.stderr
    assert "row 16" not in r.stderr, r.stderr  # datasets' own (0-based) line is not printed
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        next(line for line in r.stderr.splitlines() if line.startswith("corelooper: error"))
    ], r.stderr


@pytest.mark.parametrize("ref", ["./models/missing", "models/missing", "missing-model"])
def test_a_missing_model_folder_says_so_and_where_it_looked(tmp_path, ref):
    cfg = tmp_path / "config.toml"
    write_rows(tmp_path / "rows.jsonl")
    cfg.write_text(
        f'[model]\nname_or_path = "{ref}"\n[data]\ntrain = "rows.jsonl"\n'
        f'[train]\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 1\n'
    )
    r = cli("run", str(cfg), cwd=tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"model.name_or_path = {ref!r}: the folder does not exist (looked in {tmp_path})." in r.stderr
    assert "huggingface.co" not in r.stderr
    if not ref.startswith("./"):  # could be a hub name
        assert "offline" in r.stderr and "hub names cannot be downloaded" in r.stderr
