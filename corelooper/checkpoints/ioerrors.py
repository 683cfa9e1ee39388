"""I/O errors named as I/O: disk full, permission denied, read-only, a file where a folder should be.

``io_error(exc, doing, path, intact=...)`` turns an ``OSError`` — or the errors torch and
safetensors raise for one (``RuntimeError: [enforce fail at inline_container.cc] unexpected
pos``, ``SafetensorError: ... Os { code: 28 }``) — into one paragraph with the errno, the path
and what is still intact, as an ``IOFailure`` (a CheckpointError: exit code 5).
"""

from __future__ import annotations

import errno as errno_mod
import os
import re
from pathlib import Path

from ..errors import CheckpointError

_CHECK = "check the disk and the folder"
_WRITABLE = "make the folder writable for this user, or choose another train.output_dir"
_IN_THE_WAY = "remove or rename that file, or choose another train.output_dir"
_WHAT = {  # errno -> what it is, the fix
    errno_mod.ENOSPC: ("disk full", "free space on that disk (or lower train.save_total_limit)"),
    errno_mod.EDQUOT: (
        "disk quota exceeded",
        "free space within your quota (or lower train.save_total_limit)",
    ),
    errno_mod.EACCES: ("permission denied", _WRITABLE),
    errno_mod.EPERM: ("operation not permitted", _WRITABLE),
    errno_mod.EROFS: ("read-only file system", "choose a train.output_dir on a writable file system"),
    errno_mod.ENOTDIR: ("a file is where a folder should be", _IN_THE_WAY),
    errno_mod.EEXIST: ("a file is in the way", _IN_THE_WAY),
    errno_mod.EISDIR: ("a folder is where a file should be", _CHECK),
    errno_mod.EIO: ("input/output error (failing disk?)", _CHECK),
}
_RUST_CODE = re.compile(r"(?:code: |os error )(\d+)")


class IOFailure(CheckpointError):
    """Writing or reading the run's files failed in the operating system (exit code 5)."""


def errno_of(exc: BaseException, path: Path | None = None) -> int | None:
    """The errno behind ``exc``, or None when it is not an I/O failure."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    text = str(exc)
    m = _RUST_CODE.search(text)
    if m and type(exc).__name__ == "SafetensorError":
        return int(m.group(1))
    if isinstance(exc, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text):
        # torch.save reports a short write without its errno: a full disk is the usual cause
        free = _free_bytes(path) if path is not None else None
        if free is not None and free < (1 << 20):  # less than a MiB left: the write ran out of room
            return errno_mod.ENOSPC
        return errno_mod.EIO
    return None


def _free_bytes(path: Path) -> int | None:
    for p in (Path(path), *Path(path).parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def check_is_folder(output_dir: Path) -> None:
    """A file where output_dir (or a folder above it) should be: named, before anything is written."""
    for p in (Path(output_dir), *Path(output_dir).parents):
        if p.exists():
            if not p.is_dir():
                raise IOFailure(
                    f"train.output_dir = {str(output_dir)!r}: {str(p)!r} is a file, not a folder "
                    "(ENOTDIR). Remove or rename it, or choose another train.output_dir."
                )
            return


def io_error(exc: BaseException, doing: str, path: Path, intact: str | None = None) -> IOFailure:
    """One paragraph: ``disk full (ENOSPC) while writing checkpoint-20 in /runs/a: ...``."""
    code = errno_of(exc, path) or errno_mod.EIO
    name = errno_mod.errorcode.get(code, str(code))
    what, hint = _WHAT.get(code, (os.strerror(code).lower(), _CHECK))
    where = getattr(exc, "filename", None) or path
    kept = f" {intact}." if intact else ""
    return IOFailure(
        f"{what} ({name}, errno {code}) while {doing} in {str(path)!r} (at {str(where)!r}).{kept} "
        f"Fix: {hint}, then resume with --resume-from-checkpoint latest."
    )
