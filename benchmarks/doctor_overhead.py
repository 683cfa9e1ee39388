"""Overhead of corelooper-doctor on a healthy run: doctor on vs off, interleaved (on, off, on, ...).

usage: .venv/bin/python benchmarks/doctor_overhead.py [--workload A|B|both] [--reps 5] [--steps N] [--out DIR]

Both workloads of benchmarks/overhead by default, one after the other: A (the overhead-dominated
MLP, ~1-2 ms steps, 1 thread) and B (tiny LlamaForCausalLM, batch 8, seq 128, 2 threads). Both
variants run in this one process, the model rebuilt from the same seed each time, the doctor in
its default settings (on by default once installed: time split, memory, spikes from the logged
loss, hang watchdog). Per workload: the median of the paired ratios on / off of ``loop.train()``
wall and process CPU time, and the doctor's cost per optimizer step in µs (median of the paired
(on - off) / steps). Writes DIR/doctor_overhead_<workload>.json (DIR: benchmarks/results; pass
``--out`` for a smoke run, e.g. ``--reps 1 --steps 10 --out /tmp``, so the recorded figures stay).
Goal (issue 16): < 2% on workload B, and no per-step host-device sync (plugins/doctor/tests/
test_spikes.py checks what the doctor reads from the device and when).
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


def make_loop(workload: str, steps: int, doctor: bool, outdir: str):
    import corelooper_doctor

    from corelooper import Loop
    from corelooper.config import Config

    cfg = C.WORKLOADS[workload]
    config = Config.from_dict(
        {
            "train": dict(
                output_dir=outdir,
                max_steps=steps,
                per_device_train_batch_size=cfg["batch_size"],
                learning_rate=C.LR,
                lr_scheduler_type="linear",
                max_grad_norm=C.MAX_GRAD_NORM,
                logging_steps=min(cfg["log_every"], max(1, steps // 5)),
                save_strategy="no",
                seed=C.SEED,
                disable_tqdm=True,
                use_cpu=True,
            )
        }
    )
    return Loop(
        C.make_model(workload),
        config,
        train_dataset=C.make_dataset(workload),
        plugins=[corelooper_doctor] if doctor else [],
        blocked_plugins=["console"],
    )


def one_run(workload: str, steps: int, doctor: bool) -> tuple[float, float]:
    outdir = tempfile.mkdtemp(prefix="cl_doctor_bench_")
    loop = make_loop(workload, steps, doctor, outdir)
    t, c = time.perf_counter(), time.process_time()
    loop.train()
    elapsed, cpu = time.perf_counter() - t, time.process_time() - c
    shutil.rmtree(outdir, ignore_errors=True)
    return elapsed, cpu


#: The events that fire inside every optimizer step (the rest: per log, epoch, run).
STEP_HOOKS = {
    "on_step_begin",
    "on_before_backward",
    "on_after_backward",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
}


def doctor_hooks(workload: str, steps: int) -> dict:
    """One more run with the doctor, its hook implementations timed (``--profile-plugins``'s
    profiler): which of its hooks run per step, and the µs per step spent inside them (pluggy's
    dispatch, ~1 µs a call, not included). Less sensitive to a loaded machine than on / off."""
    from corelooper.cli.profiling import PluginProfiler

    outdir = tempfile.mkdtemp(prefix="cl_doctor_bench_")
    loop = make_loop(workload, steps, True, outdir)
    profiler = PluginProfiler(loop.plugins)
    loop.train()
    shutil.rmtree(outdir, ignore_errors=True)
    mine = {k: v for k, v in profiler.seconds.items() if k[0].startswith("doctor")}
    in_steps = sum(v for (_, h), v in mine.items() if h in STEP_HOOKS)
    return {
        "doctor_hook_us_per_step": round(sum(mine.values()) / steps * 1e6, 1),
        "doctor_step_hooks_us_per_step": round(in_steps / steps * 1e6, 1),
        "doctor_hooks": {
            f"{p}.{h}": {
                "calls_per_step": round(profiler.calls[(p, h)] / steps, 3),
                "us_per_call": round(v / profiler.calls[(p, h)] * 1e6, 1),
            }
            for (p, h), v in sorted(mine.items())
        },
    }


def measure(workload: str, steps: int, reps: int) -> dict:
    C.setup_threads(workload)
    one_run(workload, max(2, steps // 10), True)  # warm-up: imports, first AdamW (dynamo)
    on, off, on_cpu, off_cpu = [], [], [], []
    for _ in range(reps):
        t_on, c_on = one_run(workload, steps, True)
        t_off, c_off = one_run(workload, steps, False)
        on.append(t_on)
        off.append(t_off)
        on_cpu.append(c_on)
        off_cpu.append(c_off)
    pairs = list(zip(on, off, strict=True))
    cpu_pairs = list(zip(on_cpu, off_cpu, strict=True))
    return {
        "workload": workload,
        "steps": steps,
        "reps": reps,
        "median_ratio_on_off": round(statistics.median(a / b for a, b in pairs), 4),
        "median_cpu_ratio_on_off": round(statistics.median(a / b for a, b in cpu_pairs), 4),
        "median_us_per_step_on_minus_off": round(
            statistics.median((a - b) / steps * 1e6 for a, b in pairs), 1
        ),
        "median_cpu_us_per_step_on_minus_off": round(
            statistics.median((a - b) / steps * 1e6 for a, b in cpu_pairs), 1
        ),
        "median_ms_per_step_off": round(statistics.median(off) / steps * 1e3, 3),
        "ratios": [round(a / b, 4) for a, b in pairs],
        "cpu_ratios": [round(a / b, 4) for a, b in cpu_pairs],
        "on_s": on,
        "off_s": off,
        "on_cpu_s": on_cpu,
        "off_cpu_s": off_cpu,
        **doctor_hooks(workload, steps),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "note": "paired runs in one process; on a loaded machine read the paired ratio, not the times",
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="both", choices=["A", "B", "both"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=None, help="default: the workload's (A 300, B 50)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder of the JSON results")
    a = p.parse_args()
    C.preload_torch()
    a.out.mkdir(parents=True, exist_ok=True)
    for workload in ["A", "B"] if a.workload == "both" else [a.workload]:
        result = measure(workload, a.steps or C.WORKLOADS[workload]["steps"], a.reps)
        out = a.out / f"doctor_overhead_{workload}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(
            f"workload {workload}, {result['steps']} steps, {a.reps} pairs: doctor on / off = "
            f"{result['median_ratio_on_off']:.3f} wall, {result['median_cpu_ratio_on_off']:.3f} CPU time; "
            f"{result['median_us_per_step_on_minus_off']:+.1f} µs wall, "
            f"{result['median_cpu_us_per_step_on_minus_off']:+.1f} µs CPU per step "
            f"(off: {result['median_ms_per_step_off']:.3f} ms/step; medians; wall pairs {result['ratios']}); "
            f"inside the doctor's hooks: {result['doctor_hook_us_per_step']:.1f} µs per step, "
            f"{result['doctor_step_hooks_us_per_step']:.1f} of them in its per-step hooks -> {out}",
            flush=True,
        )


if __name__ == "__main__":
    main()
