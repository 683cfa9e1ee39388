"""One run per ``output_dir``: an advisory ``fcntl.flock`` on ``output_dir/.corelooper.lock``.

Rank 0 takes the lock (``RunLock.acquire``: a CheckpointError naming PID and host when it is held)
before it reads a checkpoint or changes anything in ``output_dir`` and holds it for the run's life
(``release()``, or process exit). The kernel releases it when the process dies (even by ``kill -9``),
so a lock file left by a dead run is simply taken over; the file itself records the holder's PID,
host and start time, for the message a second run gets. Without ``fcntl`` (Windows) no lock is taken.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from ..errors import CheckpointError
from .ioerrors import check_is_folder, io_error

LOCK_FILE = ".corelooper.lock"


class RunLock:
    """A held lock on one output_dir (``release()`` or process exit frees it)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, output_dir: Path) -> RunLock:
        output_dir = Path(output_dir)
        path = output_dir / LOCK_FILE
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks; one run per folder is up to the user
            return cls(path, None)
        check_is_folder(output_dir)
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise io_error(e, "taking the run lock", output_dir) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise CheckpointError(
                f"output_dir {str(output_dir)!r} is in use by another run ({holder}, lock file "
                f"{str(path)!r}). Two runs in one folder overwrite each other's checkpoints: wait "
                "for it to finish, stop it, or choose another train.output_dir."
            ) from None
        except OSError as e:  # ENOLCK, ENOSYS, EOPNOTSUPP: a shared file system without flock
            os.close(fd)
            raise CheckpointError(
                f"The file system of output_dir {str(output_dir)!r} refuses the run lock (flock: "
                f"{e.strerror}, errno {e.errno}): Lustre mounted without `-o flock`, or NFS without "
                "its lock service. Mount it with flock support (Lustre: `-o flock`; NFS: lockd/NFSv4), "
                "or put train.output_dir on a file system that has it (docs/clusters.md)."
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            # Unlock first: a DataLoader worker forked during the run shares this open file, and
            # closing our descriptor alone would leave the flock held while that worker lives.
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"PID {info['pid']} on host {info['host']}, since {info.get('since', '?')}"
    except (ValueError, KeyError, OSError):
        return "holder unknown: it has not written its PID yet"
