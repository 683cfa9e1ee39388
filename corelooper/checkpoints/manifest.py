"""``manifest.json``: what makes a checkpoint folder complete, checked by content.

The manifest is the last file a save writes. It lists every other file of the folder with its
size and a checksum (xxHash XXH3-128 when ``xxhash`` is installed — a core dependency — else
BLAKE2b-128 from the standard library; the manifest names the algorithm it used), and
``"finite": true`` (a checkpoint with a NaN/inf weight is never written). A folder is a
complete checkpoint only when its manifest parses and every listed file is present with its
size and checksum. ``benchmarks/checkpoint_bench.py`` measures the hashing against the save.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = 2
_CHUNK = 8 << 20  # 8 MiB reads: large enough that hashing runs at memory speed


def _hasher(name: str):
    if name == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if name == "blake2b-128":
        return hashlib.blake2b(digest_size=16)
    raise CheckpointError(f"unknown checksum algorithm {name!r} in a {MANIFEST}")


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "blake2b-128"
    return "xxh3_128"


def checksum(path: Path, algorithm: str) -> str:
    h = _hasher(algorithm)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _hash_files(directory: Path, algorithm: str) -> dict[str, dict[str, Any]]:
    return {
        p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "checksum": checksum(p, algorithm)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def write_manifest(directory: Path, while_hashing=None) -> dict[str, Any]:
    """Hash every file of ``directory`` and write ``manifest.json`` (fsynced) last.

    ``while_hashing``: a function run in a second thread meanwhile (the checkpoint's fsync of
    the same files: the disk works while the CPU hashes them from the page cache)."""
    algorithm = default_algorithm()
    if while_hashing is None:
        files = _hash_files(directory, algorithm)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(while_hashing, directory)
            files = _hash_files(directory, algorithm)
            done.result()
    manifest = {"format": FORMAT, "algorithm": algorithm, "finite": True, "files": files}
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"Checkpoint {str(directory)!r} is incomplete: it has no {MANIFEST} (written last by "
            "every complete save). Resume from an earlier checkpoint."
        )
    try:
        manifest = json.loads(path.read_bytes())
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' table")
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} is unreadable ({type(e).__name__}: {e}): the save was "
            "cut short. Resume from an earlier checkpoint."
        ) from None
    return manifest


def verify(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory`` after checking every file it lists, size and checksum.
    Raises a CheckpointError naming the first file that differs."""
    manifest = read_manifest(directory)
    algorithm = manifest.get("algorithm")
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file {str(path)!r} is missing (listed in {MANIFEST}).")
        size = entry["size"] if isinstance(entry, dict) else entry  # format 1: sizes only
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} is {actual} bytes, but {size} were written: it was "
                "truncated or changed after the save. Resume from another checkpoint."
            )
        if not isinstance(entry, dict) or algorithm is None:
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} has a {MANIFEST} without checksums (an older "
                "format): its contents cannot be verified. Resume from a checkpoint written by this "
                "version, or run `corelooper verify` after re-saving it."
            )
        if checksum(path, algorithm) != entry["checksum"]:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} does not match its checksum in {MANIFEST}: it was "
                "changed or corrupted after the save (same size, different bytes). Resume from "
                "another checkpoint."
            )
    return manifest


def problem(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint, in a few words; None when it is."""
    try:
        manifest = verify(directory)
    except CheckpointError as e:
        return _short(str(e), directory)
    return "non-finite weights" if manifest.get("finite") is False else None


def _short(message: str, directory: Path) -> str:
    """'optimizer.pt fails its checksum' from a long CheckpointError message."""
    if "no manifest" in message or f"no {MANIFEST}" in message:
        return f"no {MANIFEST} (save cut short)"
    for word, what in (
        ("checksum", "fails its checksum"),
        ("bytes, but", "has the wrong size"),
        ("is missing", "is missing"),
        ("unreadable", "is unreadable"),
    ):
        if word in message:
            name = message.split("'", 2)[1] if "'" in message else ""
            rel = os.path.relpath(name, directory) if name else MANIFEST
            return f"{rel} {what}"
    return message
