"""Checkpoint save throughput against the disk's own fsync'd write bandwidth, in the same run.

usage: .venv/bin/python benchmarks/save_bandwidth.py [--mb 256] [--reps 5] [--dir /path/on/the/disk]
                                                    [--json benchmarks/results/save_bandwidth.json]

Per repetition, interleaved (the order alternates):
* **disk**: write as many bytes as corelooper's checkpoint holds into one file, in 16 MiB
  ``os.write`` chunks of a preallocated buffer, then ``fsync`` the file and its folder — the
  fastest a durable write of that size gets on this disk, through the page cache as every
  writer here.
* **corelooper**: ``corelooper.checkpoints.loop_side.save(loop)`` of a model with ``--mb`` MiB
  of fp32 weights after one AdamW step (so the checkpoint holds weights + 2x optimizer moments,
  scheduler, RNG, loop state, manifest — and the checksums once the trust work is merged: the
  save is timed as a user gets it), every file fsynced and renamed into place.

Reported: MiB/s of each, and corelooper's throughput as a share of the disk's (paired per
repetition; median and min-max). Goal (issue 19): >= 80%. ``--dir`` must be on the disk you
care about (default: a temp folder under the current directory, not /tmp, which may be tmpfs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # for benchmarks.*; an installed corelooper (or PYTHONPATH) wins

CHUNK = 16 * 2**20


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_write(path: Path, nbytes: int, buf: memoryview) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            n = os.write(fd, buf[: min(CHUNK, left)])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return time.perf_counter() - t


def make_loop(root: Path, mb: int):
    import torch

    from benchmarks.checkpoint_bench import Small, Wide
    from corelooper.config import TrainArgs
    from corelooper.loop import Loop

    torch.manual_seed(0)
    args = TrainArgs(
        output_dir=str(root / "run"),
        max_steps=1,
        save_strategy="no",
        per_device_train_batch_size=8,
        learning_rate=1e-4,
    )
    loop = Loop(Wide(mb), args, train_dataset=Small(), blocked_plugins=["console"])
    loop.train()  # one step: the AdamW moments exist
    return loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--mb",
        type=int,
        default=256,
        help="MiB of fp32 weights, in 16 MiB layers (checkpoint ~3x: + AdamW moments)",
    )
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of one save (top 25)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=str(HERE / "results" / "save_bandwidth.json"))
    a = ap.parse_args()
    from corelooper.checkpoints import loop_side as checkpoint  # save(loop): what the loop writes

    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="savebw-", dir=os.getcwd()))
    root.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    try:
        loop = make_loop(root, a.mb)
        rows: dict[str, list[float]] = {"corelooper_s": [], "disk_s": []}
        share = []
        loop.state.global_step = 99
        warm = checkpoint.save(loop)  # untimed: learns the size, warms the code paths
        nbytes = folder_bytes(warm)
        shutil.rmtree(warm)
        buf = memoryview(os.urandom(min(CHUNK, nbytes)))
        for rep in range(a.reps):
            loop.state.global_step = 100 + rep
            order = ("corelooper", "disk") if rep % 2 == 0 else ("disk", "corelooper")
            for what in order:
                if what == "corelooper":
                    t = time.perf_counter()
                    ckpt = checkpoint.save(loop)
                    rows["corelooper_s"].append(time.perf_counter() - t)
                    nbytes = folder_bytes(ckpt)
                    shutil.rmtree(ckpt)
                else:
                    rows["disk_s"].append(fsync_write(root / "disk.bin", nbytes, buf))
                    (root / "disk.bin").unlink()
            share.append(rows["disk_s"][-1] / rows["corelooper_s"][-1])
            print(
                f"rep {rep}: corelooper {rows['corelooper_s'][-1]:.3f}s disk {rows['disk_s'][-1]:.3f}s "
                f"share {share[-1]:.2%}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    mib = nbytes / 2**20
    med = {k: statistics.median(v) for k, v in rows.items()}
    weights = sum(t.numel() * t.element_size() for t in loop.model.state_dict().values()) / 2**20
    out = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        reps=a.reps,
        weights_MiB=round(weights, 1),
        checkpoint_MiB=round(mib, 1),
        dir=str(root),
        loadavg_start=[round(x, 2) for x in load_start],
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
        median_s={k: round(v, 4) for k, v in med.items()},
        disk_MiB_per_s=round(mib / med["disk_s"], 1),
        corelooper_MiB_per_s=round(mib / med["corelooper_s"], 1),
        corelooper_share_of_disk=round(statistics.median(share), 4),
        corelooper_share_of_disk_range=[round(min(share), 4), round(max(share), 4)],
        goal_share=0.8,
        met=statistics.median(share) >= 0.8,
        all=rows,
    )
    print(
        f"checkpoint {mib:.0f} MiB: disk (write+fsync) {out['disk_MiB_per_s']} MiB/s, corelooper save "
        f"{out['corelooper_MiB_per_s']} MiB/s = {out['corelooper_share_of_disk']:.0%} of the disk "
        f"(min-max {share and min(share):.0%}-{share and max(share):.0%}; goal >= 80%: "
        f"{'met' if out['met'] else 'NOT met'})"
    )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    if a.profile:
        profile_one_save(a.mb)


def profile_one_save(mb: int) -> None:
    """Where a save's time goes (the gap to the disk's bandwidth), by cumulative time."""
    import cProfile
    import pstats

    from corelooper.checkpoints import loop_side as checkpoint  # save(loop): what the loop writes

    root = Path(tempfile.mkdtemp(prefix="savebw-prof-", dir=os.getcwd()))
    try:
        loop = make_loop(root, mb)
        loop.state.global_step = 7
        prof = cProfile.Profile()
        prof.enable()
        checkpoint.save(loop)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
