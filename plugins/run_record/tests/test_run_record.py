"""corelooper-run-record: ``output_dir/run.json`` written by real ``corelooper run`` subprocesses in a
real git repository, read back; ``corelooper diff`` between those runs; the data files' identities."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from corelooper_run_record import data_files
from corelooper_run_record.diff import differences

import corelooper
from corelooper.config import Config

CONFIG = """
[model]
factory = "corelooper_testing:tiny_model"
[data]
train = "corelooper_testing:tiny_train_set"
[train]
output_dir = "a"
max_steps = 4
per_device_train_batch_size = 8
learning_rate = 0.05
logging_steps = 1
save_strategy = "no"
disable_tqdm = true
"""


def run(project: Path, *args: str) -> subprocess.CompletedProcess:
    """The real CLI: a run with this plugin as the only one (autoload off: other installed plugins stay
    out of run.json); ``diff`` as a user runs it (the command comes from the installed plugin)."""
    autoload_off = "1" if args[0] == "run" else ""
    env = {**os.environ, "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": autoload_off, "OMP_NUM_THREADS": "1"}
    extra = ["-p", "corelooper_run_record"] if args[0] == "run" else []
    return subprocess.run(
        [sys.executable, "-m", "corelooper", *args, *extra],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def git(folder: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "HOME": str(folder),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(
        ["git", "-C", str(folder), *args], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()


@pytest.mark.slow
def test_run_json_records_how_the_run_was_made_and_diff_names_what_differs(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.md").write_text("the project's own file\n")
    (project / "config.toml").write_text(CONFIG)
    (project / ".gitignore").write_text("a/\nb/\nc/\n")
    git(project, "init", "-q")
    git(project, "add", ".")
    git(project, "commit", "-q", "-m", "start")
    a = run(project, "run", "config.toml")
    assert a.returncode == 0, a.stderr[-3000:]
    record = json.loads((project / "a" / "run.json").read_text())
    commit = git(project, "rev-parse", "HEAD")
    assert record["git"] == {"commit": commit, "dirty": False}  # a/, the run's output, is not tracked
    assert record["command"]["argv"][-4:] == ["run", "config.toml", "-p", "corelooper_run_record"]
    assert record["command"]["sets"] == [] and record["command"]["cwd"] == str(project)
    assert record["versions"]["corelooper"] == corelooper.__version__
    assert record["versions"]["torch"] == torch.__version__
    assert record["plugins"]["console"]["version"] == corelooper.__version__
    assert (record["world_size"], record["device"], record["data"]) == (1, "cpu", {})  # a factory: no file
    assert record["config"]["train"]["learning_rate"] == 0.05

    (project / "notes.md").write_text("edited\n")  # a tracked file changes: dirty
    b = run(project, "run", "config.toml", "--set", "train.output_dir=b", "--set", "train.learning_rate=0.1")
    assert b.returncode == 0, b.stderr[-3000:]
    record_b = json.loads((project / "b" / "run.json").read_text())
    assert record_b["command"]["sets"] == ["train.output_dir=b", "train.learning_rate=0.1"]
    assert record_b["git"] == {"commit": commit, "dirty": True}
    git(project, "checkout", "notes.md")
    same = run(project, "run", "config.toml", "--set", "train.output_dir=c")
    assert same.returncode == 0, same.stderr[-3000:]

    diff = run(project, "diff", "a", "b")
    assert diff.returncode == 0, diff.stderr
    lines = diff.stdout.splitlines()
    assert lines[:4] == [
        "config.train.learning_rate: 0.05 -> 0.1",
        'config.train.output_dir: "a" -> "b"',
        "git.dirty: false -> true",
        'command.sets: [] -> ["train.output_dir=b", "train.learning_rate=0.1"]',
    ], lines
    assert len(lines) == 5  # argv differs only by the --sets (said once); versions, data, plugins: the same
    # step 1's loss is taken before the first update: the learning rates part the losses at step 2
    la = {
        r["step"]: r["loss"]
        for r in map(json.loads, (project / "a" / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    assert lines[4].startswith(f"losses part at step 2: {la[2]:.6g} vs "), lines
    same_config = run(project, "diff", "a", "c")
    assert same_config.stdout.splitlines() == [
        'config.train.output_dir: "a" -> "c"',
        'command.sets: [] -> ["train.output_dir=c"]',
        "losses: the same at all 4 logged steps in common (up to step 4)",
    ], same_config.stdout
    missing = run(project, "diff", "a", "nope")
    assert missing.returncode == 2 and "has no run.json" in missing.stderr


def test_diff_shows_values_as_the_config_writes_them():
    """``warmup_steps: 5 -> 0`` (not ``5.0``), an absent key as ``(absent)`` (not a quoted string)."""
    a = {"config": {"train": {"warmup_steps": 5.0, "learning_rate": 0.05}}}
    b = {"config": {"train": {"warmup_steps": 0, "learning_rate": 0.1, "new_key": "x"}}}
    assert differences(a, b) == [
        "config.train.learning_rate: 0.05 -> 0.1",
        'config.train.new_key: (absent) -> "x"',
        "config.train.warmup_steps: 5 -> 0",
    ]


def test_argv_is_shown_only_where_it_differs_beyond_the_sets():
    base = ["corelooper", "run", "config.toml"]
    a = {"command": {"argv": base, "sets": []}}
    b = {
        "command": {
            "argv": [*base, "--set", "train.seed=1", "-s", "train.lr=2"],
            "sets": ["train.seed=1", "train.lr=2"],
        }
    }
    assert differences(a, b) == ['command.sets: [] -> ["train.seed=1", "train.lr=2"]']
    c = {"command": {"argv": [*base, "--verbose", "--set=train.seed=1"], "sets": ["train.seed=1"]}}
    assert differences(a, c) == [
        'command.argv: ["corelooper", "run", "config.toml"] -> ["corelooper", "run", '
        '"config.toml", "--verbose", "--set=train.seed=1"]',
        'command.sets: [] -> ["train.seed=1"]',
    ]


def test_data_files_are_identified_by_size_mtime_and_the_hash_of_their_head(tmp_path, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(100)))
    (tmp_path / "shards").mkdir()
    for i in range(2):
        (tmp_path / "shards" / f"part-{i}.jsonl").write_text(f'{{"x": {i}}}\n')
    monkeypatch.chdir(tmp_path)
    config = Config.from_dict({"data": {"train": "rows.jsonl", "eval": "shards", "test": "task.py:test_set"}})
    found = data_files(config)
    identity = found[str(rows.resolve())]
    assert (identity["size"], identity["sha256_head"]) == (
        rows.stat().st_size,
        hashlib.sha256(rows.read_bytes()).hexdigest(),
    )
    assert identity["mtime"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(rows.stat().st_mtime))
    assert sorted(Path(p).name for p in found) == ["part-0.jsonl", "part-1.jsonl", "rows.jsonl"]  # no factory
