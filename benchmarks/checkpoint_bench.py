"""Checkpoint costs: save / load of a ~100 MB model vs plain torch.save / torch.load of the same
state, and resume time at the start vs deep inside a large epoch.

usage: .venv/bin/python benchmarks/checkpoint_bench.py [--reps 5] [--mb 100] [--samples 2000000]
                                                       [--dir /tmp/ckbench] [--json out.json]

Save: ``corelooper.checkpoints.checkpoint.save_checkpoint`` (safetensors weights, optimizer/scheduler/RNG,
loop and plugin state, config, every file fsynced, a finite-weights check, a manifest with an
xxh3-128 checksum per file, atomic rename; the hashing alone is also timed, with blake2b for
comparison) against
``torch.save({"model", "optimizer", "scheduler", "rng"})`` of the same state into one file, with
and without an fsync. Load: ``load_checkpoint`` (manifest + header checks, then weights,
optimizer, scheduler, RNG restored into the live objects) against ``torch.load`` +
``load_state_dict``. Runs are interleaved and the median over ``--reps`` is reported, with the
ratio to the plain torch baseline taken per repetition (the machine is shared and noisy).
The page cache is warm for both sides (files were just written), as on a resume that follows a
save on the same node; cold-cache reads would add the disk's read time to both.

Resume: a dataset whose ``__getitem__`` costs real work (a few hundred microseconds, as decoding
an image or tokenising would), ``--samples`` samples per epoch. One checkpoint at step 1 and one
whose position is 99% into the epoch (same weights; the loop position is what differs); each
resume is timed from ``train(resume_from_checkpoint=...)`` to the end of the first step after it.
For scale, the cost of *reading* the skipped batches (what a sampler-level skip like
``accelerate.skip_first_batches`` on a plain DataLoader pays) is extrapolated from timing 200
batches.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")

from corelooper.checkpoints import checkpoint, manifest  # noqa: E402
from corelooper.checkpoints.loop_side import run_parts  # noqa: E402
from corelooper.config import TrainArgs  # noqa: E402
from corelooper.loop import Loop  # noqa: E402
from corelooper.seeding import rng_state, set_rng_state  # noqa: E402


class Wide(nn.Module):
    """An MLP of ``mb`` MB of fp32 weights (square layers of width 2048)."""

    def __init__(self, mb: int):
        super().__init__()
        width = 2048
        layers = max(1, round(mb * 2**20 / 4 / (width * width)))
        self.inp = nn.Linear(16, width)
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        return self.out(self.body(self.inp(x)))


class Small(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)


class Costly(torch.utils.data.Dataset):
    """A large epoch of samples that cost work to produce (as decoding or tokenising would)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, 32, generator=g)
        return {"x": (x @ x.T)[0, :16] / 32, "labels": torch.tensor(i % 4)}


def save(loop: Loop) -> Path:
    """The public API, as the loop calls it."""
    return checkpoint.save_checkpoint(Path(loop.args.output_dir), run_parts(loop), plugin_states={})


def load(loop: Loop, ckpt: Path) -> None:
    checkpoint.load_checkpoint(ckpt, run_parts(loop)).apply(loop.state)


def hash_time(ckpt: Path, algorithm: str) -> float:
    """Seconds to checksum every file of ``ckpt`` (warm page cache, as right after the save)."""
    t = time.perf_counter()
    for p in sorted(ckpt.iterdir()):
        if p.is_file() and p.name != manifest.MANIFEST:
            manifest.checksum(p, algorithm)
    return time.perf_counter() - t


def median(xs):
    return statistics.median(xs)


def bench_save_load(root: Path, mb: int, reps: int) -> dict:
    out = root / "run"
    torch.manual_seed(0)
    args = TrainArgs(
        output_dir=str(out),
        max_steps=1,
        save_strategy="no",
        per_device_train_batch_size=8,
        learning_rate=1e-4,
    )
    loop = Loop(Wide(mb), args, train_dataset=Small(), blocked_plugins=["console"])
    loop.train()  # one step: AdamW moments exist (the optimizer state is 2x the weights)
    weights_mb = sum(t.numel() * t.element_size() for t in loop.model.state_dict().values()) / 2**20
    plain = root / "plain.pt"

    def plain_save(fsync: bool):
        state = {
            "model": loop.model.state_dict(),
            "optimizer": loop.optimizer.state_dict(),
            "scheduler": loop.scheduler.state_dict(),
            "rng": rng_state(),
        }
        torch.save(state, plain)
        if fsync:
            with open(plain, "rb") as f:
                os.fsync(f.fileno())

    def plain_load():
        state = torch.load(plain, map_location="cpu", weights_only=True)
        loop.model.load_state_dict(state["model"])
        loop.optimizer.load_state_dict(state["optimizer"])
        loop.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])

    rows = {
        k: []
        for k in (
            "corelooper_save",
            "torch_save",
            "torch_save_fsync",
            "corelooper_load",
            "torch_load",
            "xxh3_128_hash",
            "blake2b_hash",
        )
    }
    ratios = {"save_vs_torch_save": [], "save_vs_torch_save_fsync": [], "load_vs_torch_load": []}
    for rep in range(reps):
        loop.state.global_step = 100 + rep
        t = time.perf_counter()
        ckpt = save(loop)
        rows["corelooper_save"].append(time.perf_counter() - t)
        rows["xxh3_128_hash"].append(hash_time(ckpt, "xxh3_128"))  # inside the save above, once more
        rows["blake2b_hash"].append(hash_time(ckpt, "blake2b-128"))
        for fsync in (False, True) if rep % 2 == 0 else (True, False):
            t = time.perf_counter()
            plain_save(fsync)
            rows["torch_save_fsync" if fsync else "torch_save"].append(time.perf_counter() - t)
        t = time.perf_counter()
        load(loop, ckpt)
        rows["corelooper_load"].append(time.perf_counter() - t)
        t = time.perf_counter()
        plain_load()
        rows["torch_load"].append(time.perf_counter() - t)
        ratios["save_vs_torch_save"].append(rows["corelooper_save"][-1] / rows["torch_save"][-1])
        ratios["save_vs_torch_save_fsync"].append(rows["corelooper_save"][-1] / rows["torch_save_fsync"][-1])
        ratios["load_vs_torch_load"].append(rows["corelooper_load"][-1] / rows["torch_load"][-1])
        ckpt_mb = sum(p.stat().st_size for p in ckpt.iterdir()) / 2**20
        shutil.rmtree(ckpt)
    return {
        "weights_MiB": round(weights_mb, 1),
        "checkpoint_MiB": round(ckpt_mb, 1),
        "plain_file_MiB": round(plain.stat().st_size / 2**20, 1),
        "median_s": {k: round(median(v), 3) for k, v in rows.items()},
        "median_ratio": {k: round(median(v), 2) for k, v in ratios.items()},
    }


def bench_resume(root: Path, samples: int, reps: int) -> dict:
    out = root / "resume"
    batch = 32

    def make(max_steps: int) -> Loop:
        torch.manual_seed(0)
        args = TrainArgs(
            output_dir=str(out),
            max_steps=max_steps,
            save_strategy="no",
            per_device_train_batch_size=batch,
            learning_rate=1e-3,
            overwrite_output_dir=True,
        )
        return Loop(Tiny(), args, train_dataset=Costly(samples), blocked_plugins=["console"])

    steps_per_epoch = -(-samples // batch)
    deep_step = int(steps_per_epoch * 0.99)
    base = make(1)
    base.train()
    start_ckpt = save(base)  # checkpoint-1: 1 step into the epoch
    base.state.global_step = base.state.step_in_epoch = deep_step
    base.state.micro_batches_in_epoch = deep_step
    base.state.epoch = deep_step / steps_per_epoch
    deep_ckpt = save(base)  # same weights, 99% into the epoch

    times = {"start": [], "deep": []}
    for rep in range(reps):
        order = [("start", start_ckpt, 1), ("deep", deep_ckpt, deep_step)]
        for name, ckpt, step in order[:: 1 if rep % 2 == 0 else -1]:  # alternate who goes first
            loop = make(step + 1)
            t = time.perf_counter()
            loop.train(resume_from_checkpoint=ckpt)
            times[name].append(time.perf_counter() - t)
            assert loop.state.global_step == step + 1

    ds, n = Costly(samples), 200
    t = time.perf_counter()
    for b in range(n):
        [ds[i] for i in range(b * batch, (b + 1) * batch)]
    per_batch = (time.perf_counter() - t) / n
    return {
        "samples_per_epoch": samples,
        "steps_per_epoch": steps_per_epoch,
        "deep_position_step": deep_step,
        "median_s": {k: round(median(v), 3) for k, v in times.items()},
        "deep_over_start": round(median(times["deep"]) / median(times["start"]), 2),
        "reading_skipped_batches_would_take_s": round(per_batch * deep_step, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--samples", type=int, default=2_000_000)
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp folder, removed after)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    a = p.parse_args()
    import tempfile

    root = Path(a.dir or tempfile.mkdtemp(prefix="ckbench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        results = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "reps": a.reps,
            "save_load": bench_save_load(root, a.mb, a.reps),
            "resume": bench_resume(root, a.samples, a.reps),
        }
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(results, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
