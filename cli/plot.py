"""``corelooper plot RUN_DIR [RUN_DIR ...]``: training curves from ``metrics.jsonl`` into a PNG.

One panel per quantity -- loss, learning rate, grad norm, then every evaluation metric -- with
one line per run, so runs are compared in the same axes. Needs matplotlib (the ``plot`` extra);
the Agg backend is used, so no display is needed. The panel titles are stored in the PNG's
``Description`` text chunk (``panels: loss, learning_rate, ...``) for tools and tests.
"""

from __future__ import annotations

import math
from pathlib import Path

from corelooper.cli.api import read_metrics

from corelooper.errors import ConfigError, DataError

TRAIN_KEYS = ("loss", "learning_rate", "grad_norm")
# Evaluation numbers that describe speed, not the model.
_NOT_METRICS = ("runtime", "samples_per_second", "steps_per_second", "tokens_per_second")


def series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """``{panel name: (steps, values)}`` for one run."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        event, step = r.get("event"), r.get("step")
        if step is None or "train_runtime" in r:  # the end-of-training summary is not a point
            continue
        if event == "eval":
            keys = [k for k in r if k.startswith("eval_") and not k.endswith(_NOT_METRICS)]
        else:
            keys = [k for k in TRAIN_KEYS if k in r]
        for k in keys:
            v = r[k]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs, ys = out.setdefault(k, ([], []))
                xs.append(step)
                ys.append(float(v))
    return out


def panel_order(names: set[str]) -> list[str]:
    train = [k for k in TRAIN_KEYS if k in names]
    evals = sorted(k for k in names if k not in TRAIN_KEYS)
    if "eval_loss" in evals:
        evals.remove("eval_loss")
        evals.insert(0, "eval_loss")
    return train + evals


def plot_runs(run_dirs: list[Path], output: Path | None = None) -> Path:
    """Write the PNG; returns its path."""
    if not run_dirs:
        raise ConfigError("corelooper plot: give at least one run folder.")
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "corelooper plot needs matplotlib: pip install 'corelooper[plot]' (or pip install matplotlib)."
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {_label(Path(d), run_dirs): series(read_metrics(Path(d))) for d in run_dirs}
    names = panel_order(set().union(*(set(s) for s in runs.values())))
    if not names:
        raise DataError(
            f"No loss, learning rate, grad norm or eval metric in {', '.join(map(str, run_dirs))}: "
            "did the runs log anything (train.logging_steps)?"
        )
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for label, data in runs.items():
            if name in data:
                xs, ys = data[name]
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        ax.set_title(name.replace("_", " "))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if name in ("loss", "eval_loss", "grad_norm") and _spans_decades(runs, name):
            ax.set_yscale("log")
        if name == "learning_rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    if len(runs) > 1:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=min(len(runs), 4), frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.93))
    else:
        fig.suptitle(next(iter(runs)))
        fig.tight_layout()
    out = Path(output) if output else Path("metrics.png")  # the current folder: no run folder is written into
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--output {str(out)!r}: the plot is a PNG; give a file ending in .png.")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Description": "panels: " + ", ".join(names)})
    plt.close(fig)
    return out


def _label(path: Path, all_dirs: list[Path]) -> str:
    """The run's folder name, with its parent when two runs share a name."""
    names = [Path(d).resolve().name for d in all_dirs]
    p = path.resolve()
    return f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name


def _spans_decades(runs: dict, name: str) -> bool:
    values = [v for data in runs.values() if name in data for v in data[name][1]]
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and len(values) > 1 and max(positive) / min(positive) > 30
