"""Start-up: `corelooper --help`, and process start -> first optimizer step, vs a hand-written
script and the HF Trainer; `python -c "import torch"` is the floor every contender pays.

usage: python benchmarks/startup.py [--reps N] [--lean]   (run from the repository root, with
the benchmark venv's python so the HF Trainer is importable; prints a table, writes JSON)

All three contenders build the same one-kernel AdamW (``fused=True``: corelooper's default
``adamw_torch_fused``). corelooper runs as a user gets it (installed plugins autoload);
``--lean`` turns autoload off, to see what the installed plugins cost at start-up.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def wall(argv, env=None) -> float:
    t = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def to_first_step(argv, env=None) -> float:
    start = time.time()
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("FIRST_STEP "):
            return float(line.split()[1]) - start
    raise RuntimeError(f"{argv} printed no FIRST_STEP:\n{out[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "startup.json"))
    ap.add_argument("--lean", action="store_true", help="plugin autoload off for corelooper")
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if a.lean:
        env["CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    py = sys.executable
    cases = {
        "python -c pass": lambda: wall([py, "-c", "pass"]),
        "python -c 'import torch'": lambda: wall([py, "-c", "import torch"]),
        "corelooper --help": lambda: wall([str(BIN / "corelooper"), "--help"]),
        "raw script: first step": lambda: to_first_step([py, "benchmarks/startup/raw_first_step.py"], env),
        "corelooper run: first step": lambda: to_first_step(
            [str(BIN / "corelooper"), "run", "benchmarks/startup/config.toml"], env
        ),
        "HF Trainer: first step": lambda: to_first_step([py, "benchmarks/startup/hf_first_step.py"], env),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.reps):  # interleaved
        for name, fn in cases.items():
            try:
                times[name].append(fn())
            except Exception as e:  # e.g. transformers missing outside the benchmark venv
                print(f"{name}: {e}", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    torch_s = med.get("python -c 'import torch'", 0.0)
    print(f"{'case':32s} {'median s':>9s} {'beyond import torch':>20s}")
    for k, v in med.items():
        extra = f"{v - torch_s:20.3f}" if "first step" in k else ""
        print(f"{k:32s} {v:9.3f} {extra}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    later = [
        c - r
        for c, r in zip(times["corelooper run: first step"], times["raw script: first step"], strict=False)
    ]
    if later:
        print(
            f"corelooper's first step after the hand-written one's: median {statistics.median(later):.3f} s "
            f"(min-max {min(later):.3f}-{max(later):.3f}; goal <= 0.5 s)"
        )
    Path(a.out).write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "reps": a.reps,
                "lean": a.lean,
                "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                "median_s": med,
                "all_s": times,
                "corelooper_first_step_later_s": statistics.median(later) if later else None,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
