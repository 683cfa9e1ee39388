"""The prepared data set on disk, so a second start on the same data and settings reads it back.

An entry is the tokenized, masked, truncated rows (one Arrow file, ``data/rows.arrow``, which the
tokenizing ``datasets.map`` writes in place: the rows are written once, not once per step and again
for the cache) plus ``meta.json`` (the statistics, the packing plan, and the size and SHA-256 of
every file of the entry). Its key hashes everything the rows depend on:

* the data: every byte of the input rows (the Arrow buffers of the table the data set reads, so
  a change anywhere in the file counts, not only its size or head), and the paths of the
  ``datasets`` cache files it is memory-mapped from (``datasets`` puts them in a folder named
  after the source files' paths and modification times, so a touched file gets a new path);
* the tokenizer: its files (``tokenizer.json``, ``tokenizer_config.json``, vocabularies...) when
  it was loaded from a folder, its serialized state (vocabulary, merges, normalizer, added
  tokens) and special tokens;
* the chat template, every ``[sft]`` setting, and the versions of corelooper-sft,
  transformers, tokenizers and datasets.

An entry is written to a temporary folder and renamed into place, so a reader never sees half of
one (a run whose cache folder cannot be written still runs: its rows go where ``datasets`` puts
them); on reading, a file whose size or hash differs, or a ``meta.json`` that does not parse, makes
the entry ignored (a warning), deleted and rebuilt. Nothing is unpickled: Arrow and JSON only.

``CORELOOPER_SFT_CACHE`` names the folder (default: the ``datasets`` cache folder's
``corelooper-sft``); ``off`` turns the cache off.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger("corelooper.sft")

FORMAT = 3  # bump when what an entry holds (or how rows are made) changes
ROWS = Path("data") / "rows.arrow"
# a write to the cache folder failed for want of room or rights: the run goes on without the cache
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
TOKENIZER_SUFFIXES = {".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab"}
TOKENIZER_SKIP = {"config.json", "generation_config.json", "model.safetensors.index.json"}


def root() -> Path | None:
    where = os.environ.get("CORELOOPER_SFT_CACHE")
    if where and where.lower() in ("off", "0", "false", "none"):
        return None
    if where:
        return Path(where)
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "corelooper-sft"


def _versions() -> dict[str, str]:
    import datasets
    import tokenizers
    import transformers

    from . import __version__

    return {
        "corelooper-sft": __version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "datasets": datasets.__version__,
        "format": str(FORMAT),
    }


def data_hash(ds, h) -> None:
    """Every byte of the rows ``ds`` reads (and its row selection, after a filter or shuffle)."""
    tables = [ds.data] + ([ds._indices] if getattr(ds, "_indices", None) is not None else [])
    for table in tables:
        h.update(str(table.schema).encode())
        for column in table.columns:
            for chunk in column.chunks:
                h.update(f"{chunk.offset}:{len(chunk)}".encode())
                for buf in chunk.buffers():
                    if buf is not None:
                        h.update(buf)
    h.update(json.dumps(sorted(f["filename"] for f in ds.cache_files)).encode())


def tokenizer_hash(tok, h) -> bool:
    """The tokenizer's files and state; False when there is nothing stable to hash."""
    folder = Path(str(getattr(tok, "name_or_path", "") or ""))
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.suffix in TOKENIZER_SUFFIXES and f.name not in TOKENIZER_SKIP and f.is_file():
                h.update(f.name.encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None and not folder.is_dir():
        return False  # a slow tokenizer built in memory: no state to hash, no cache
    if backend is not None:
        h.update(backend.to_str().encode())
    h.update(
        json.dumps(
            [type(tok).__name__, tok.special_tokens_map, len(tok)], sort_keys=True, default=str
        ).encode()
    )
    return True


def key(ds, tok, cfg: Mapping[str, Any], template: str | None) -> str | None:
    """The entry's name, or None when the inputs cannot be hashed (no caching then)."""
    h = hashlib.sha256()
    if not tokenizer_hash(tok, h):
        return None
    settings = {
        "sft": dict(cfg),
        "template": template or getattr(tok, "chat_template", None),
        "versions": _versions(),
    }
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    data_hash(ds, h)
    return h.hexdigest()[:32]


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def load(name: str, where: str):
    """``(dataset, meta)`` of a complete, intact entry; None (and the entry removed) otherwise."""
    base = root()
    if base is None or not (base / name).exists():
        return None
    folder = base / name
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        if meta.get("key") != name:
            raise ValueError("meta.json names another entry")
        for rel, (size, digest) in meta["files"].items():
            f = folder / rel
            if f.stat().st_size != size or _file_hash(f) != digest:
                raise ValueError(f"{rel} differs from what was written")
        ds = _read(folder)
        if len(ds) != meta["rows"]:
            raise ValueError(f"{len(ds)} rows, {meta['rows']} written")
    except Exception as e:  # corrupt, partial or foreign: never trusted, rebuilt
        logger.warning(
            "sft: %s: the cached preparation in %s is unusable (%s: %s): ignored and rebuilt.",
            where,
            folder,
            type(e).__name__,
            e,
        )
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return ds, meta


def _read(folder: Path):
    import datasets

    return datasets.Dataset.from_file(str(folder / ROWS))  # memory-mapped Arrow, nothing unpickled


def begin(name: str, where: str) -> Path | None:
    """Where the tokenizing map writes a new entry's rows: a file in a temporary folder (``store``
    renames the folder into place). None when the cache folder cannot be written (said once)."""
    base = root()
    if base is None:
        return None
    rows = base / f".tmp-{name}-{uuid.uuid4().hex[:8]}" / ROWS
    try:
        rows.parent.mkdir(parents=True)
    except OSError as e:
        not_cached(where, e)
        return None
    return rows


def not_cached(where: str, error: OSError) -> None:
    """Say that the cache is not written (a full or read-only disk costs the cache, not the run)."""
    logger.warning("sft: %s: could not cache the prepared data in %s (%s).", where, root(), error)


def discard(rows: Path) -> None:
    """Remove the temporary folder of an entry that ``begin`` started."""
    shutil.rmtree(rows.parent.parent, ignore_errors=True)


def store(name: str, rows: Path, meta: dict[str, Any], where: str):
    """Complete the entry whose rows the map wrote to ``rows`` (``begin``): ``meta.json``, then the
    rename into place; the data set read back from it (memory-mapped). None if it failed (said)."""
    base, tmp = root(), rows.parent.parent
    try:
        files = {
            str(f.relative_to(tmp)): [f.stat().st_size, _file_hash(f)]
            for f in sorted((tmp / "data").rglob("*"))
            if f.is_file()
        }
        (tmp / "meta.json").write_text(json.dumps({**meta, "key": name, "files": files}), encoding="utf-8")
        shutil.rmtree(base / name, ignore_errors=True)
        os.replace(tmp, base / name)
    except OSError as e:  # the rows stay where the map wrote them: the run reads them
        not_cached(where, e)
        return None
    return _read(base / name)
