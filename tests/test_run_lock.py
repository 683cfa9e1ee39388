"""The run lock (``fcntl.flock`` on ``output_dir/.corelooper.lock``) when its holder
dies, as on a node lost mid-job, and on a shared file system that has no flock
(docs/clusters.md, "Shared file system")."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys

import pytest

from corelooper.checkpoints.lock import LOCK_FILE, RunLock
from corelooper.errors import CheckpointError

HOLD = (
    "import sys, time\nfrom corelooper.checkpoints.lock import RunLock\n"
    "RunLock.acquire(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(600)\n"
)


def test_the_lock_of_a_killed_run_is_refused_while_it_lives_and_taken_over_after_kill_9(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=f"in use by another run \\(PID {holder.pid} on host "):
            RunLock.acquire(out)
        os.kill(holder.pid, signal.SIGKILL)  # the node dies: no clean-up runs in the holder
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid  # the stale file stays
    lock = RunLock.acquire(out)  # ... and is taken over: the kernel dropped the dead holder's flock
    try:
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_file_system_without_flock_is_one_paragraph(tmp_path, monkeypatch, code):
    """Lustre without ``-o flock`` (ENOSYS) or NFS without its lock service (ENOLCK) cannot be
    mounted here, so flock's answer on them is reproduced; the message names the mount option."""

    def no_flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(CheckpointError) as info:
        RunLock.acquire(tmp_path / "out")
    text = str(info.value)
    assert f"errno {code}" in text and "-o flock" in text and "docs/clusters.md" in text
    assert set(os.listdir("/proc/self/fd")) <= before  # the lock file's descriptor was closed
