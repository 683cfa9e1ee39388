"""Read an offline W&B run file (``offline-run-*/run-<id>.wandb``) back, without the network.

The file is a LevelDB-style log of ``wandb_internal_pb2.Record`` protobufs (the format W&B's own
``wandb sync`` reads): a 7-byte header ``:W&B``, then 32 KiB blocks of records, each with a
7-byte header (crc32, length, type) and split across blocks as FIRST/MIDDLE/LAST when long.
Used by the tests; handy to inspect an offline run before syncing it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator[bytes]:
    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    if ident != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (header {ident!r})")
    offset, pending = _HEADER, b""
    while offset + _HEADER <= len(data):
        left = _BLOCK - offset % _BLOCK
        if left < _HEADER:  # the rest of a block too short for a header is padding
            offset += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + _HEADER])
        offset += _HEADER
        chunk = data[offset : offset + length]
        offset += length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    run_id: str = ""
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    preempting: bool = False


def read_run(path: str | Path) -> OfflineRun:
    """Run id, config, history rows, summary and exit code of one ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun()
    for raw in records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run  # written again with only some fields set (e.g. at the end)
            run.run_id = r.run_id or run.run_id
            run.project = r.project or run.project
            run.name = r.display_name or run.name
            run.tags = list(r.tags) or run.tags
            run.config.update({_key(u): json.loads(u.value_json) for u in r.config.update})
        elif kind == "config":
            run.config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            run.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            run.summary.update({_key(u): json.loads(u.value_json) for u in record.summary.update})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
        elif kind == "preempting":
            run.preempting = True
    return run


def find_runs(wandb_dir: str | Path) -> list[Path]:
    """The ``run-*.wandb`` files under ``wandb_dir``, oldest first."""
    return sorted(Path(wandb_dir).rglob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
