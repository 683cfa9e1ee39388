"""Run folders through the real CLI: a finished run resumed, run.json and `corelooper diff`,
data paths checked before the model loads, one message for a bad JSONL line, a missing model
folder."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import TESTS, run_cli

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


def write_rows(path: Path, n: int = 64) -> Path:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(4, 8, generator=g)[y] * 3 + torch.randn(n, 8, generator=g)
    path.write_text("".join(json.dumps({"x": xi, "labels": yi}) + "\n" for xi, yi in zip(x.tolist(), y.tolist(), strict=True)))
    return path


COLLATE = """import torch


def collate(rows):
    return {"x": torch.tensor([r["x"] for r in rows]), "labels": torch.tensor([r["labels"] for r in rows])}
"""


def config(folder: Path, out: str = "run", model: str = f"{TESTS}/toys.py:mlp", train: str = "rows.jsonl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if train == "rows.jsonl" and not (folder / train).exists():
        write_rows(folder / train)
    (folder / "rows.py").write_text(COLLATE)
    cfg = folder / "config.toml"
    cfg.write_text(CONFIG.format(model=model, train=train, out=folder / out, collate=folder / "rows.py:collate"))
    return cfg


def cli(*args, cwd: Path, **env):
    """The real CLI, with corelooper-hf (data files and model folders by path) and, for a run,
    corelooper-run-record (run.json) as the only plugins; ``diff`` (a command of
    corelooper-run-record) with the installed plugins loaded, as a user runs it."""
    plugins = ["-p", "corelooper_hf"] if args[0] in ("run", "eval", "predict") else []
    plugins += ["-p", "corelooper_run_record"] if args[0] == "run" else []
    quiet = {**QUIET, "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": ""} if args[0] == "diff" else QUIET
    return run_cli(*args, *plugins, cwd=cwd, env={**quiet, **env}, timeout=180)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the run lock's (it names whoever last held the folder: a resume
    takes it before reading the checkpoint, so no other run writes there meanwhile)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".corelooper.lock"}


def test_resuming_a_finished_run_does_nothing_and_a_real_resume_says_where_it_starts(tmp_path):
    cfg = config(tmp_path)
    first = cli("run", str(cfg), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(tmp_path / "run")
    again = cli("run", str(cfg), "--resume-from-checkpoint", "latest", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished at step 6: nothing to do" in again.stdout
    assert "train_runtime" not in again.stdout and "training 6 steps" not in again.stdout
    assert snapshot(tmp_path / "run") == before  # nothing written: no summary line, no model saved
    real = cli("run", str(cfg), "--resume-from-checkpoint", str(tmp_path / "run" / "checkpoint-3"), cwd=tmp_path)
    assert real.returncode == 0, real.stderr[-3000:]
    assert "resuming from checkpoint-3 (step 3 of 6)" in real.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 6]  # steps 4-6 logged again, replacing the first run's


def _git(folder: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(folder), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def test_run_json_records_how_the_run_was_made_and_diff_names_what_differs(tmp_path):
    import corelooper

    project = tmp_path / "project"
    cfg = config(project, out="a")
    _git(project, "init", "-q")
    _git(project, "add", ".")
    _git(project, "commit", "-q", "-m", "start")
    a = cli("run", str(cfg), cwd=project)
    assert a.returncode == 0, a.stderr[-3000:]
    record = json.loads((project / "a" / "run.json").read_text())
    commit = _git(project, "rev-parse", "HEAD")
    assert record["git"] == {"commit": commit, "dirty": False}  # a/, the run's output, is not tracked
    assert record["command"]["argv"][-6:] == ["run", str(cfg), "-p", "corelooper_hf", "-p", "corelooper_run_record"]
    assert record["command"]["sets"] == [] and record["command"]["cwd"] == str(project)
    assert record["versions"]["corelooper"] == corelooper.__version__
    assert record["versions"]["torch"] == torch.__version__
    assert record["plugins"]["console"]["version"] == corelooper.__version__
    assert (record["world_size"], record["device"]) == (1, "cpu")
    rows = project / "rows.jsonl"
    assert record["data"] == {str(rows): {
        "size": rows.stat().st_size, "mtime": record["data"][str(rows)]["mtime"],
        "sha256_head": hashlib.sha256(rows.read_bytes()).hexdigest()}}
    assert record["config"]["train"]["learning_rate"] == 0.05

    (project / "rows.py").write_text(COLLATE + "# edited\n")  # a tracked file changes: dirty
    b = cli("run", str(cfg), "--set", "train.output_dir=b", "--set", "train.learning_rate=0.1", cwd=project)
    assert b.returncode == 0, b.stderr[-3000:]
    record_b = json.loads((project / "b" / "run.json").read_text())
    assert record_b["command"]["sets"] == ["train.output_dir=b", "train.learning_rate=0.1"]
    assert record_b["git"] == {"commit": commit, "dirty": True}
    _git(project, "checkout", "rows.py")
    same = cli("run", str(cfg), "--set", "train.output_dir=c", cwd=project)
    assert same.returncode == 0, same.stderr[-3000:]

    d = cli("diff", str(project / "a"), str(project / "b"), cwd=project)
    assert d.returncode == 0, d.stderr
    assert "config.train.learning_rate: 0.05 -> 0.1" in d.stdout
    assert "git.dirty: false -> true" in d.stdout
    assert "versions." not in d.stdout and "data." not in d.stdout and "plugins." not in d.stdout
    # step 1's loss is taken before the first update: the learning rates part the losses at step 2
    la = {r["step"]: r["loss"] for r in map(json.loads, (project / "a" / "metrics.jsonl").read_text().splitlines())
          if "loss" in r}
    assert f"losses part at step 2: {la[2]:.6g} vs " in d.stdout, d.stdout
    d_same = cli("diff", str(project / "a"), str(project / "c"), cwd=project)
    assert "config.train.learning_rate" not in d_same.stdout
    assert "losses: the same at all 6 logged steps" in d_same.stdout, d_same.stdout
    missing = cli("diff", str(project / "a"), str(project / "nope"), cwd=project)
    assert missing.returncode == 2 and "has no run.json" in missing.stderr


def test_a_missing_data_file_fails_before_the_model_is_built_naming_the_folder_once(tmp_path):
    marker = tmp_path / "model_built"
    (tmp_path / "slow_model.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom pathlib import Path\nfrom toys import mlp\n\n"
        f"def build(**_):\n    Path({str(marker)!r}).touch()\n    return mlp()\n")
    cfg = config(tmp_path, model=f"{tmp_path}/slow_model.py:build", train="nope.jsonl")
    r = cli("run", str(cfg), cwd=tmp_path)
    assert r.returncode == 4, r.stderr[-3000:]
    assert not marker.exists()  # checked before the model (and the plugins) loaded
    assert f"data.train = 'nope.jsonl': no such file or folder (looked in {tmp_path.resolve()})." in r.stderr
    assert r.stderr.count(str(tmp_path.resolve())) == 1, r.stderr
    ev = cli("eval", str(cfg), "--checkpoint", "latest", cwd=tmp_path)
    assert ev.returncode == 4 and "nope.jsonl" in ev.stderr and not marker.exists()


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
        next(line for line in r.stderr.splitlines() if line.startswith("corelooper: error"))], r.stderr


@pytest.mark.parametrize("ref", ["./models/missing", "models/missing", "missing-model"])
def test_a_missing_model_folder_says_so_and_where_it_looked(tmp_path, ref):
    cfg = tmp_path / "config.toml"
    write_rows(tmp_path / "rows.jsonl")
    cfg.write_text(f'[model]\nname_or_path = "{ref}"\n[data]\ntrain = "rows.jsonl"\n'
                   f'[train]\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 1\n')
    r = cli("run", str(cfg), cwd=tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"model.name_or_path = {ref!r}: the folder does not exist (looked in {tmp_path})." in r.stderr
    assert "huggingface.co" not in r.stderr
    if not ref.startswith("./"):  # could be a hub name
        assert "offline" in r.stderr and "hub names cannot be downloaded" in r.stderr


def test_diff_shows_values_as_the_config_writes_them():
    """``warmup_steps: 5 -> 0`` (not ``5.0``), an absent key as ``(absent)`` (not a quoted string)."""
    from corelooper_run_record.diff import differences

    a = {"config": {"train": {"warmup_steps": 5.0, "learning_rate": 0.05}}}
    b = {"config": {"train": {"warmup_steps": 0, "learning_rate": 0.1, "new_key": "x"}}}
    assert differences(a, b) == ["config.train.learning_rate: 0.05 -> 0.1", 'config.train.new_key: (absent) -> "x"',
                                 "config.train.warmup_steps: 5 -> 0"]
