"""``corelooper data preview`` through the real CLI (a subprocess), and its error paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sft_fixtures import CHATS, _datasets_cache, model_dir  # noqa: F401 (fixtures)

CLI = [str(Path(sys.executable).with_name("corelooper"))]


def setup(tmp_path, model_dir, extra=""):
    (tmp_path / "chats.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in CHATS * 3), encoding="utf-8"
    )
    (tmp_path / "c.toml").write_text(
        f'[model]\nname_or_path = "{model_dir}"\n[data]\ntrain = "chats.jsonl"\n'
        f"[sft]\nassistant_only_loss = true\nmax_length = 40\n{extra}"
    )
    return tmp_path / "c.toml"


def run(args, cwd):
    env = {**os.environ, "HF_DATASETS_CACHE": str(cwd / "cache")}
    return subprocess.run(CLI + args, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_preview_shows_trained_tokens_counts_and_statistics(tmp_path, model_dir):
    cfg = setup(tmp_path, model_dir)
    out = run(["data", "preview", str(cfg), "-n", "3"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "[[Paris.]]" in out.stdout  # the trained part, marked (no terminal: no colours)
    # the statistics are those of the rows read: the first 3 of the file's 9
    assert "truncated from 42" in out.stdout and "3 samples kept of 3" in out.stdout
    assert "of the first 3 rows of" in out.stdout
    assert out.stderr.count("longer than max_length=40") == 1  # reported once


@pytest.mark.slow
def test_preview_json_gives_ids_labels_and_packing_boundaries(tmp_path, model_dir):
    cfg = setup(tmp_path, model_dir)
    out = run(
        [
            "data",
            "preview",
            str(cfg),
            "-n",
            "2",
            "--json",
            "--set",
            "sft.packing=true",
            "--set",
            "sft.max_length=128",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    rows, stats = lines[:-1], lines[-1]["stats"]
    # packing reads rows (doubling) until they fill more than the rows shown: 8 of the file's 9
    assert len(rows) == 2 and stats["packed_rows"] < stats["kept"] == stats["read"]["rows"] == 8
    assert "max_length" not in stats and 0 < stats["longest_sample"] <= 128  # [sft] max_length is the setting
    for row in rows:
        assert len(row["input_ids"]) == len(row["labels"]) == row["boundaries"][-1]["end"] <= 128
        assert all(row["labels"][b["start"]] == -100 for b in row["boundaries"])


@pytest.mark.slow
def test_preview_errors_are_one_paragraph_with_exit_code(tmp_path, model_dir):
    cfg = setup(tmp_path, model_dir, extra="packing_strategy = 'best'\n")
    out = run(["data", "preview", str(cfg)], tmp_path)
    assert out.returncode == 2 and "sft.packing_strategy = 'best'" in out.stderr
    assert "Traceback" not in out.stderr
    out = run(["data", "preview", str(setup_bad(tmp_path, model_dir))], tmp_path)
    assert out.returncode == 4 and "bad.jsonl, line 1: not valid JSON" in out.stderr, out.stderr


def setup_bad(tmp_path, model_dir):
    (tmp_path / "bad.jsonl").write_text('{"messages": oops}\n')
    (tmp_path / "bad.toml").write_text(
        f'[model]\nname_or_path = "{model_dir}"\n[data]\ntrain = "bad.jsonl"\n[sft]\n'
    )
    return tmp_path / "bad.toml"


@pytest.mark.slow
def test_preview_adds_no_line_breaks_and_names_a_config_without_sft(tmp_path, model_dir):
    """Piped (80 columns for rich), a long sample stays one line as the model sees it; a config
    with no [sft] section is told so, not asked for a tokenizer."""
    long = "word " * 40 + "end."
    (tmp_path / "long.jsonl").write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": long}]}
        )
        + "\n"
    )
    (tmp_path / "long.toml").write_text(
        f'[model]\nname_or_path = "{model_dir}"\n[data]\ntrain = "long.jsonl"\n'
        "[sft]\nassistant_only_loss = true\n"
    )
    out = run(["data", "preview", str(tmp_path / "long.toml"), "-n", "1"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert long.strip() in out.stdout.replace("[[", "").replace("]]", "")  # one line, unbroken
    (tmp_path / "plain.toml").write_text('[model]\nfactory = "m:f"\n[data]\ntrain = "chats.jsonl"\n')
    out = run(["data", "preview", str(tmp_path / "plain.toml")], tmp_path)
    assert out.returncode == 2 and "has no [sft] section" in out.stderr and "tokenizer" not in out.stderr, (
        out.stderr
    )
