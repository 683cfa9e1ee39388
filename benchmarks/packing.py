"""Packing plan build time: corelooper's best-fit decreasing (segment tree) vs TRL's, on long-tailed
chat lengths.

    .venv/bin/python benchmarks/packing.py [--n 2000 8000 32000 65536] [--reps 3] [--trl]

Prints one JSON line per (method, n): median seconds over ``reps`` and the number of rows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def lengths(n: int, seed: int = 0) -> list[int]:
    """Long-tailed like chat SFT data: log-normal, 16..2048 tokens."""
    rng = random.Random(seed)
    return [max(16, min(2048, int(rng.lognormvariate(5.0, 0.9)))) for _ in range(n)]


def corelooper_plan(ls, capacity):
    from corelooper_lm.packing import plan_packing

    return len(plan_packing(ls, capacity, "bfd"))


def trl_plan(ls, capacity):
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    ds = Dataset.from_dict({"input_ids": [[1] * n for n in ls]})
    t = time.perf_counter()
    out = pack_dataset(ds, capacity, strategy="bfd")
    return len(out), time.perf_counter() - t


def timed(fn, ls, capacity, reps):
    times, rows = [], 0
    for _ in range(reps):
        t = time.perf_counter()
        result = fn(ls, capacity)
        elapsed = time.perf_counter() - t
        if isinstance(result, tuple):  # TRL: time the packing only, not building the Dataset
            result, elapsed = result
        times.append(elapsed)
        rows = result
    return statistics.median(times), min(times), max(times), rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[2000, 8000, 32000, 65536])
    ap.add_argument("--capacity", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trl", action="store_true", help="also time trl.data_utils.pack_dataset")
    args = ap.parse_args()
    methods = [("corelooper", corelooper_plan)] + ([("trl", trl_plan)] if args.trl else [])
    for n in args.n:
        ls = lengths(n)
        for name, fn in methods:
            med, lo, hi, rows = timed(fn, ls, args.capacity, args.reps)
            print(
                json.dumps(
                    {
                        "method": name,
                        "n": n,
                        "capacity": args.capacity,
                        "median_s": round(med, 4),
                        "min_s": round(lo, 4),
                        "max_s": round(hi, 4),
                        "rows": rows,
                        "tokens": sum(ls),
                        "reps": args.reps,
                        "load": round(os.getloadavg()[0], 2),
                    }
                )
            )


if __name__ == "__main__":
    main()
