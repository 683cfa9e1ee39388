"""Where an evaluation's peak RSS growth goes: the first ``evaluate()`` of a process against the next ones.

usage: benchmarks/.venv/bin/python benchmarks/eval/warm_growth.py [--rows cl_loss,hf_loss] [--calls 3]
       [--samples 2000]

run_bench.py measures one ``evaluate()`` per fresh process, which includes what a process pays once
(allocator arenas sized by the largest batch, lazy imports, kernel set-up) and keeps afterwards. A
training run evaluates every ``eval_steps``: from the second call on, the growth is the evaluation's
own working set. For each row, in its own process, ``--calls`` evaluations back to back on the same
model and data (run_bench's rows and set-up): peak RSS growth during each call (VmHWM reset just before
it) and the RSS kept after it, in MiB. Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(row: str, calls: int, samples: int) -> dict:
    sys.path.insert(0, str(HERE))
    import run_bench as R

    data, model = R.dataset(R.C.make_samples(samples, "eval")), R.C.make_model(0)
    import transformers  # noqa: F401  (as run_bench: both sides import it)

    with tempfile.TemporaryDirectory() as tmp:
        evaluate = (
            R._corelooper(row, model, data, 16, tmp)
            if row.startswith("cl_")
            else R._hf(row, model, data, 16, tmp)
        )
        growth, kept = [], []
        for _ in range(calls):
            before = R.rss_mib()
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
            evaluate()
            growth.append(round(R.rss_mib("VmHWM") - before, 1))
            kept.append(round(R.rss_mib() - before, 1))
    return {"row": row, "samples": samples, "peak_growth_mib": growth, "kept_mib": kept}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="cl_loss,cl_stream,hf_loss,hf_argmax,hf_batch")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(child(a.one, a.calls, a.samples)))
        return
    for row in a.rows.split(","):
        out = subprocess.run(
            [sys.executable, __file__, "--one", row, "--calls", str(a.calls), "--samples", str(a.samples)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        print(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:], flush=True)


if __name__ == "__main__":
    main()
