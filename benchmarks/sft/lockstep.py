"""SFT contenders in lockstep: a turn of a few optimizer steps each, one contender at a time.

usage: benchmarks/.venv/bin/python benchmarks/sft/lockstep.py [--reps 10] [--steps-per-turn 8]
           [--methods cl_padding_free,raw_padding_free,hf_grouped,trl_grouped] [--samples 512]
           [--threads 2] [--out benchmarks/results/sft_lockstep.json]

Why: on this 2-CPU VM the slow phases last seconds to minutes (benchmarks/README.md), so rows run
one after the other can land in different phases, and a 10-repetition interval stays wide. Here
the contenders of a repetition train side by side and take turns: A's steps 1-8, B's steps 1-8,
..., then A's steps 9-16. A slow phase then falls on the turns of all of them alike.

Each contender is a process of its own, set up as ``run_one.py`` sets it up (its framework
imported, its model made) before the turns start, and paused between its turns: an
optimizer-step post-hook ends the turn and waits on a pipe for the next one. Only one trains at
a time, so each has the CPUs, its caches for a turn, and the OpenMP thread pool of a run alone.
(Threads in one process would not: libgomp stops its worker threads spinning when a process has
more threads than CPUs, and every contender's steps got slower, by up to 20%, and not alike.)

Each contender's time is the sum of its own steps: "to the last step" from its framework call
(construction and data preparation count) to its last optimizer step, as ``run_one.py``'s
trained tokens/s; the steady state leaves the first step out. Repetition ``r`` uses seed ``r``
(model init and data order) and rotates the order, as ``run_bench.py``; each trained model's
eval loss is measured afterwards, one contender at a time, and equals its run alone (the turns
change when a step runs, not what it computes). The ratios use ``run_bench.py``'s goals and
bootstrap interval; they are a diagnostic beside its verdicts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

DEFAULT = ["cl_padding_free", "raw_padding_free", "hf_grouped", "trl_grouped"]


class Child:
    """The contender's side: its time with the turn, and the pipe protocol with the driver.

    One byte each way: the driver writes ``g`` (go: your turn) and ``e`` (evaluate, the turns are
    over); the contender writes ``r`` (ready: imported and set up), ``s`` (a turn of
    ``steps_per_turn`` optimizer steps ended) and ``d`` (done: its call returned), then its record
    as one JSON line after ``e``."""

    def __init__(self, fd_in: int, fd_out: int, steps_per_turn: int) -> None:
        self.read, self.write = os.fdopen(fd_in, "rb", buffering=0), os.fdopen(fd_out, "wb", buffering=0)
        self.steps_per_turn = steps_per_turn
        self.spans: list[float] = []
        self._resumed = 0.0

    def tell(self, what: bytes) -> None:
        self.write.write(what)

    def wait(self, expected: bytes) -> None:
        got = self.read.read(1)
        if got != expected:
            raise SystemExit(f"lockstep child: expected {expected!r} from the driver, got {got!r}")
        self._resumed = time.perf_counter()

    def step_ended(self, *_args) -> None:
        """The optimizer-step post-hook: ends the turn every ``steps_per_turn`` steps."""
        now = time.perf_counter()
        self.spans.append(now - self._resumed)
        self._resumed = now
        if len(self.spans) % self.steps_per_turn == 0:
            self.tell(b"s")
            self.wait(b"g")


def child(a) -> None:
    """One contender in its own process, as run_one.py runs it, paused between its turns."""
    import common as C
    import methods as M
    import run_one
    from torch.optim.optimizer import register_optimizer_step_post_hook

    train, evals, st, h, model = run_one.setup(
        run_one.parse(
            [
                a.child,
                "--seed",
                str(a.seed),
                "--samples",
                str(a.samples),
                "--eval-samples",
                str(a.eval_samples),
                "--threads",
                str(a.threads),
            ]
        )
    )
    probe = C.Probe(model)
    M.import_framework(a.child)
    me = Child(a.fd_in, a.fd_out, a.steps_per_turn)
    register_optimizer_step_post_hook(me.step_ended)
    me.tell(b"r")
    me.wait(b"g")
    error = None
    try:
        M.METHODS[a.child](model, train, h)
    except Exception as e:  # noqa: BLE001 (reported in the record; the others go on)
        error = f"{type(e).__name__}: {e}"
    me.tell(b"d")
    me.wait(b"e")
    spans = me.spans
    later = float(sum(int(x) for x in probe.trained_per_forward[1:]))
    rec = dict(
        optimizer_steps=len(spans),
        to_last_step_s=round(sum(spans), 4),
        first_step_s=round(spans[0], 4) if spans else None,
        trained_tok_per_s=round(st["trained_tokens"] / sum(spans), 1) if spans else None,
        trained_tok_per_s_steady=round(later / sum(spans[1:]), 1) if len(spans) > 1 else None,
        eval_loss=round(C.eval_loss(model, evals), 4),
        error=error,
    )
    me.tell((json.dumps(rec) + "\n").encode())


def take_turns(contenders: list) -> None:
    """The driver's schedule: each contender not done, in order, gets the turn until it ends it
    (``s``) or its call returns (``d``). ``contenders``: objects with ``go()`` and ``answer()``."""
    done = [False] * len(contenders)
    while not all(done):
        for i, c in enumerate(contenders):
            if not done[i]:
                c.go()
                done[i] = c.answer() == b"d"


class Contender:
    """The driver's side of one child process."""

    def __init__(self, method: str, seed: int, a) -> None:
        to_child, self._to_child = os.pipe()
        self._from_child, from_child = os.pipe()
        cmd = [
            sys.executable,
            __file__,
            "--child",
            method,
            "--seed",
            str(seed),
            "--fd-in",
            str(to_child),
            "--fd-out",
            str(from_child),
            "--samples",
            str(a.samples),
            "--eval-samples",
            str(a.eval_samples),
            "--threads",
            str(a.threads),
            "--steps-per-turn",
            str(a.steps_per_turn),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}
        self.method = method
        self.proc = subprocess.Popen(
            cmd, pass_fds=(to_child, from_child), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        os.close(to_child)
        os.close(from_child)
        self.write = os.fdopen(self._to_child, "wb", buffering=0)
        self.read = os.fdopen(self._from_child, "rb", buffering=0)

    def go(self) -> None:
        self.write.write(b"g")

    def answer(self) -> bytes:
        got = self.read.read(1)
        if not got:
            self.fail("exited")
        return got

    def record(self) -> dict:
        self.write.write(b"e")
        line = b"".join(iter(lambda: self.read.read(1), b"\n"))
        self.proc.wait(timeout=600)
        return json.loads(line)

    def fail(self, what: str):
        self.proc.kill()
        raise SystemExit(
            f"lockstep: {self.method} {what} (exit {self.proc.wait()}):\n"
            f"{self.proc.stderr.read().decode()[-3000:]}"
        )


def one(seed: int, methods: list[str], a) -> dict:
    """One repetition: a process per method, set up side by side, then trained in turns, then
    evaluated one after the other."""
    contenders = [Contender(m, seed, a) for m in methods]
    for c in contenders:
        if c.answer() != b"r":
            c.fail("did not get ready")
    take_turns(contenders)
    return dict(
        seed=seed, order=methods, loadavg=os.getloadavg()[0], rows={c.method: c.record() for c in contenders}
    )


def summarize(reps: list[dict], methods: list[str]) -> dict:
    """Per method the medians; per goal the paired ratios (corelooper's row over each peer's best
    in this run), their bootstrap interval and the verdict, to the last step and steady."""
    from run_bench import GOALS, median_ci95, verdict

    def values(m, key):
        return [r["rows"][m][key] for r in reps if r["rows"].get(m, {}).get(key)]

    table = {
        m: dict(
            trained_tok_per_s=statistics.median(values(m, "trained_tok_per_s") or [0]),
            trained_tok_per_s_steady=statistics.median(values(m, "trained_tok_per_s_steady") or [0]),
            eval_loss=sorted(set(values(m, "eval_loss"))),
        )
        for m in methods
    }
    ours = "cl_padding_free"

    def best(prefix):
        rows = [m for m in methods if m.startswith(prefix)]
        return max(rows, key=lambda m: table[m]["trained_tok_per_s"]) if rows else None

    def paired(a: str, b: str, key: str = "trained_tok_per_s") -> list[float]:
        return [
            r["rows"][a][key] / r["rows"][b][key]
            for r in reps
            if r["rows"][a].get(key) and r["rows"][b].get(key)
        ]

    goals = {}
    for name, theirs in (
        ("trl_best", best("trl_")),
        ("hf_best", best("hf_")),
        ("raw_padding_free", best("raw_")),
    ):
        if theirs is None or ours not in methods:
            continue
        for key in ("trained_tok_per_s", "trained_tok_per_s_steady"):
            pairs = paired(ours, theirs, key)
            if not pairs:
                continue
            ci = median_ci95(pairs)
            median = round(statistics.median(pairs), 3)
            goals[f"{name}/{key}"] = dict(
                theirs=theirs,
                goal=GOALS[name],
                paired_median=median,
                ci95=ci,
                verdict=verdict(median, GOALS[name], ci),
                per_repetition=[round(x, 3) for x in pairs],
            )
    # every two rows, no goal: e.g. the trained head over the full one, the framework over the hand-written loop
    ratios = {
        f"{a}/{b}": dict(paired_median=round(statistics.median(pairs), 3), ci95=median_ci95(pairs))
        for a, b in itertools.combinations(methods, 2)
        if (pairs := paired(a, b))
    }
    return dict(table=table, goals=goals, ratios=ratios)


def drive(a) -> None:
    methods = a.methods.split(",")
    load0 = os.getloadavg()
    reps = []
    for rep in range(a.reps):
        k = rep % len(methods)
        order = methods[k:] + methods[:k]
        rec = one(rep, order, a)
        reps.append(rec)
        print(
            f"rep {rep} "
            + " ".join(
                f"{m}={r['trained_tok_per_s']}/{r['trained_tok_per_s_steady']}"
                f"{' ERROR ' + r['error'] if r['error'] else ''}"
                for m, r in rec["rows"].items()
            )
            + f" load={rec['loadavg']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    result = summarize(reps, methods)
    print(f"\n{'method':18s} {'trained tok/s':>13s} {'steady':>8s}  eval loss")
    for m, row in result["table"].items():
        print(
            f"{m:18s} {row['trained_tok_per_s']:13.0f} {row['trained_tok_per_s_steady']:8.0f}  {row['eval_loss']}"
        )
    for name, r in result["ratios"].items():
        print(f"{name}: {r['paired_median']} [95% {r['ci95']}]")
    for name, g in result["goals"].items():
        print(
            f"cl_padding_free over {g['theirs']} ({name}): {g['paired_median']} [95% {g['ci95']}] "
            f"(goal >= {g['goal']}: {g['verdict']})"
        )
    from run_bench import cpu_info

    out = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        reps=a.reps,
        samples=a.samples,
        threads=a.threads,
        cpu=cpu_info(),
        loadavg_start=[round(x, 2) for x in load0],
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
        **result,
        runs=reps,
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {out['loadavg_start']} -> {out['loadavg_end']}; wrote {a.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--methods", default=",".join(DEFAULT))
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--eval-samples", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "sft_lockstep.json"))
    ap.add_argument("--steps-per-turn", type=int, default=8)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the rest: a child's own
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--fd-in", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--fd-out", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
    else:
        drive(a)


if __name__ == "__main__":
    main()
