"""How much arithmetic each SFT row does, counted by torch's own FLOP counter, and what that says
about its speed: a paired speed ratio is a work ratio times a FLOP-rate ratio.

usage: benchmarks/.venv/bin/python benchmarks/sft/work.py [--samples 512] [--seed 0]
           [--methods cl_padding_free,raw_padding_free,hf_grouped,trl_grouped]
           [--ratios RESULT.json ...] [--out OUT.json] [--one-process]

Each row runs once as ``run_one.py ROW --count-flops`` (its own process, the benchmark's data,
model and hyper-parameters) with ``torch.utils.flop_counter.FlopCounterMode`` around the framework
call: every matrix product of the forward and the backward, and (with the formulas below, which
torch does not register) the in-place ``addmm_`` and the CPU flash attention kernel's, causal
calls at the half they compute. Its times are not figures: the counter runs in every op.
``--one-process`` (the test suite's smoke) runs those rows one after another in one process
instead: one start-up, the same counts for the rows checked (``count_in_one_process``).

With ``--ratios`` (a ``lockstep.py`` or ``run_bench.py`` result with paired medians) it splits
each measured ratio of ``cl_padding_free`` over another row into the work it spares (the other
row's FLOPs over its own, for the same trained tokens) and the rate it runs its FLOPs at, and
projects what corelooper's row would give at the hand-written loop's FLOP rate: the least work
this model needs on this data, done as fast as the stock model's own operations do it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
DEFAULT = ["cl_padding_free", "raw_padding_free", "hf_grouped", "trl_grouped"]
OURS, HAND_WRITTEN = "cl_padding_free", "raw_padding_free"


def _causal_share(query_shape, key_shape, is_causal: bool) -> tuple[int, int]:
    """The share of a ``q x k`` score matrix a causal call computes: ``(L + 1) / 2L`` (a fraction
    as two integers, so the count stays an integer)."""
    if is_causal and query_shape[2] == key_shape[2]:
        return query_shape[2] + 1, 2 * query_shape[2]
    return 1, 1


def addmm_in_place(_self, a, b, *_args, out_shape=None, **_kw) -> int:
    """``aten.addmm_`` (``self += a @ b``): ``2 m k n``, as torch's ``addmm``."""
    return 2 * a[0] * a[1] * b[1]


def cpu_flash_forward(
    query, key, value, dropout_p=0.0, is_causal=False, *_args, out_shape=None, **_kw
) -> int:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: torch's sdpa formula (which counts
    the whole score matrix), at the causal share."""
    from torch.utils.flop_counter import sdpa_flop_count

    num, den = _causal_share(query, key, is_causal)
    return sdpa_flop_count(query, key, value) * num // den


def cpu_flash_backward(
    grad_out, query, key, value, _out, _lse, dropout_p=0.0, is_causal=False, *_args, out_shape=None, **_kw
) -> int:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``, as the forward."""
    from torch.utils.flop_counter import sdpa_backward_flop_count

    num, den = _causal_share(query, key, is_causal)
    return sdpa_backward_flop_count(grad_out, query, key, value) * num // den


PRODUCT_OPS = re.compile(r"mm|matmul|linear|dot|conv|attention|einsum|addmv|addr")


class FlopCount:
    """``FlopCounterMode`` with the formulas above, with run_one's profiler interface (``enable`` /
    ``disable``); ``split()`` gives matrix products and attention apart, and names every op that
    looks like a product but has no formula (``uncounted``: the count is then too low)."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import FlopCounterMode

        aten = torch.ops.aten
        self.mode = FlopCounterMode(
            display=False,
            custom_mapping={
                # the in-place product a chunked loss accumulates its head's gradients with (TRL's)
                aten.addmm_: addmm_in_place,
                aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_forward,
                aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_flash_backward,
            },
        )
        self.uncounted: set[str] = set()
        registry, seen = self.mode.flop_registry, self.uncounted

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                packet = func._overloadpacket
                if packet not in registry and PRODUCT_OPS.search(str(packet)):
                    seen.add(str(packet))
                return func(*args, **(kwargs or {}))

        self.watch = Watch()

    def enable(self) -> None:
        self.mode.__enter__()
        self.watch.__enter__()

    def disable(self) -> None:
        self.watch.__exit__(None, None, None)
        self.mode.__exit__(None, None, None)

    def split(self) -> dict:
        per_op = {str(op): n for op, n in self.mode.get_flop_counts()["Global"].items()}
        attention = sum(n for op, n in per_op.items() if "attention" in op)
        total = self.mode.get_total_flops()
        return dict(
            total=total,
            attention=attention,
            matmul=total - attention,
            per_op=per_op,
            uncounted=sorted(self.uncounted),
        )


def count(method: str, samples: int, seed: int, extra: tuple[str, ...] = ()) -> dict:
    """``run_one.py METHOD --count-flops``'s record (``extra``: more run_one.py flags)."""
    cmd = [
        sys.executable,
        str(HERE / "run_one.py"),
        method,
        "--samples",
        str(samples),
        "--seed",
        str(seed),
        "--count-flops",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{") and '"method"' in ln]
    if proc.returncode or not lines:
        raise SystemExit(f"work.py: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


# work.py's argument that makes it the child of ``count_in_one_process`` (not a user's flag)
ROWS_CHILD = "--rows-in-this-process"


def count_in_one_process(
    methods: list[str], samples: int, seed: int, extra: tuple[str, ...] = ()
) -> dict[str, dict]:
    """``count``'s records of ``methods``, counted one row after another in one process (one
    start-up instead of one per row: the test suite's smoke). No time is measured here, and the
    counts are the per-row processes' (checked equal for the rows the tests count; a row that
    patched a framework for the rows after it would not be). A row that fails, or that the process
    did not reach, gives ``{"method": m, "failed": ...}``; the others are still counted."""
    flags = ["--samples", str(samples), "--seed", str(seed), "--count-flops", *extra]
    cmd = [sys.executable, str(HERE / "work.py"), ROWS_CHILD, ",".join(methods), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    recs = {}
    for ln in proc.stdout.splitlines():
        if ln.startswith("{") and '"method"' in ln:
            rec = json.loads(ln)
            recs[rec["method"]] = rec
    why = f"work.py: {' '.join(cmd)} ended (exit {proc.returncode}) before this row:\n{proc.stderr[-2000:]}"
    return {m: recs.get(m) or dict(method=m, failed=why) for m in methods}


def _rows_in_this_process(methods: list[str], flags: list[str]) -> None:
    """``count_in_one_process``'s child: run_one.py's ``--count-flops`` run of each row in turn
    (its own model, data and hooks per row), each printing its record."""
    import traceback

    import run_one

    for m in methods:
        try:
            run_one.main([m, *flags])
        except (Exception, SystemExit):  # noqa: BLE001 (recorded; the other rows are still counted)
            print(json.dumps({"method": m, "failed": traceback.format_exc()[-2000:]}), flush=True)


def _counts(methods: list[str], samples: int, seed: int, one_process: bool) -> dict[str, dict]:
    """main's records: a process per row (``count``), or all in one; a failed row ends the run."""
    if not one_process:
        return {m: count(m, samples, seed) for m in methods}
    recs = count_in_one_process(methods, samples, seed)
    failed = {m: r["failed"] for m, r in recs.items() if "failed" in r}
    if failed:
        raise SystemExit(f"work.py: rows failed: {json.dumps(failed, indent=1)[-4000:]}")
    return recs


def paired_medians(path: str) -> dict[str, float]:
    """``"A/B" -> paired median`` of trained tokens/s for every two rows of a ``lockstep.py`` or
    ``run_bench.py`` result (both keep each repetition's records under ``runs``)."""
    import statistics

    from run_bench import paired_ratios

    runs = json.loads(Path(path).read_text())["runs"]
    if isinstance(runs, list):  # lockstep.py: per repetition, its rows
        runs = {
            m: [dict(rec, seed=rep["seed"]) for rep in runs if (rec := rep["rows"].get(m))]
            for m in {m for rep in runs for m in rep["rows"]}
        }
    out = {}
    for a, b in itertools.permutations(runs, 2):
        pairs = paired_ratios(runs, a, b)
        if pairs:
            out[f"{a}/{b}"] = round(statistics.median(pairs), 3)
    return out


def decompose(flops: dict[str, int], speed: dict[str, float]) -> list[dict]:
    """Per row ``X``: ``cl_padding_free`` over ``X``'s speed ratio (paired median) = work ratio
    (``X``'s FLOPs over ours) x FLOP-rate ratio (ours over ``X``'s); and ours over ``X`` at the
    hand-written loop's FLOP rate (``X`` over the hand-written loop's speed, times the work the
    hand-written loop does over ours)."""
    rows = []
    for other in flops:
        if other == OURS:
            continue
        work = flops[other] / flops[OURS]
        ratio = speed.get(f"{OURS}/{other}")
        hand = 1.0 if other == HAND_WRITTEN else speed.get(f"{HAND_WRITTEN}/{other}")
        at_hand_rate = hand * flops[HAND_WRITTEN] / flops[OURS] if hand and HAND_WRITTEN in flops else None
        rows.append(
            dict(
                over=other,
                work_ratio=round(work, 3),
                speed_ratio=ratio,
                flop_rate_ratio=round(ratio / work, 3) if ratio else None,
                at_hand_written_flop_rate=round(at_hand_rate, 3) if at_hand_rate else None,
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(DEFAULT))
    ap.add_argument(
        "--ratios",
        nargs="*",
        default=[],
        help="lockstep.py / run_bench.py results: their paired medians, split into work and FLOP rate",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="count every row in one process, row after row (the test suite's smoke: one start-up)",
    )
    a = ap.parse_args()
    methods = a.methods.split(",")
    recs = _counts(methods, a.samples, a.seed, a.one_process)
    print(f"{'row':<22}{'GFLOP':>9}{'matmul':>9}{'attention':>11}{'MFLOP/trained token':>21}")
    for m, r in recs.items():
        f = r["flops"]
        print(
            f"{m:<22}{f['total'] / 1e9:>9.1f}{f['matmul'] / 1e9:>9.1f}{f['attention'] / 1e9:>11.1f}"
            f"{f['total'] / r['trained_tokens'] / 1e6:>21.2f}"
        )
    from run_bench import cpu_info

    out = dict(
        samples=a.samples,
        seed=a.seed,
        cpu=cpu_info(),
        rows={
            m: dict(
                flops=r["flops"],
                trained_tokens=r["trained_tokens"],
                positions_computed=r["positions_computed"],
            )
            for m, r in recs.items()
        },
    )
    flops = {m: r["flops"]["total"] for m, r in recs.items()}
    out["decomposition"] = {path: decompose(flops, paired_medians(path)) for path in a.ratios if OURS in recs}
    for path, rows in out["decomposition"].items():
        print(path)
        for d in rows:
            print(
                f"  {OURS} / {d['over']}: speed {d['speed_ratio']} = work {d['work_ratio']} x FLOP rate "
                f"{d['flop_rate_ratio']}; at the hand-written loop's FLOP rate: {d['at_hand_written_flop_rate']}"
            )
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == [ROWS_CHILD]:
        _rows_in_this_process(sys.argv[2].split(","), sys.argv[3:])
    else:
        main()
