"""Resume time against the position in the epoch: start, middle, end.

usage: .venv/bin/python benchmarks/resume_position.py [--samples 2000000] [--reps 5]
                                                     [--json benchmarks/results/resume_position.json]

A data set whose ``__getitem__`` does real work (benchmarks/checkpoint_bench.py's ``Costly``: a
few hundred µs per sample, as decoding or tokenising would), ``--samples`` samples per epoch,
batch 32. Three checkpoints of the same weights, 1 step, 50% and 99% into the epoch (only the
loop position differs). Each resume is timed from ``train(resume_from_checkpoint=...)`` to the
end of the first optimizer step after it, the three positions interleaved (rotated order).
Goal (issue 19): resume time independent of the position — middle/start and end/start ~1.0.
For scale: what re-reading the skipped batches would cost (a sampler-level skip such as
``accelerate.skip_first_batches`` on a plain DataLoader), extrapolated from 200 batches.
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

BATCH = 32
POSITIONS = {"start": None, "middle": 0.5, "end": 0.99}


def make(root: Path, samples: int, max_steps: int):
    import torch

    from benchmarks.checkpoint_bench import Costly, Tiny
    from corelooper.config import TrainArgs
    from corelooper.loop import Loop

    torch.manual_seed(0)
    args = TrainArgs(
        output_dir=str(root / "resume"),
        max_steps=max_steps,
        save_strategy="no",
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        overwrite_output_dir=True,
    )
    return Loop(Tiny(), args, train_dataset=Costly(samples), blocked_plugins=["console"])


def checkpoints(root: Path, samples: int) -> dict[str, tuple[Path, int]]:
    from corelooper.checkpoints import loop_side as checkpoint  # save(loop): what the loop writes

    steps_per_epoch = -(-samples // BATCH)
    base = make(root, samples, 1)
    base.train()
    out = {}
    for name, frac in POSITIONS.items():
        step = 1 if frac is None else int(steps_per_epoch * frac)
        base.state.global_step = base.state.step_in_epoch = step
        base.state.micro_batches_in_epoch = step
        base.state.epoch = step / steps_per_epoch
        ckpt = checkpoint.save(base)
        keep = root / f"ckpt-{name}"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.move(str(ckpt), keep)  # out of output_dir: a resumed run may rotate its folder
        out[name] = (keep, step)
    return out


def reread_cost(samples: int, steps: int) -> float:
    from benchmarks.checkpoint_bench import Costly

    ds, n = Costly(samples), 50
    t = time.perf_counter()
    for b in range(n):
        [ds[i] for i in range(b * BATCH, (b + 1) * BATCH)]
    return (time.perf_counter() - t) / n * steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=str(HERE / "results" / "resume_position.json"))
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="resumepos-"))
    load_start = os.getloadavg()
    times: dict[str, list[float]] = {k: [] for k in POSITIONS}
    try:
        ckpts = checkpoints(root, a.samples)
        names = list(POSITIONS)
        for rep in range(a.reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                path, step = ckpts[name]
                loop = make(root, a.samples, step + 1)
                t = time.perf_counter()
                loop.train(resume_from_checkpoint=str(path))
                times[name].append(time.perf_counter() - t)
                assert loop.state.global_step == step + 1, (name, loop.state.global_step)
            print(f"rep {rep}: " + " ".join(f"{n} {times[n][-1]:.3f}s" for n in names), file=sys.stderr)
        steps = {n: ckpts[n][1] for n in names}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {f"{k}_over_start": round(med[k] / med["start"], 3) for k in ("middle", "end")}
    out = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        reps=a.reps,
        samples_per_epoch=a.samples,
        steps_per_epoch=-(-a.samples // BATCH),
        position_step=steps,
        loadavg_start=[round(x, 2) for x in load_start],
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
        median_s={k: round(v, 4) for k, v in med.items()},
        range_s={k: [round(min(v), 4), round(max(v), 4)] for k, v in times.items()},
        **ratio,
        rereading_skipped_batches_at_end_would_take_s=round(reread_cost(a.samples, steps["end"]), 1),
    )
    for k in POSITIONS:
        print(
            f"resume at {k:6s} (step {steps[k]:>8d}): {med[k]:.3f} s  (min-max {min(times[k]):.3f}-{max(times[k]):.3f})"
        )
    print(
        f"middle/start {ratio['middle_over_start']}, end/start {ratio['end_over_start']}; re-reading the "
        f"skipped batches would take ~{out['rereading_skipped_batches_at_end_would_take_s']} s"
    )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
