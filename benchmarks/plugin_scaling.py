"""What each plugin costs the loop: workload A (overhead-bound MLP, 300 steps, 1 thread) with
0 / 5 / 20 / 50 no-op plugins, each implementing every per-step event (on_step_begin,
on_before_backward, on_after_backward, on_pre_optimizer_step, on_optimizer_step, on_step_end)
plus on_log, on_epoch_begin/end and on_train_begin/end.

usage: .venv/bin/python benchmarks/plugin_scaling.py [--reps 7] [--counts 0,5,20,50] [--steps 300]
                                                    [--json benchmarks/results/plugin_scaling.json]

One process, one warm-up run, then the plugin counts interleaved (rotated order per repetition).
Per run: the loop's wall time (``loop.train()``) and the median step-to-step time (torch's global
optimizer-step hook, the same probe as benchmarks/overhead). Reported per count: median step
time, its ratio to 0 plugins (paired within a repetition, median and min-max), and
µs per step per plugin = (step(N) - step(0)) / N. Goal (issue 19): 20 plugins <= 1.05x of none.
The installed plugins autoload as for a user; the console is blocked in every row alike (its
output would go to this terminal) — the rows differ only by the no-op plugins.
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
sys.path.insert(0, str(HERE / "overhead"))
sys.path.append(str(HERE.parent))  # for benchmarks.*; an installed corelooper (or PYTHONPATH) wins

import common as C  # noqa: E402

EVENTS = (
    "on_step_begin",
    "on_before_backward",
    "on_after_backward",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_begin",
    "on_train_end",
)
PER_STEP_EVENTS = 6


def noop_plugin(i: int):
    """An object with a no-op method per event (each takes ``state``, as a typical plugin does)."""

    def noop(self, state):
        return None

    cls = type(f"NoOp{i}", (), {name: noop for name in EVENTS})
    obj = cls()
    obj.name = f"noop{i}"
    return obj


def run_once(n_plugins: int, steps: int, probe_holder: list) -> dict:
    import torch

    from corelooper import Loop
    from corelooper.config import Config

    cfg = C.WORKLOADS["A"]
    model = C.make_model("A")
    probe = C.Probe()
    probe_holder[0] = probe  # the global optimizer hook (registered once) reports to this run's probe
    ds = C.make_dataset("A")
    out = tempfile.mkdtemp(prefix="cl_scaling_")
    config = Config.from_dict(
        {
            "train": dict(
                output_dir=out,
                max_steps=steps,
                per_device_train_batch_size=cfg["batch_size"],
                learning_rate=C.LR,
                weight_decay=C.WEIGHT_DECAY,
                lr_scheduler_type="linear",
                warmup_steps=0,
                max_grad_norm=C.MAX_GRAD_NORM,
                logging_steps=cfg["log_every"],
                save_strategy="no",
                eval_strategy="no",
                seed=C.SEED,
                disable_tqdm=True,
                use_cpu=True,
            )
        }
    )
    loop = Loop(
        model,
        config,
        train_dataset=ds,
        plugins=[noop_plugin(i) for i in range(n_plugins)],
        blocked_plugins=["console"],
    )
    t = time.perf_counter()
    loop.train()
    loop_s = time.perf_counter() - t
    shutil.rmtree(out, ignore_errors=True)
    assert loop.state.global_step == steps, loop.state.global_step
    del torch
    st = probe.step_t
    diffs = sorted(b - a for a, b in zip(st, st[1:], strict=False))
    return {
        "loop_s": loop_s,
        "step_us_median": 1e6 * diffs[len(diffs) // 2],
        "step_us_mean": 1e6 * (st[-1] - st[0]) / (len(st) - 1),
    }


def install_probe_hook(probe_holder: list) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda opt, a, k: probe_holder[0].step_t.append(time.perf_counter()))


def summarize(runs: dict[int, list[dict]], counts: list[int]) -> list[dict]:
    base = runs[counts[0]]
    table = []
    print(
        f"{'plugins':>7s} {'step_us':>9s} {'x none':>7s} {'[min-max]':>11s} {'us/step/plugin':>14s} {'loop_s':>7s}"
    )
    for n in counts:
        ratios = [r["step_us_median"] / b["step_us_median"] for r, b in zip(runs[n], base, strict=True)]
        step = statistics.median(r["step_us_median"] for r in runs[n])
        per_plugin = (
            [(r["step_us_median"] - b["step_us_median"]) / n for r, b in zip(runs[n], base, strict=True)]
            if n
            else []
        )
        row = dict(
            plugins=n,
            step_us_median=round(step, 1),
            over_none=round(statistics.median(ratios), 4),
            over_none_range=[round(min(ratios), 4), round(max(ratios), 4)],
            us_per_step_per_plugin=round(statistics.median(per_plugin), 2) if per_plugin else None,
            us_per_event_call=round(statistics.median(per_plugin) / PER_STEP_EVENTS, 3)
            if per_plugin
            else None,
            loop_s=round(statistics.median(r["loop_s"] for r in runs[n]), 4),
        )
        table.append(row)
        pp = f"{row['us_per_step_per_plugin']:14.2f}" if per_plugin else f"{'-':>14s}"
        print(
            f"{n:7d} {step:9.1f} {row['over_none']:7.3f} "
            f"{'{:.2f}-{:.2f}'.format(*row['over_none_range']):>11s} {pp} {row['loop_s']:7.3f}"
        )
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--counts", default="0,5,20,50")
    ap.add_argument("--steps", type=int, default=C.WORKLOADS["A"]["steps"])
    ap.add_argument("--json", default=str(HERE / "results" / "plugin_scaling.json"))
    a = ap.parse_args()
    counts = [int(x) for x in a.counts.split(",")]
    if counts[0] != 0:
        counts = [0] + counts
    C.preload_torch()
    C.setup_threads("A")
    holder = [C.Probe()]
    install_probe_hook(holder)
    load_start = os.getloadavg()
    run_once(0, min(a.steps, 50), holder)  # warm-up: first-call costs out of the measured runs
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for rep in range(a.reps):
        k = rep % len(counts)
        for n in counts[k:] + counts[:k]:
            runs[n].append(run_once(n, a.steps, holder))
        print(
            f"rep {rep}: " + " ".join(f"{n}:{runs[n][-1]['step_us_median']:.0f}us" for n in counts),
            file=sys.stderr,
            flush=True,
        )
    table = summarize(runs, counts)
    row20 = next((r for r in table if r["plugins"] == 20), None)
    if row20:
        print(
            f"goal: 20 plugins <= 1.05x none: {row20['over_none']:.3f} "
            f"({'met' if row20['over_none'] <= 1.05 else 'NOT met'})"
        )
    out = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        reps=a.reps,
        steps=a.steps,
        cpus=os.cpu_count(),
        loadavg_start=[round(x, 2) for x in load_start],
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
        events_per_plugin=list(EVENTS),
        per_step_events=PER_STEP_EVENTS,
        table=table,
        all_runs={str(n): v for n, v in runs.items()},
    )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
