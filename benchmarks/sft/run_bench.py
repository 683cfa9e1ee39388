"""SFT throughput on uneven chat data: HF Trainer, TRL SFTTrainer and corelooper, same samples,
same number of samples seen, interleaved repetitions.

usage: benchmarks/.venv/bin/python benchmarks/sft/run_bench.py [--reps 5] [--methods a,b,...]
           [--samples 512] [--cl-packing auto|collators|packing] [--out benchmarks/results/sft.json]
           [-- extra run_one.py flags]
       benchmarks/.venv/bin/python benchmarks/sft/run_bench.py --profile trl_padding_free [--samples 128]

Each (method, repetition) is its own process (run_one.py), the methods in a rotated order per
repetition, repetition r using seed r for model init and data order (the data itself is fixed),
so the spread of the eval loss over repetitions is the run-to-run noise every method is
compared with. Reported per method (medians over repetitions, with min-max): trained
(non -100) tokens per second of the framework call (construction + training, so data
preparation such as packing counts), padding share of the computed positions, peak RSS of the
process, and eval loss after the epoch (common.eval_loss, the same measurement for all).
Ratios: corelooper's padding-free row (leak-free, the same samples per optimizer step as the
padded rows; the LM head over trained positions only, as in an [sft] run) against TRL's best and
HF's best rows and the hand-written loop over the same layout, in the steady state (first to last
optimizer step: the goal line; regression floors in GOALS, each judged on the bootstrap 95%
interval of the per-repetition ratios: "met", "NOT met" or "inconclusive" when the interval
crosses the floor; eval loss within the padded rows' noise), over the whole call beside them;
the CPU model and flags are in the result (``cpu``); and corelooper's packed row against TRL's packed row (both pack
the data set: other steps, other loss). Rows: HF (padded, group_by_length,
DataCollatorWithFlattening), TRL (padded, group_by_length, padding_free, packing), each peer's
padding-free path again with corelooper's attention kernel (``*_seg``), the hand-written loop
(``raw_padding_free``), corelooper (padded, grouped, packed, padding-free, padding-free with the
head over every position: ``cl_padding_free_all``).

--profile METHOD: one run of METHOD under cProfile; prints the top functions by cumulative and
by own time (where a path loses time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALL = [
    "hf_padded",
    "hf_grouped",
    "hf_flattening",
    "hf_flattening_seg",
    "trl_padded",
    "trl_grouped",
    "trl_padding_free",
    "trl_padding_free_seg",
    "trl_packing_bfd",
    "raw_padding_free",
    "cl_padded",
    "cl_grouped",
    "cl_packed",
    "cl_padding_free",
    "cl_padding_free_all",
]
# Regression floors for cl_padding_free (issue 49), in the steady state (trained tokens/s from the
# first optimizer step's end to the last: construction and the first step's warm-up left out),
# judged on the 95% interval of the per-repetition ratios: >= 1.5x TRL's best, >= 1.25x HF's best
# (each the best of the peer's documented settings by its steady-state median: the *_seg rows, a
# peer given corelooper's kernel, are reported beside them), >= 1.1x the hand-written loop computing
# every position over the same layout and batches. Issue 28's 2.0x / 1.5x / 1.2x were dropped: the
# work floor, as counted (work.py; benchmarks/README.md), allows 1.83-1.98x / 1.50-1.55x / 1.255x.
GOALS = {"trl_best": 1.5, "hf_best": 1.25, "raw_padding_free": 1.1}
GOAL_KEY = "trained_tok_per_s_steady"  # the goal line's window; the whole call's is printed beside it
SAME_KERNEL = {"hf_flattening_seg", "trl_padding_free_seg"}


def wait_for(p: subprocess.Popen, timeout: float | None):
    """``os.wait4`` (not ``p.wait``: the child's peak RSS comes with it); after ``timeout`` seconds
    the child is killed. Polled, so a kill can only reach a child not yet reaped (the pid is ours)."""
    end = time.perf_counter() + timeout if timeout else None
    while end is not None and time.perf_counter() < end:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            return status, ru
        time.sleep(0.05)
    if end is not None:
        p.kill()
    return os.wait4(p.pid, 0)[1:]


def run(method: str, seed: int, extra: list[str], timeout: float | None = None) -> dict:
    """One run_one.py process; ``timeout`` seconds: killed after them (its record says so)."""
    argv = [sys.executable, str(HERE / "run_one.py"), method, "--seed", str(seed), *extra]
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, cwd=HERE, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        status, ru = wait_for(p, timeout)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode(errors="replace")
    rc = os.waitstatus_to_exitcode(status)
    rec = next(
        (json.loads(x) for x in reversed(text.splitlines()) if x.startswith("{") and '"method"' in x), None
    )
    if rec is None and timeout and wall >= timeout:
        text += f"\n(killed after {timeout:.0f} s)"
    rec = rec or {"method": method, "failed": text[-3000:]}
    rec.update(
        rc=rc,
        proc_wall_s=round(wall, 3),
        peak_rss_mib=round(ru.ru_maxrss / 1024, 1),
        loadavg=round(os.getloadavg()[0], 2),
    )
    return rec


def cpu_info() -> dict:
    """The CPU every result was measured on (/proc/cpuinfo's model and flags, torch's SIMD level):
    ratios from two machines are not one series."""
    info: dict = {"count": os.cpu_count(), "model": None, "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not info["model"]:
            info["model"] = value.strip()
        elif key.strip() == "flags" and not info["flags"]:
            info["flags"] = value.split()
    try:
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 (a machine without torch still gets its CPU recorded)
        info["torch_cpu_capability"] = None
    return info


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rng(xs):
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    table = []
    print(
        f"\n{'method':18s} {'n':>2s} {'trained tok/s':>13s} {'[min-max]':>15s} {'steady':>7s} {'padding':>8s} "
        f"{'RSS MiB':>8s} {'eval loss':>9s} {'[min-max]':>13s} {'steps':>5s} same"
    )
    for m, recs in runs.items():
        ok = [r for r in recs if "trained_tok_per_s" in r]
        if not ok:
            why = recs[0].get("skipped") or (recs[0].get("failed") or "")[-300:]
            print(f"{m:18s}  -- not run: {why}")
            table.append(dict(method=m, skipped=why))
            continue
        tps = [r["trained_tok_per_s"] for r in ok]
        loss = [r["eval_loss"] for r in ok]
        steady = [r.get("trained_tok_per_s_steady") for r in ok]
        row = dict(
            method=m,
            n=len(ok),
            trained_tok_per_s=med(tps),
            trained_tok_per_s_range=rng(tps),
            trained_tok_per_s_steady=med(steady),
            trained_tok_per_s_steady_range=rng(steady),
            padding_share=med([r["padding_share"] for r in ok]),
            peak_rss_mib=med([r["peak_rss_mib"] for r in ok]),
            eval_loss=med(loss),
            eval_loss_range=rng(loss),
            steps=med([r["forwards"] for r in ok]),
            train_call_s=med([r["train_call_s"] for r in ok]),
            data_prep_s=med([r.get("data_prep_s") for r in ok]),
            layout=ok[0].get("layout"),
            same_trained_tokens=all(r["same_trained_tokens"] for r in ok),
        )
        table.append(row)
        print(
            f"{m:18s} {len(ok):2d} {row['trained_tok_per_s']:13.0f} {'{:.0f}-{:.0f}'.format(*row['trained_tok_per_s_range']):>15s} {row['trained_tok_per_s_steady'] or 0:7.0f} "
            f"{row['padding_share']:8.1%} {row['peak_rss_mib']:8.0f} {row['eval_loss']:9.3f} "
            f"{'{:.3f}-{:.3f}'.format(*row['eval_loss_range']):>13s} {row['steps']:5.0f} {row['same_trained_tokens']}"
        )
    return table


def median_ci95(xs, resamples=2000):
    """Bootstrap 95% interval of the median (seeded); None under 3 values."""
    import random

    xs = [x for x in xs if x is not None]
    if len(xs) < 3:
        return None
    rnd = random.Random(0)
    boots = sorted(statistics.median(rnd.choices(xs, k=len(xs))) for _ in range(resamples))
    return [round(boots[int(0.025 * resamples)], 3), round(boots[int(0.975 * resamples) - 1], 3)]


def verdict(ratio, goal, ci95) -> str:
    """A ">= goal" verdict: "met" when the whole interval is at or above it, "NOT met" when all of
    it is below, "inconclusive" when it crosses the goal (or with too few repetitions for one)."""
    if ratio is None:
        return "not measured"
    if not ci95:
        return "inconclusive"
    if ci95[0] < goal <= ci95[1]:
        return "inconclusive"
    return "met" if ci95[0] >= goal else "NOT met"


def by_seed(runs, method: str, key: str) -> dict:
    """``method``'s runs that have ``key``: its value by repetition (seed)."""
    return {r["seed"]: r[key] for r in runs.get(method, []) if r.get(key)}


def paired_ratios(runs, ours: str, theirs: str, key: str = "trained_tok_per_s") -> list[float]:
    """ours / theirs, repetition by repetition (the runs of one repetition ran side by side)."""
    mine, other = by_seed(runs, ours, key), by_seed(runs, theirs, key)
    return [mine[s] / other[s] for s in sorted(mine.keys() & other.keys())]


def per_step_ratios(runs, ours: str, theirs: str) -> list[float]:
    """Per repetition, the median over steps 2..n of theirs / ours step time: for two rows that
    train the same batches in the same order (the hand-written loop and corelooper's padding-free
    row), so each step is compared with the same step. A slow phase of the VM shorter than a run
    then moves a few steps' ratios, not the repetition's (one as long as a run still moves it:
    benchmarks/README.md); construction and the first step are left out."""
    mine, other = by_seed(runs, ours, "step_times_s"), by_seed(runs, theirs, "step_times_s")
    out = []
    for seed in sorted(mine.keys() & other.keys()):
        a, b = mine[seed], other[seed]
        if len(a) == len(b):
            out.append(statistics.median(y / x for x, y in zip(a, b, strict=True) if x > 0))
    return out


def per_step(runs, ours: str, theirs: str) -> dict | None:
    """``per_step_ratios`` summed up: a diagnostic printed beside the goal, not the goal's verdict
    (the issue judges trained tokens/s over the whole call)."""
    ratios = per_step_ratios(runs or {}, ours, theirs)
    if not ratios:
        return None
    return dict(
        ours=ours,
        theirs=theirs,
        ratio=round(statistics.median(ratios), 3),
        ci95=median_ci95(ratios),
        per_repetition=[round(x, 3) for x in ratios],
    )


def compare(table: list[dict], runs: dict | None = None) -> dict:
    rows = {r["method"]: r for r in table if "trained_tok_per_s" in r}
    runs = runs or {}

    def best(prefix, documented=True, key=GOAL_KEY):
        cands = [
            r
            for m, r in rows.items()
            if m.startswith(prefix) and r.get(key) and not (documented and m in SAME_KERNEL)
        ]
        return max(cands, key=lambda r: r[key]) if cands else None

    # The headline is the padding-free row: the same samples in every optimizer step as the padded
    # rows, so its eval loss must equal theirs. Dataset-level packing (cl_packed, trl_packing_bfd)
    # puts a different number of samples in each step (more, smaller steps): another optimisation,
    # compared like for like with TRL's packing, its loss with TRL's packed loss.
    ours = rows.get("cl_padding_free")
    trl, hf = best("trl_"), best("hf_")
    out: dict = {}

    def ratio(key, a, b, **extra):
        if a and b and a.get(key) and b.get(key):
            return dict(ours=a["method"], theirs=b["method"], ratio=round(a[key] / b[key], 3), **extra)
        return None

    def judged(a, b, goal):
        r = ratio(GOAL_KEY, a, b, goal=goal, window="steady state")
        if r:
            pairs = paired_ratios(runs, a["method"], b["method"], GOAL_KEY)
            r["ci95"] = median_ci95(pairs)
            r["paired_median"] = round(statistics.median(pairs), 3) if pairs else None
            r["verdict"] = verdict(r["ratio"], goal, r["ci95"])
        return r

    out["corelooper_leak_free_over_trl_best"] = judged(ours, trl, GOALS["trl_best"])
    out["corelooper_leak_free_over_hf_best"] = judged(ours, hf, GOALS["hf_best"])
    out["corelooper_leak_free_over_hand_written"] = judged(
        ours, rows.get("raw_padding_free"), GOALS["raw_padding_free"]
    )
    whole = (
        "trained_tok_per_s"  # the whole call (construction, data preparation, first step): beside the goal
    )
    out["whole_call_over_trl_best"] = ratio(whole, ours, best("trl_", key=whole))
    out["whole_call_over_hf_best"] = ratio(whole, ours, best("hf_", key=whole))
    out["whole_call_over_hand_written"] = ratio(whole, ours, rows.get("raw_padding_free"))
    out["over_trl_best_incl_same_kernel"] = ratio(GOAL_KEY, ours, best("trl_", documented=False))
    out["over_hf_best_incl_same_kernel"] = ratio(GOAL_KEY, ours, best("hf_", documented=False))
    out["trained_head_over_full_head"] = ratio(GOAL_KEY, ours, rows.get("cl_padding_free_all"))
    out["padding_free_over_trl_padding_free"] = ratio("trained_tok_per_s", ours, rows.get("trl_padding_free"))
    out["per_step_over_hand_written"] = (
        per_step(runs, "cl_padding_free", "raw_padding_free") if ours else None
    )
    packed, trl_packed = rows.get("cl_packed"), rows.get("trl_packing_bfd")
    if packed and packed.get("layout") == "packing":
        out["packed_over_trl_packed"] = ratio(
            "trained_tok_per_s",
            packed,
            trl_packed,
            eval_loss=[packed["eval_loss"], (trl_packed or {}).get("eval_loss")],
        )
    out = {k: v for k, v in out.items() if v}
    padded = [rows[m] for m in ("cl_padded", "hf_padded", "trl_padded") if m in rows]
    if ours and padded:
        lo = min(r["eval_loss_range"][0] for r in padded)
        hi = max(r["eval_loss_range"][1] for r in padded)
        out["eval_loss"] = dict(
            ours=ours["eval_loss"],
            padded_range=[lo, hi],
            within_padded_noise=lo - 0.02 <= ours["eval_loss"] <= hi + 0.02,
        )
    for k, v in out.items():
        print(f"{k}: {v}")
    for k, v in out.items():
        if isinstance(v, dict) and "verdict" in v:
            ci = "{:.3f}-{:.3f}".format(*v["ci95"]) if v["ci95"] else "too few repetitions"
            print(
                f"goal {k}: {v['ratio']:.3f}x {v['theirs']} in the steady state [95% {ci}] "
                f"(regression floor >= {v['goal']}: {v['verdict']})"
            )
    step = out.get("per_step_over_hand_written")
    if step:
        ci = "{:.3f}-{:.3f}".format(*step["ci95"]) if step["ci95"] else "too few repetitions"
        print(
            f"per step, the same batches: {step['ratio']:.3f}x raw_padding_free [95% {ci}] (steps 2..n "
            "compared one by one; a diagnostic beside the goal, not its verdict)"
        )
    if not ours:
        print("cl_padding_free did not run (it needs corelooper_lm.packing); the goals are judged on it")
    return out


def profile(method: str, extra: list[str], top: int) -> None:
    import pstats

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.prof")
        rec = run(method, 0, [*extra, "--profile", path])
        print(json.dumps(rec))
        if not os.path.exists(path):
            sys.exit("the profiled run wrote no stats")
        st = pstats.Stats(path)
        print(f"\n== {method}: top {top} by cumulative time")
        st.sort_stats("cumulative").print_stats(top)
        print(f"\n== {method}: top {top} by own time")
        st.sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--methods", default=",".join(ALL))
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--cl-packing", default="auto", choices=["auto", "collators", "packing"])
    ap.add_argument("--out", default=str(HERE.parent / "results" / "sft.json"))
    ap.add_argument("--profile", metavar="METHOD")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("extra", nargs="*", help="after --: more run_one.py flags")
    a = ap.parse_args()
    extra = ["--samples", str(a.samples), "--cl-packing", a.cl_packing, *a.extra]
    if a.profile:
        profile(a.profile, extra, a.top)
        return
    methods = a.methods.split(",")
    load0 = os.getloadavg()
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for rep in range(a.reps):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:
            rec = run(m, rep, extra)
            runs[m].append(rec)
            print(
                f"rep {rep} {m:18s} rc={rec['rc']} tok/s={rec.get('trained_tok_per_s')} "
                f"loss={rec.get('eval_loss')} {rec.get('skipped') or ''}{(rec.get('failed') or '')[-400:]}",
                file=sys.stderr,
                flush=True,
            )
    table = summarize(runs)
    goals = compare(table, runs)
    out = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        reps=a.reps,
        samples=a.samples,
        cpus=os.cpu_count(),
        cpu=cpu_info(),
        loadavg_start=[round(x, 2) for x in load0],
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
        args=extra,
        goals=goals,
        table=table,
        runs=runs,
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {out['loadavg_start']} -> {out['loadavg_end']}; wrote {a.out}")
    if max(r.get("loadavg", 0) for recs in runs.values() for r in recs) > (os.cpu_count() or 1):
        print(f"WARNING: the load average exceeded the {os.cpu_count()} CPUs during the run: not quotable.")


if __name__ == "__main__":
    main()
