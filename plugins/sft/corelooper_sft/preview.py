"""``corelooper data preview CONFIG [-n N] [--json]``: the training samples as the model sees them.

Rendered text with the trained tokens highlighted (rich colours on a terminal, ``[[…]]``
brackets elsewhere), token counts and truncation per sample, then data set statistics (length
histogram, share of trained tokens, samples truncated or dropped). ``--json`` prints one JSON
object per sample (``input_ids``, ``labels`` with -100 where not trained, and when packing the
sample boundaries of each row) and a last ``{"stats": ...}`` line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def register(app) -> None:
    data = typer.Typer(help="Inspect the data a config trains on.", no_args_is_help=True)
    app.add_typer(data, name="data")

    @data.command("preview")
    def preview(
        config: Annotated[Path, typer.Argument(metavar="CONFIG", help="The TOML config file.")],
        n: Annotated[int, typer.Option("-n", help="How many samples (packed rows when packing).")] = 3,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object per sample.")] = False,
        set_: Annotated[
            list[str] | None,
            typer.Option("--set", "-s", metavar="KEY=VALUE", help="Override a config value."),
        ] = None,
        split: Annotated[str, typer.Option("--split", help="train or eval.")] = "train",
        traceback_: Annotated[bool, typer.Option("--traceback", help="Show the full traceback.")] = False,
    ) -> None:
        """Show the first N samples of CONFIG's data as tokenized, masked and packed by [sft]."""
        from corelooper.cli.api import fail

        try:
            run_preview(config, n, as_json, set_ or [], split)
        except Exception as e:
            fail(e, traceback_)


def load(config_path: Path, overrides: list[str], split: str, n: int = 0):
    """The prepared data set and tokenizer of a config, without building the model. A JSON Lines
    file is read only as far as the preview needs (its first rows: ``head``), anything else whole."""
    from corelooper.build import build_dataset
    from corelooper.config import Config
    from corelooper.errors import ConfigError, DataError
    from corelooper.plugins import load_plugins

    from . import DEFAULTS, SECTION
    from .pipeline import prepare
    from .setup import check, configure_tokenizer, find_tokenizer, mode

    config = Config.load(config_path, overrides)
    if SECTION not in config.sections:
        raise ConfigError(
            f"{config_path} has no [{SECTION}] section: `corelooper data preview` shows the samples as "
            f"[{SECTION}] tokenizes, masks and packs them (chat or prompt/completion data). Add an "
            f"[{SECTION}] section (docs/data.md) to preview this config's data."
        )
    config = config.with_defaults({SECTION: DEFAULTS})
    cfg = config.section(SECTION)
    check(cfg)
    ref = getattr(config.data, split)
    if not ref and not (split == "eval" and config.data.eval_split):
        raise ConfigError(f"data.{split} is not set in {config_path}: nothing to preview.")
    tok = find_tokenizer(config)
    template = configure_tokenizer(tok, cfg, config)
    where = f"data.{split} ({ref or 'eval_split'})"
    split_cfg = {**cfg, "packing": mode(cfg, split) == "packed"}
    file = jsonl_file(ref, config_path)
    if file is not None and n > 0:
        return head(file, n, tok, split_cfg, where, template), tok
    dataset = build_dataset(load_plugins(Config.load(config_path, overrides)), config, split)
    if dataset is None:
        raise DataError(f"data.{split} gave no data set.")
    return prepare(dataset, tok, split_cfg, where, template), tok


def jsonl_file(ref, config_path: Path) -> Path | None:
    """The file a ``[data]`` value names when it is one JSON Lines file (no glob, no mixture)."""
    if not isinstance(ref, str) or Path(ref).suffix.lower() != ".jsonl" or set("*?[") & set(ref):
        return None
    path = Path(ref).expanduser()
    if not path.is_absolute() and not path.exists():
        path = config_path.parent / path
    return path if path.is_file() else None


def read_rows(
    file: Path, count: int, start: tuple[int, int] = (0, 0)
) -> tuple[list[dict], tuple[int, int], bool]:
    """Up to ``count`` rows of a JSON Lines file from byte offset ``start[0]`` (line ``start[1]``):
    the rows, where the next read starts, and whether the file ended. Reads nothing further."""
    from corelooper.errors import DataError

    rows, (offset, line_no) = [], start
    with file.open("rb") as fh:
        fh.seek(offset)
        while len(rows) < count:
            line = fh.readline()
            if not line:
                return rows, (offset, line_no), True
            offset, line_no = offset + len(line), line_no + 1
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{file}, line {line_no}: not valid JSON ({e.msg}, column {e.colno}). Each line "
                    "of a JSON Lines file must be one JSON object."
                ) from None
            if not isinstance(row, dict):
                raise DataError(f"{file}, line {line_no}: a {type(row).__name__}, not a JSON object.")
            rows.append(row)
    return rows, (offset, line_no), False


def head(file: Path, n: int, tok, cfg, where: str, template):
    """The first ``n`` samples (or packed rows) prepared from the first rows of ``file``: ``n``
    rows, or when packing as many as fill ``n`` packed rows (doubling), never the whole file
    unless it is that short. The statistics are those of the rows read (``stats.read``)."""
    from corelooper.errors import DataError

    from .pipeline import prepare

    rows, pos, ended = read_rows(file, n)
    while True:
        if not rows:
            raise DataError(f"{where}: {file} has no rows.")
        prepared = prepare(rows, tok, cfg, where, template, use_cache=False)
        if ended or not cfg["packing"] or len(prepared) > n:
            prepared.stats.read = {"file": str(file), "rows": len(rows), "whole_file": ended}
            return prepared
        more, pos, ended = read_rows(file, len(rows), pos)
        rows += more


def run_preview(config_path: Path, n: int, as_json: bool, overrides: list[str], split: str) -> None:
    prepared, tok = load(config_path, overrides, split, n)
    rows = prepared.__getitems__(list(range(min(n, len(prepared)))))
    plan = getattr(prepared, "plan", None)
    if as_json:
        for r, item in enumerate(rows):
            print(json.dumps(_json_item(prepared, r, item, plan), ensure_ascii=False))
        print(json.dumps({"stats": stats_of(prepared)}, ensure_ascii=False))
        return
    from rich.console import Console

    console = Console(
        highlight=False, soft_wrap=True
    )  # no line breaks the data does not have (a pipe is 80 wide)
    for r, item in enumerate(rows):
        pieces = item if isinstance(item, list) else [item]
        head = f"row {r}: {len(pieces)} samples packed" if plan is not None else f"sample {r}"
        console.rule(head)
        for piece in pieces:
            console.print(render(tok, piece, console.is_terminal))
            console.print(_counts(prepared, r, piece, plan), style="dim")
    console.rule("statistics")
    console.print(describe(stats_of(prepared)))


def render(tok, item: dict, colour: bool):
    """The item's text: trained tokens green (or in [[ ]] without colour), the rest dim."""
    from rich.text import Text

    text = Text()
    ids, labels = item["input_ids"], item["labels"]
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] != -100) != (labels[start] != -100):
            chunk = tok.decode(ids[start:i])
            trained = labels[start] != -100
            if colour:
                text.append(chunk, style="bold green" if trained else "dim")
            else:
                text.append(f"[[{chunk}]]" if trained else chunk)
            start = i
    return text


def _counts(prepared, r: int, item: dict, plan) -> str:
    trained = sum(x != -100 for x in item["labels"][1:])
    out = f"{len(item['input_ids'])} tokens, {trained} trained"
    rows = getattr(prepared, "rows", prepared)
    if plan is None and rows.untruncated is not None and rows.untruncated[r] > len(item["input_ids"]):
        out += f", truncated from {rows.untruncated[r]}"
    return out


def _json_item(prepared, r: int, item, plan) -> dict:
    if plan is None:
        return {"index": r, "input_ids": item["input_ids"], "labels": item["labels"]}
    ids = [t for p in item for t in p["input_ids"]]
    labels = []
    for p in item:  # as the collator makes them: a piece's first token is never predicted
        labels.extend([-100] + list(p["labels"][1:]))
    bounds, pos = [], 0
    for sample, a, b in plan[r]:
        bounds.append({"sample": sample, "start": pos, "end": pos + b - a, "sample_tokens": [a, b]})
        pos += b - a
    return {"row": r, "input_ids": ids, "labels": labels, "boundaries": bounds}


def stats_of(prepared) -> dict:
    s = prepared.stats
    lengths = s.lengths
    edges = [2**k for k in range(4, 16)]
    hist, lo = {}, 0
    for e in edges:
        count = sum(lo < x <= e for x in lengths)
        if count:
            hist[f"{lo + 1}-{e}"] = count
        lo = e
    return {
        "samples": s.samples,
        "kept": len(lengths),
        "tokens": s.tokens,
        "trained_tokens": s.trained_tokens,
        "trained_share": round(s.trained_tokens / max(s.tokens, 1), 4),
        "overlong": s.overlong,
        "truncated": s.truncated,
        "dropped": s.dropped,
        "fully_masked_dropped": s.fully_masked_dropped,
        "length_histogram": hist,
        "longest_sample": max(lengths, default=0),  # not [sft] max_length
        "packed_rows": len(prepared) if hasattr(prepared, "plan") else None,
        "read": getattr(s, "read", None),
    }


def describe(stats: dict) -> str:
    lines = [
        f"{stats['kept']} samples kept of {stats['samples']}; {stats['tokens']} tokens, "
        f"{stats['trained_tokens']} trained ({100 * stats['trained_share']:.1f}%)",
        f"over max_length: {stats['overlong']} (truncated {stats['truncated']}, dropped {stats['dropped']}"
        f", dropped with no trained token left {stats['fully_masked_dropped']})",
    ]
    if stats["packed_rows"] is not None:
        lines.append(f"packed into {stats['packed_rows']} rows")
    read = stats.get("read")
    if read and not read["whole_file"]:
        lines.append(f"(of the first {read['rows']} rows of {read['file']}: the preview reads no further)")
    width = max(stats["length_histogram"].values(), default=1)
    for bucket, count in stats["length_histogram"].items():
        lines.append(f"  {bucket:>12} tokens | {'#' * max(1, round(40 * count / width))} {count}")
    return "\n".join(lines)
