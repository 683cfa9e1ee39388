"""Overhead of corelooper-doctor on a healthy run: doctor on vs off, interleaved (on, off, on, ...).

usage: .venv/bin/python benchmarks/doctor_overhead.py [--workload B] [--reps 5] [--steps 50]

Workload B of benchmarks/overhead (tiny LlamaForCausalLM, batch 8, seq 128, 2 threads) by default;
A (the overhead-dominated MLP) with --workload A. Both variants run in this one process, the
model rebuilt from the same seed each time; the figure is the median of the paired ratios
on / off of ``loop.train()`` wall time. Writes benchmarks/results/doctor_overhead_<workload>.json (wall and process CPU time).
Goal (issue 16): < 2% on workload B, and no per-step host-device sync.
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

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "overhead"))
os.environ["CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only what each variant names

import common as C  # noqa: E402


def one_run(workload: str, steps: int, doctor: bool) -> float:
    import corelooper_doctor

    from corelooper import Loop
    from corelooper.config import Config

    cfg = C.WORKLOADS[workload]
    outdir = tempfile.mkdtemp(prefix="cl_doctor_bench_")
    config = Config.from_dict({"train": dict(
        output_dir=outdir, max_steps=steps, per_device_train_batch_size=cfg["batch_size"],
        learning_rate=C.LR, lr_scheduler_type="linear", max_grad_norm=C.MAX_GRAD_NORM,
        logging_steps=min(cfg["log_every"], max(1, steps // 5)), save_strategy="no", seed=C.SEED,
        disable_tqdm=True, use_cpu=True)})
    loop = Loop(C.make_model(workload), config, train_dataset=C.make_dataset(workload),
                plugins=[corelooper_doctor] if doctor else [], blocked_plugins=["console"])
    t, c = time.perf_counter(), time.process_time()
    loop.train()
    elapsed, cpu = time.perf_counter() - t, time.process_time() - c
    shutil.rmtree(outdir, ignore_errors=True)
    return elapsed, cpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="B", choices=["A", "B"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=None)
    a = p.parse_args()
    C.preload_torch()
    C.setup_threads(a.workload)
    steps = a.steps or C.WORKLOADS[a.workload]["steps"]
    one_run(a.workload, max(2, steps // 10), True)  # warm-up: imports, first AdamW (dynamo)
    ratios, cpu_ratios, on, off = [], [], [], []
    for _ in range(a.reps):
        t_on, c_on = one_run(a.workload, steps, True)
        t_off, c_off = one_run(a.workload, steps, False)
        on.append(t_on)
        off.append(t_off)
        ratios.append(t_on / t_off)
        cpu_ratios.append(c_on / c_off)
    result = {"workload": a.workload, "steps": steps, "reps": a.reps,
              "median_ratio_on_off": round(statistics.median(ratios), 4),
              "median_cpu_ratio_on_off": round(statistics.median(cpu_ratios), 4),
              "ratios": [round(r, 4) for r in ratios], "cpu_ratios": [round(r, 4) for r in cpu_ratios],
              "on_s": on, "off_s": off,
              "note": "2 shared CPU cores, loaded machine: read the paired ratio, not the times"}
    out = HERE / "results" / f"doctor_overhead_{a.workload}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"workload {a.workload}, {steps} steps, {a.reps} pairs: doctor on / off = "
          f"{result['median_ratio_on_off']:.3f} wall, {result['median_cpu_ratio_on_off']:.3f} CPU time "
          f"(medians; wall pairs {result['ratios']})")


if __name__ == "__main__":
    main()
