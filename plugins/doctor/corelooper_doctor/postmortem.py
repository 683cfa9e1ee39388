"""``corelooper doctor RUN_DIR``: what went wrong (or slow) in a run folder, finished, crashed
or hung, from ``metrics.jsonl`` and the doctor's files in ``RUN_DIR/doctor/``. No torch."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .settings import DEFAULTS, PREFIX
from .units import fmt

PHASE_KEYS = ("data", "forward", "backward", "optimizer", "hooks", "other")


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash
    return out


def _unprefixed(record: dict) -> dict:
    """The doctor's keys without their ``doctor/`` namespace (older runs logged them bare)."""
    return {k[len(PREFIX) :] if k.startswith(PREFIX) else k: v for k, v in record.items()}


def collect(run_dir: Path) -> dict:
    from corelooper.cli.api import read_metrics

    records = read_metrics(run_dir)
    logs = [_unprefixed(r) for r in records if r.get("event") == "log" and "loss" in r]
    summary = next((r for r in reversed(records) if "train_runtime" in r), None)
    doc = run_dir / "doctor"
    nonfinite = []
    for report in sorted(doc.glob("step-*/report*.json"), key=lambda p: int(p.parent.name[5:])):
        nonfinite.append(json.loads(report.read_text()))
    hang = (doc / "hang-report.txt").read_text().strip() if (doc / "hang-report.txt").is_file() else None
    return {
        "logs": logs,
        "summary": summary,
        "evals": [r for r in records if r.get("event") == "eval"],
        "nonfinite": nonfinite,
        "spikes": _jsonl(doc / "spikes.jsonl"),
        "skipped": _jsonl(doc / "skipped_batches.jsonl"),
        "memory": json.loads((doc / "memory.json").read_text()) if (doc / "memory.json").is_file() else None,
        "oom": [p.read_text().strip() for p in sorted(doc.glob("oom-rank*.txt"))],
        "hang": hang,
        "hang_stacks": sorted(p.name for p in doc.glob("hang-rank*.txt")),
    }


def _phases(logs: list[dict]) -> dict[str, float]:
    """The run's time split: each window weighted by its wall time, the first (start-up) left
    out when there are others (as the input-bound warning judges it)."""
    keyed, prev = [], 0
    for r in logs:
        if "time_share_data" in r:  # wall time ~ steps / throughput (the batch is the same)
            rate = r.get("samples_per_second")
            keyed.append(
                (r, max(r["step"] - prev, 1) / (rate if isinstance(rate, (int, float)) and rate > 0 else 1))
            )
        prev = r["step"]
    if len(keyed) > 1:
        keyed = keyed[1:]
    total = sum(w for _, w in keyed)
    phases = [p for p in PHASE_KEYS if any(f"time_share_{p}" in r for r, _ in keyed)]
    return (
        {p: sum(r.get(f"time_share_{p}", 0.0) * w for r, w in keyed) / total for p in phases} if keyed else {}
    )


def _syncs(logs: list[dict]) -> str | None:
    keyed = [r["host_syncs_per_step"] for r in logs if isinstance(r.get("host_syncs_per_step"), (int, float))]
    if not keyed:
        return None
    return (
        f"host-device syncs per step: {statistics.median(keyed):.3g} (median of {len(keyed)} windows, "
        f"max {max(keyed):.3g})"
    )


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)


def _status(info: dict) -> str:
    logs, summary = info["logs"], info["summary"]
    if summary is not None:  # (metrics.jsonl writes a NaN/Inf as a string)
        return (
            f"  finished: step {summary['step']} in {_num(summary.get('train_runtime'))} s, "
            f"train_loss {_num(summary.get('train_loss'))}"
        )
    last = logs[-1]["step"] if logs else None
    stopped = [r for r in info["nonfinite"] if r.get("action") == "stop"]
    why = (
        "it hung (the report is below)"
        if info["hang"]
        else "out of memory (the report is below)"
        if info["oom"]
        else f"stopped on non-finite values at step {stopped[-1].get('step')}"
        if stopped
        else "crashed, was stopped, or is still running"
    )
    return f"  not finished: {why}; no run summary in metrics.jsonl, last log at step {last}"


def _trend(logs: list[dict]) -> str | None:
    tps = [r["tokens_per_second"] for r in logs if isinstance(r.get("tokens_per_second"), (int, float))]
    key = "tokens/s"
    if not tps:
        tps, key = (
            [r["samples_per_second"] for r in logs if isinstance(r.get("samples_per_second"), (int, float))],
            "samples/s",
        )
    tps = tps[1:]  # the first window holds the start-up
    if len(tps) < 2:
        return None
    k = max(1, len(tps) // 4)
    first, last = statistics.mean(tps[:k]), statistics.mean(tps[-k:])
    change = (last - first) / first if first else 0.0

    def rate(x: float) -> str:  # 13380, not 1.338e+04
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"

    return (
        f"{key}: {rate(first)} in the first quarter of the logs (after the first), {rate(last)} in the last "
        f"({change:+.0%})"
    )


def _advice(info: dict, phases: dict[str, float]) -> list[str]:
    out = []
    if phases.get("data", 0) > DEFAULTS["input_bound_share"]:
        out.append("input-bound: raise train.dataloader_num_workers, pre-tokenize, or pack sequences")
    for r in info["nonfinite"]:
        m = (r.get("blame") or {}).get("module")
        if m:
            out.append(
                f"non-finite values start in {m!r}: lower the learning rate, keep it in fp32/bf16 "
                f"instead of fp16, or clip its input; re-explain it with --replay step-{r.get('step')}"
            )
    if info["spikes"]:
        out.append(
            "loss spikes: lower the learning rate or warm up longer; [doctor] on_spike = "
            '"skip_batch" drops the spiking batches'
        )
    if info["oom"]:
        out.append("out of memory: see the ranked settings in the report above")
    if info["hang"]:
        out.append("hang: read the stacks of the rank that is behind (hang-rankN.txt)")
    return out


def render(run_dir: Path, info: dict) -> str:
    logs, lines = info["logs"], [f"corelooper doctor {run_dir}"]
    last = logs[-1]["step"] if logs else None
    lines.append(_status(info))
    lines.append(
        f"  logs: {len(logs)} window{'s' if len(logs) != 1 else ''}, last at step {last}"
        if logs
        else "  logs: none"
    )
    if info["evals"]:
        e = info["evals"][-1]
        lines.append(
            f"  last evaluation (step {e['step']}): "
            + ", ".join(
                f"{k}={v:.4g}" for k, v in e.items() if k.startswith("eval_") and isinstance(v, (int, float))
            )
        )
    for r in info["nonfinite"]:
        b = r.get("blame") or {}
        lines.append(
            f"  non-finite at step {r.get('step')} ({r.get('action')}): {b.get('module')!r} "
            f"[{b.get('type', '')}] {b.get('where', '')}"
        )
    for s in info["spikes"]:
        lines.append(
            f"  loss spike at step {s['step']}: {s['loss']:.4g} vs median {s['median']:.4g}"
            + (" (skipped)" if s.get("skipped") else "")
        )
    peaks = [r.get("memory_max_allocated_gb") or r.get("memory_peak_rss_gb") for r in logs]
    peaks = [p for p in peaks if isinstance(p, (int, float))]
    if peaks:
        lines.append(
            f"  memory peak: {max(peaks):.3f} GB"
            + (" (device)" if "memory_max_allocated_gb" in logs[-1] else " (RSS)")
        )
    m = info["memory"]
    if m:
        lines.append(
            f"  memory breakdown: parameters {fmt(m['parameters'])}, gradients {fmt(m['gradients'])}, "
            f"optimizer {fmt(m['optimizer_states'])}, activations {fmt(m['activations'])} per micro-batch "
            f"of {m['micro_batch']}; largest micro-batch that should fit: {m['largest_micro_batch']}"
        )
    phases = _phases(logs)
    if phases:
        slow = max(phases, key=phases.get)
        lines.append(
            "  time split: "
            + ", ".join(f"{p} {100 * v:.0f}%" for p, v in phases.items())
            + f"; slowest phase: {slow}"
        )
    syncs = _syncs(logs)
    if syncs:
        lines.append(f"  {syncs}")
    trend = _trend(logs)
    if trend:
        lines.append(f"  {trend}")
    lines.extend(f"  {o}" for o in info["oom"])
    if info["hang"]:
        lines.append(f"  {info['hang']}")
    lines.extend(f"  advice: {a}" for a in _advice(info, phases))
    return "\n".join(lines)


def plot(run_dir: Path, info: dict, output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = info["logs"]
    steps = [r["step"] for r in logs]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [
        ("loss", ["loss"]),
        ("grad norm", ["grad_norm"]),
        ("memory (GB)", ["memory_max_allocated_gb", "memory_peak_rss_gb", "memory_reserved_gb"]),
    ]
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for k in keys:
            ys = [r.get(k) for r in logs]
            if any(isinstance(y, (int, float)) for y in ys):
                ax.plot(steps, [y if isinstance(y, (int, float)) else float("nan") for y in ys], label=k)
        for s in info["spikes"] if title == "loss" else []:
            ax.axvline(s["step"], color="red", alpha=0.4)
        ax.set_title(title)
        ax.legend(fontsize=7)
    ax = axes.flat[3]
    bottom = [0.0] * len(steps)
    for p in PHASE_KEYS:
        vals = [float(r.get(f"time_share_{p}", 0.0)) for r in logs]
        ax.bar(
            steps,
            vals,
            bottom=bottom,
            label=p,
            width=max(1, (steps[1] - steps[0]) * 0.8) if len(steps) > 1 else 0.8,
        )
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_title("time split per window")
    ax.legend(fontsize=7)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, metadata={"Description": "panels: loss, grad_norm, memory, time_split"})
    plt.close(fig)
    return output
