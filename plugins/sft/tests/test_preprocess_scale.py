"""Preprocessing at scale: batched tokenization equals the row-by-row path, the prepared data is
cached (read back on a second start, invalidated by each input it depends on, never trusted
when damaged), and ``data preview`` reads only the rows it shows. Real files, real datasets."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from corelooper_sft import DEFAULTS
from corelooper_sft.pipeline import prepare
from corelooper_sft.tokenize import RowTokenizer
from sft_fixtures import CHATS, NO_MARKERS, WITH_MARKERS, _datasets_cache, make_tokenizer, model_dir  # noqa: F401

CLI = [str(Path(sys.executable).with_name("corelooper"))]
HIT = "read from the cache"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CORELOOPER_SFT_CACHE", str(tmp_path / "sft_cache"))


def cfg(**kw):
    return {**DEFAULTS, "assistant_only_loss": True, "max_length": 64, **kw}


def write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def load(path: Path):
    from corelooper_hf.files import load_files

    return load_files(str(path), "data.train")


def rows_of(prepared) -> list[dict]:
    return [prepared[i] for i in range(len(prepared))]


def run(dataset, tok, caplog, **kw):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="corelooper.sft"):
        out = prepare(dataset, tok, cfg(**kw), "data.train")
    return out, HIT in caplog.text


@pytest.mark.parametrize(
    "template,assistant_only", [(WITH_MARKERS, True), (WITH_MARKERS, False), (NO_MARKERS, True)]
)
def test_batched_tokenization_equals_row_by_row(tmp_path, template, assistant_only):
    tok = make_tokenizer(template)
    # mixed formats in one batch: chats, a chat with tools, text, prompt/completion
    data = CHATS * 3 + [{"messages": CHATS[0]["messages"], "tools": None, "difficulty_score": 3.0}]
    prepared = prepare(data, tok, cfg(assistant_only_loss=assistant_only, max_length=0), "t", use_cache=False)
    one = RowTokenizer(tok, cfg(assistant_only_loss=assistant_only), "t")
    for i, row in enumerate(data):
        want = one(dict(row), i)
        got = prepared[i]
        assert got["input_ids"] == want["input_ids"] and got["labels"] == want["labels"]
        assert got["difficulty_score"] == row["difficulty_score"]
    assert prepared.stats.trained_tokens == sum(
        sum(x != -100 for x in one(dict(r), i)["labels"][1:]) for i, r in enumerate(data)
    )


def test_a_row_with_no_trained_token_is_named_in_the_batched_path():
    from corelooper.errors import DataError

    bad = {"messages": [{"role": "user", "content": "only a question"}]}
    with pytest.raises(DataError, match="sample 3: no token is trained"):
        prepare(CHATS + [bad], make_tokenizer(), cfg(), "data.train", use_cache=False)


def test_a_failed_preparation_leaves_no_half_written_cache_entry(tmp_path, caplog):
    from corelooper.errors import DataError

    bad = {"messages": [{"role": "user", "content": "only a question"}]}
    with pytest.raises(DataError, match="sample 3: no token is trained"):
        prepare(CHATS + [bad], make_tokenizer(), cfg(), "data.train")
    assert (tmp_path / "sft_cache").is_dir() and not list((tmp_path / "sft_cache").iterdir())
    assert "could not cache" not in caplog.text  # a bad row is the row's fault, not the cache disk's


def test_second_start_reads_the_cache_and_gives_the_same_rows(tmp_path, caplog):
    tok, data = make_tokenizer(), write(tmp_path / "chats.jsonl", CHATS * 4)
    first, hit1 = run(load(data), tok, caplog, packing=True, max_length=40)
    second, hit2 = run(load(data), tok, caplog, packing=True, max_length=40)
    assert (hit1, hit2) == (False, True)
    assert rows_of(second) == rows_of(first) and second.plan == first.plan
    assert vars(second.stats) == vars(first.stats) and first.stats.truncated > 0
    assert "longer than max_length=40" in caplog.text  # still reported on a cache read


def _change_data(tmp_path, data, tok):
    write(data, CHATS * 3 + [CHATS[0]])
    return load(data), tok, {}


def _change_one_character(tmp_path, data, tok):  # same size, same head, a later row differs
    text = data.read_text(encoding="utf-8")
    k = text.rindex("Paris.")
    data.write_text(text[:k] + "Paria." + text[k + 6 :], encoding="utf-8")
    return load(data), tok, {}


def _touch_data(tmp_path, data, tok):
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    return load(data), tok, {}


def _change_tokenizer_files(tmp_path, data, tok):
    from transformers import AutoTokenizer

    conf = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({**conf, "model_max_length": 77}))
    return load(data), AutoTokenizer.from_pretrained(tmp_path / "tok"), {}


def _change_template(tmp_path, data, tok):
    tok.chat_template = WITH_MARKERS.replace("'\\n'", "' \\n'")
    return load(data), tok, {}


def _change_setting(tmp_path, data, tok):
    return load(data), tok, {"max_length": 63}


@pytest.mark.parametrize(
    "change",
    [
        _change_data,
        _change_one_character,
        _touch_data,
        _change_tokenizer_files,
        _change_template,
        _change_setting,
    ],
)
def test_each_kind_of_change_invalidates_the_cache(tmp_path, caplog, change):
    from transformers import AutoTokenizer

    make_tokenizer().save_pretrained(tmp_path / "tok")
    tok, data = AutoTokenizer.from_pretrained(tmp_path / "tok"), write(tmp_path / "chats.jsonl", CHATS * 3)
    assert not run(load(data), tok, caplog)[1]
    assert run(load(data), tok, caplog)[1]  # unchanged: a hit
    dataset, tok2, kw = change(tmp_path, data, tok)
    prepared, hit = run(dataset, tok2, caplog, **kw)
    assert not hit, change.__name__
    assert len(prepared) == len(dataset)


def _entry(tmp_path) -> Path:
    (entry,) = [p for p in (tmp_path / "sft_cache").iterdir() if not p.name.startswith(".")]
    return entry


@pytest.mark.parametrize("damage", ["truncate_arrow", "flip_byte", "bad_meta", "no_meta"])
def test_a_damaged_cache_entry_is_ignored_and_rebuilt(tmp_path, caplog, damage):
    tok, data = make_tokenizer(), write(tmp_path / "chats.jsonl", CHATS * 3)
    first = rows_of(run(load(data), tok, caplog)[0])
    entry = _entry(tmp_path)
    arrow = next((entry / "data").glob("*.arrow"))
    raw = bytearray(arrow.read_bytes())
    arrow.unlink()  # a new file, as a crashed writer would leave: the old one may still be mapped
    if damage == "truncate_arrow":
        arrow.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "flip_byte":
        raw[-100] ^= 0xFF
        arrow.write_bytes(bytes(raw))
    elif damage == "bad_meta":
        arrow.write_bytes(bytes(raw))
        (entry / "meta.json").write_text("{not json")
    else:
        arrow.write_bytes(bytes(raw))
        (entry / "meta.json").unlink()
    again, hit = run(load(data), tok, caplog)
    assert not hit and "unusable" in caplog.text and "ignored and rebuilt" in caplog.text
    assert rows_of(again) == first
    assert run(load(data), tok, caplog)[1]  # the rebuilt entry is whole again


def test_the_cache_can_be_turned_off(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("CORELOOPER_SFT_CACHE", "off")
    tok, data = make_tokenizer(), write(tmp_path / "chats.jsonl", CHATS * 3)
    run(load(data), tok, caplog)
    assert not run(load(data), tok, caplog)[1] and not (tmp_path / "sft_cache").exists()


def test_the_rows_are_written_once_into_the_cache_entry(tmp_path, caplog):
    # the tokenizing map (max_length applied in it) writes the entry's one Arrow file: nothing in
    # datasets' cache folder, no copy made for the cache
    tok, data = make_tokenizer(), write(tmp_path / "chats.jsonl", CHATS * 4)
    dataset = load(data)
    before = set((tmp_path / "hf_cache").rglob("*.arrow"))
    prepared = run(dataset, tok, caplog, max_length=40)[0]
    assert set((tmp_path / "hf_cache").rglob("*.arrow")) == before
    entry = _entry(tmp_path)
    assert sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file()) == [
        "data/rows.arrow",
        "meta.json",
    ]
    assert [f["filename"] for f in prepared.ds.cache_files] == [str(entry / "data" / "rows.arrow")]
    # token lists as int32: half the bytes of int64 (the rows still read back as Python ints)
    assert {str(prepared.ds.data.schema.field(c).type) for c in ("input_ids", "labels")} == {
        "list<item: int32>"
    }
    assert prepared.stats.truncated > 0 and not list((tmp_path / "sft_cache").glob(".tmp-*"))


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 KiB tmpfs (mounting needs root, as the core's disk-full tests)."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(d)], capture_output=True, text=True
    )
    if r.returncode:
        pytest.fail(f"mount tmpfs failed (the test needs root): {r.stderr}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_full_cache_disk_costs_the_cache_not_the_run(tmp_path, caplog, monkeypatch, small_disk):
    monkeypatch.setenv("CORELOOPER_SFT_CACHE", str(small_disk / "sft_cache"))
    tok, data = make_tokenizer(), write(tmp_path / "chats.jsonl", CHATS * 100)
    prepared, hit = run(load(data), tok, caplog, max_length=40)
    assert not hit and "could not cache the prepared data in" in caplog.text, caplog.text
    assert "No space left on device" in caplog.text, caplog.text
    assert not list((small_disk / "sft_cache").iterdir())  # no half-written entry left behind
    monkeypatch.setenv("CORELOOPER_SFT_CACHE", "off")
    uncached = run(load(data), tok, caplog, max_length=40)[0]
    assert rows_of(prepared) == rows_of(uncached) and vars(prepared.stats) == vars(uncached.stats)


def preview(tmp_path, model_dir, args, extra=""):
    (tmp_path / "c.toml").write_text(
        f'[model]\nname_or_path = "{model_dir}"\n[data]\ntrain = "chats.jsonl"\n'
        f"[sft]\nassistant_only_loss = true\nmax_length = 64\n{extra}"
    )
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    return subprocess.run(
        CLI + ["data", "preview", str(tmp_path / "c.toml"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["", "packing = true\n"])
def test_preview_reads_only_the_rows_it_shows(tmp_path, model_dir, extra):
    # 6 good rows, then lines that are not JSON: reading the whole file would fail (exit 4)
    write(tmp_path / "chats.jsonl", CHATS * 2)
    with (tmp_path / "chats.jsonl").open("a") as fh:
        fh.write("{broken\n" * 1000)
    out = preview(tmp_path, model_dir, ["-n", "2", "--json"], extra)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    stats = lines[-1]["stats"]
    assert len(lines) - 1 == 2 and stats["read"]["whole_file"] is False and stats["read"]["rows"] <= 6
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.arrow"))
    if not extra:
        assert stats["read"]["rows"] == 2 == stats["samples"]


@pytest.mark.slow
def test_preview_names_a_malformed_line_among_those_it_reads(tmp_path, model_dir):
    write(tmp_path / "chats.jsonl", CHATS[:1])
    with (tmp_path / "chats.jsonl").open("a") as fh:
        fh.write("{broken\n")
    out = preview(tmp_path, model_dir, ["-n", "2"])
    assert out.returncode == 4 and "chats.jsonl, line 2: not valid JSON" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_lengths_of_a_filtered_data_set_are_those_of_its_rows(overlong):
    # dropping (and truncating, then dropping rows left untrained) leaves a filtered view
    data = CHATS * 3 + [
        {"messages": [{"role": "user", "content": "x " * 60}, {"role": "assistant", "content": "y"}]}
    ]
    prepared = prepare(data, make_tokenizer(), cfg(max_length=45, overlong=overlong), "t", use_cache=False)
    assert prepared.lengths == [len(prepared[i]["input_ids"]) for i in range(len(prepared))]
    assert prepared.stats.dropped + prepared.stats.fully_masked_dropped > 0
    assert prepared.stats.trained_tokens == sum(
        sum(x != -100 for x in prepared[i]["labels"][1:]) for i in range(len(prepared))
    )


@pytest.mark.parametrize("packing", [False, True])
def test_a_data_column_named_like_a_pipeline_column_is_named_and_not_used(caplog, packing):
    # a numeric "length" in the data once overwrote the real lengths (and broke the packing plan)
    rows = [{**c, "length": 3, "trained": 0.5} for c in CHATS] * 2
    with caplog.at_level(logging.WARNING, logger="corelooper.sft"):
        prepared = prepare(rows, make_tokenizer(), cfg(packing=packing), "data.train", use_cache=False)
    tokenized = prepared.rows if packing else prepared
    assert (
        tokenized.lengths
        == [len(tokenized[i]["input_ids"]) for i in range(len(tokenized))]
        != [3] * len(rows)
    )
    assert "length" not in tokenized[0] and "trained" not in tokenized[0]
    assert caplog.text.count("the data's column(s) ['length', 'trained'] are not used") == 1
    plain = prepare(
        [dict(c) for c in CHATS] * 2, make_tokenizer(), cfg(packing=packing), "data.train", use_cache=False
    )
    assert prepared.stats.trained_tokens == plain.stats.trained_tokens
