"""The GPU benchmark driver: every step of steps.py in its own process, each guarded (a failure or
a timeout is recorded and the next step runs), under a total time budget; one JSON file.

usage: python benchmarks/gpu/bench.py [--budget-s 420] [--steps a,b,...] [--out FILE]
       python benchmarks/gpu/bench.py --cpu-smoke      # tiny sizes on a CPU: validates the script
       python benchmarks/gpu/bench.py --dry-run        # list the steps and the plan, run nothing

Writes benchmarks/results/gpu-<date>.json (``--cpu-smoke``: $TMPDIR/gpu-smoke-<date>.json) with the
environment (GPU, torch, CUDA, packages), every step's result or error, its wall time, and the
ratios corelooper / hand-written for the paired steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

# Rough seconds per step on one H200 (model build + warm-up + steps): a step is skipped when the
# budget left is below its estimate, so the run ends in time with a line saying what was skipped.
ESTIMATE_S = {
    "raw_bf16_compile": 60,
    "cl_bf16_compile": 60,
    "auto_batch_size_real_oom": 60,
    "cl_bf16_liger": 45,
}  # Triton compiles Liger's kernels on the first step
DEFAULT_ESTIMATE_S = 25
PAIRS = [
    ("cl_bf16_full", "raw_bf16_full"),
    ("cl_bf16_lora", "raw_bf16_lora"),
    ("cl_fp16_scaler", "raw_fp16_scaler"),
    ("cl_bf16_compile", "raw_bf16_compile"),
    ("cl_packing_flash_varlen", "cl_packing_sdpa"),
    ("cl_packing_segment_sdpa", "cl_packing_sdpa"),
    ("cl_fsdp2_1gpu", "cl_bf16_full"),
    ("cl_zero2_1gpu", "cl_bf16_full"),
    ("cl_bf16_liger", "cl_bf16_full"),
    ("cl_bf16_trained_head", "cl_bf16_full"),
]
# What every step needs: without it no step can run, so the script says so and exits 2.
NEEDS = {
    "torch": "torch",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "safetensors": "safetensors",
    "corelooper": "-e . (this repository)",
}
ESTIMATE_S["eval_cl_vs_hf"] = 40
ESTIMATE_S["sft_chat_peers_bf16"] = 170  # steps.SFT_SECONDS + the last repetition
ESTIMATE_S["qwen05b_peers_bf16"] = 190  # steps.QWEN_SECONDS and the cut row's end
# Named in --steps only: the default run fits 8 minutes on an H100/H200 (~27 s per step measured).
# The torch_compile pair (~155 s on the H200, 0.998x since its fix) left the default run to make
# room for the Qwen2.5-0.5B rows (issue 49); name them to run them.
OPT_IN = {"sft_chat_peers_bf16", "raw_bf16_compile", "cl_bf16_compile"}
CPU_SKIP = {
    "cl_fp16_scaler": "fp16 with GradScaler needs CUDA in corelooper (it refuses fp16 on CPU)",
    "raw_bf16_compile": "torch.compile (inductor) needs a C++ toolchain and minutes on a CPU",
    "cl_bf16_compile": "torch.compile (inductor) needs a C++ toolchain and minutes on a CPU",
    "cl_bf16_liger": "Liger's Triton kernels need a CUDA GPU (corelooper-liger is inactive on CPU)",
}


def environment() -> dict:
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0]}
    try:
        import torch

        out.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1))
    except Exception as e:  # noqa: BLE001 — recorded, not fatal
        out["torch_error"] = repr(e)
    from importlib.metadata import PackageNotFoundError, version

    for pkg in (
        "transformers",
        "peft",
        "accelerate",
        "deepspeed",
        "flash-attn",
        "liger-kernel",
        "triton",
        "corelooper",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def child(step: str, size: str, out_path: str) -> None:
    import steps

    t = time.perf_counter()
    os.environ[steps.PARTIAL_ENV] = f"{out_path}.partial"
    try:
        result = steps.STEPS[step](size)
    except Exception as e:  # noqa: BLE001 — the driver records it and goes on
        import traceback

        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["wall_s"] = round(time.perf_counter() - t, 2)
    Path(out_path).write_text(json.dumps(result))


def run_step(step: str, size: str, timeout: float) -> dict:
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-bench-{os.getpid()}-{step}.json"
    partial = Path(f"{tmp}.partial")
    t = time.perf_counter()
    try:
        p = subprocess.run(
            [
                sys.executable,
                str(HERE / "bench.py"),
                "--child",
                step,
                "--size",
                size,
                "--child-out",
                str(tmp),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if tmp.exists():
            res = json.loads(tmp.read_text())
        else:
            res = {
                "error": f"the step's process ended (rc {p.returncode}) without a result",
                "stderr": p.stderr[-3000:],
            }
    except subprocess.TimeoutExpired:
        res = {"error": f"timed out after {timeout:.0f} s"}
        if partial.exists():  # what the step had done by then (steps.write_partial)
            res = {**json.loads(partial.read_text()), **res, "partial": True}
    finally:
        tmp.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    res["process_s"] = round(time.perf_counter() - t, 2)
    return res


def ratios(results: dict) -> dict:
    out = {}
    for a, b in PAIRS:
        ra, rb = results.get(a, {}), results.get(b, {})
        if "tokens_per_s" in ra and "tokens_per_s" in rb:
            out[f"{a}/{b}"] = {
                "tokens_per_s": round(ra["tokens_per_s"] / rb["tokens_per_s"], 3),
                "peak_mem": round(ra["peak_mem_gib"] / rb["peak_mem_gib"], 3)
                if rb.get("peak_mem_gib")
                else None,
            }
    return out


def write_summary(out: Path, env: dict, size: str, budget_s: float, results: dict) -> dict:
    import steps

    summary = {
        "environment": env,
        "size": size,
        "sizes": steps.SIZES[size],
        "budget_s": budget_s,
        "results": results,
        "ratios": ratios(results),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    import steps

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--budget-s", type=float, default=420, help="total seconds for all steps (install not included)"
    )
    ap.add_argument(
        "--steps",
        default=",".join(n for n in steps.STEPS if n not in OPT_IN),
        help=f"comma list (default: all but {', '.join(sorted(OPT_IN))})",
    )
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="full", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.size, a.child_out)
        return
    size = "smoke" if a.cpu_smoke else "full"
    names = a.steps.split(",")
    unknown = [n for n in names if n not in steps.STEPS]
    if unknown:
        sys.exit(f"unknown step(s) {unknown}; known: {', '.join(steps.STEPS)}")
    if a.dry_run:
        print(f"size {size}: {steps.SIZES[size]}")
        for n in names:
            print(f"  {n:28s} ~{ESTIMATE_S.get(n, DEFAULT_ESTIMATE_S)} s")
        return
    missing = [f"{m} (pip install {how})" for m, how in NEEDS.items() if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"{sys.executable} lacks what every step needs: {', '.join(missing)}. Run bash scripts/setup "
            "(then .venv/bin/python), or let run.sh install them (without SKIP_INSTALL=1).",
            file=sys.stderr,
        )
        sys.exit(2)
    env = environment()
    print(json.dumps(env), flush=True)
    deadline = time.perf_counter() + a.budget_s
    results: dict = {}
    stamp = time.strftime("%Y-%m-%d")
    # A smoke run's numbers are not figures: they go to the temp folder, not benchmarks/results.
    default = (
        Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-smoke-{stamp}.json"
        if a.cpu_smoke
        else ROOT / "benchmarks" / "results" / f"gpu-{stamp}.json"
    )
    out = Path(a.out or default)
    for n in names:
        left = deadline - time.perf_counter()
        est = ESTIMATE_S.get(n, DEFAULT_ESTIMATE_S) if size == "full" else 5
        if a.cpu_smoke and n in CPU_SKIP:
            results[n] = {"skipped": CPU_SKIP[n]}
        elif left < est:
            results[n] = {"skipped": f"time budget: {left:.0f} s left, the step needs ~{est} s"}
        else:
            results[n] = run_step(n, size, timeout=max(10.0, left))
        r = results[n]
        brief = {
            k: r[k]
            for k in (
                "tokens_per_s",
                "mfu",
                "peak_mem_gib",
                "step_s",
                "doctor_host_syncs_per_step",
                "fastest_row",
                "reps",
                "skipped",
                "error",
            )
            if k in r
        }
        print(f"{n:28s} {json.dumps(brief)}", flush=True)
        summary = write_summary(
            out, env, size, a.budget_s, results
        )  # after each step: a killed run keeps its steps
    print(json.dumps(summary["ratios"], indent=1))
    print(f"wrote {out}")
    errors = [n for n, r in results.items() if "error" in r]
    if errors:  # a step that errors is a failed run, not a skip
        print(f"{len(errors)} step(s) errored: {', '.join(errors)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
