"""Chat SFT at a large vocabulary: a Qwen2 with Qwen2.5's 151,936-token vocabulary (hidden 256, 2
layers, GQA 4 heads / 2 KV heads, untied head), where the LM head is nearly all of the work and
its logits nearly all of the activation memory. HF Trainer, TRL SFTTrainer, a hand-written loop
computing every position, and corelooper's default ``[sft]`` run, on the chat-SFT benchmark's
long-tailed data (~60% trained positions).

usage: benchmarks/.venv/bin/python benchmarks/large_vocab/run.py [--reps 5] [--out F.json]
           [--samples 256] [--batch 8] [--methods a,b,...] [--memory-batch 8] [--memory-len 1024]
           [--cap-gib 8] [--headroom-len 256] [--skip-headroom]

Every row is a fresh ``benchmarks/sft/run_one.py --model qwen2`` process (the same runners,
hyper-parameters and eval loss as the chat-SFT benchmark), in a rotated order per repetition. Four
passes, each recorded:

1. **throughput** (``--reps``): trained tokens/s to the last optimizer step (the whole call) and in
   the steady state (from the first optimizer step's end: the second step on), peak RSS of the
   training (``VmHWM`` before the eval loss), eval loss;
2. **work**: each row's FLOPs on the same samples (``work.py``: ``FlopCounterMode``), and the
   exact-work floor (``exact_floor``): the hand-written loop's count less what only the head of an
   untrained position needs;
3. **activation memory** at a fixed micro-batch of ``--memory-batch`` x ``--memory-len`` tokens
   (every sample that long): peak RSS less the RSS right after an optimizer step (model, gradients
   and optimizer state exist, activations freed), glibc returning freed blocks to the OS
   (``MALLOC_ENV``) so the RSS after a step holds no freed activations;
4. **memory headroom** (``--cap-gib``): for HF's and TRL's best rows and corelooper's, the largest
   micro-batch (samples of ``--headroom-len`` tokens) whose training stays under the cap: the
   child is killed when its RSS passes the cap, and a run counts only with its peak under it.

Goals (``GOALS``), judged on the bootstrap 95% interval of the per-repetition values where there
are repetitions ("met", "NOT met", "inconclusive" when the interval crosses): corelooper's
steady-state speed over each peer's best row >= 95% of what their FLOP counts allow; its FLOPs
within 3% of the floor; its activation memory >= 5x less than HF's; its eval loss within 1e-3
(relative) of the hand-written loop's; its headroom >= 3x HF's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
SFT = HERE.parent / "sft"
sys.path.insert(0, str(SFT))

import common as C  # noqa: E402
import run_bench as RB  # noqa: E402
import work as W  # noqa: E402

sys.path.insert(0, str(HERE))
from analysis import CHUNKED, OURS, judge, table  # noqa: E402

# Each peer's documented settings (dataset packing is left out: it changes the steps and samples per
# step, which every row here shares), the hand-written loop, corelooper's [sft] default (head over
# the trained positions, token_accuracy on).
METHODS = [
    "hf_padded",
    "hf_grouped",
    "hf_flattening",
    "trl_padded",
    "trl_grouped",
    "trl_padding_free",
    "raw_padding_free",
    "cl_padding_free",
    "cl_padding_free_chunked",
]
PASSES = ("throughput", "work", "memory", "headroom")
# glibc: blocks over 64 KiB are mmap'd and every free trims, so the RSS after a step is live memory
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def model_args(a, **over) -> list[str]:
    """run_one.py flags of a row: the large-vocabulary model, the data, the batch."""
    samples, batch = over.get("samples", a.samples), over.get("batch", a.batch)
    length = over.get("length", 0)
    args = ["--model", "qwen2", "--samples", str(samples), "--batch", str(batch)]
    args += ["--eval-samples", str(over.get("eval_samples", a.eval_samples))]
    if length:  # fixed-length samples; the padded rows' max_length must not cut them
        args += ["--sample-len", str(length), "--max-len", str(max(length, C.MAX_LEN))]
    return args


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def throughput(a, methods: list[str]) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for rep in range(a.reps):
        k = rep % len(methods)
        for m in methods[k:] + methods[:k]:
            rec = RB.run(m, rep, model_args(a), timeout=a.timeout)
            runs[m].append(rec)
            log(
                f"rep {rep} {m:18s} rc={rec['rc']} tok/s={rec.get('trained_tok_per_s')} "
                f"steady={rec.get('trained_tok_per_s_steady')} loss={rec.get('eval_loss')} "
                f"{rec.get('skipped') or ''}{(rec.get('failed') or '')[-400:]}"
            )
    return runs


def work(a, methods: list[str]) -> dict[str, dict]:
    out = {}
    # --work-in-one-process (the test suite's smoke): every row's count from one process
    together = (
        W.count_in_one_process(methods, a.samples, 0, tuple(model_args(a))) if a.work_in_one_process else {}
    )
    for m in methods:
        try:
            rec = together.get(m) or W.count(m, a.samples, 0, tuple(model_args(a)))
            if "failed" in rec:
                raise SystemExit(rec["failed"])
        except SystemExit as e:  # work.count's paragraph: recorded, the other rows still counted
            out[m] = dict(failed=str(e)[-600:])
            log(f"work {m:18s} failed: {str(e)[-300:]}")
            continue
        out[m] = dict(flops=rec["flops"], positions_computed=rec["positions_computed"])
        log(f"work {m:18s} {rec['flops']['total'] / 1e9:.1f} GFLOP")
    return out


def memory(a, methods: list[str]) -> dict[str, dict]:
    """Activation memory at the fixed micro-batch: three optimizer steps of ``--memory-batch``
    samples of ``--memory-len`` tokens, one process per row."""
    out = {}
    over = dict(samples=3 * a.memory_batch, batch=a.memory_batch, length=a.memory_len, eval_samples=1)
    with mock.patch.dict(os.environ, MALLOC_ENV):  # for the children this pass starts
        for m in methods:
            rec = RB.run(m, 0, [*model_args(a, **over), "--memory"], timeout=a.timeout)
            keep = (
                "activation_mib",
                "step_growth_mib",
                "static_rss_mib",
                "peak_rss_self_mib",
                "positions_computed",
            )
            out[m] = {k: rec.get(k) for k in keep} | (
                {"failed": rec["failed"][-600:]} if "failed" in rec else {}
            )
            log(
                f"memory {m:18s} activation {rec.get('activation_mib')} MiB (static {rec.get('static_rss_mib')})"
            )
    return out


def _trial_ok(a, method: str, batch: int, cap_kib: int) -> tuple[bool, float | None]:
    """One training of two steps at ``batch`` samples of ``--headroom-len`` tokens, killed when its
    RSS passes ``cap_kib``: (fits, the training's peak RSS in MiB)."""
    over = dict(samples=2 * batch, batch=batch, length=a.headroom_len, eval_samples=1)
    argv = [sys.executable, str(SFT / "run_one.py"), method, *model_args(a, **over)]
    with tempfile.TemporaryFile() as out:
        p = subprocess.Popen(argv, cwd=SFT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        killed = False
        while p.poll() is None:
            if _rss_kib(p.pid) > cap_kib:
                p.send_signal(signal.SIGKILL)
                killed = True
            time.sleep(0.01)
        out.seek(0)
        text = out.read().decode(errors="replace")
    rec = next((json.loads(x) for x in reversed(text.splitlines()) if x.startswith('{"method"')), None)
    peak = rec.get("peak_rss_self_mib") if rec else None
    fits = not killed and p.returncode == 0 and peak is not None and peak * 1024 <= cap_kib
    return fits, peak


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def headroom(a, method: str) -> dict:
    """The largest batch that fits the cap: doubling from 1, then bisecting (each try a fresh
    process: the user's view, what a run at that micro-batch needs)."""
    cap_kib = int(a.cap_gib * 2**20)
    tries, good, bad = {}, 0, None
    batch = 1
    while bad is None and batch <= a.headroom_max_batch:
        ok, tries[batch] = _trial_ok(a, method, batch, cap_kib)
        good, bad = (batch, None) if ok else (good, batch)
        batch *= 2
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        ok, tries[mid] = _trial_ok(a, method, mid, cap_kib)
        good, bad = (mid, bad) if ok else (good, mid)
    log(f"headroom {method:18s} {good} x {a.headroom_len} tokens under {a.cap_gib} GiB")
    return dict(
        batch=good,
        tokens=good * a.headroom_len,
        at_limit=bad is None,  # the largest batch tried fitted: the headroom is at least this
        peak_rss_mib_by_batch={str(k): v for k, v in sorted(tries.items())},
    )


def exact_floor(samples: list[C.Sample], raw_flops: int) -> int:
    """The least work this model needs on ``samples``: the hand-written loop's count (every position)
    less, at every position whose head does not train (the prompt but its last token, and each
    sample's last token), what only feeds that head: the head (6 h V), the last layer's query
    projection, output projection and MLP (6 per weight) and its causal attention for that query
    (12 head_dim per key per head: QK and AV forward, four products backward)."""
    m = C.QWEN2_LARGE_VOCAB
    h, v, inter = m["hidden_size"], m["vocab_size"], m["intermediate_size"]
    heads, dim = m["num_attention_heads"], m["hidden_size"] // m["num_attention_heads"]
    per_position = 6 * h * v + 6 * (2 * h * heads * dim + 3 * h * inter)
    saved = 0
    for s in samples:
        untrained = [*range(s.prompt_length - 1), len(s.input_ids) - 1]
        saved += len(untrained) * per_position + sum(12 * dim * heads * (p + 1) for p in untrained)
    return raw_flops - saved


def every_position_flops(samples: list[C.Sample]) -> int:
    """What the hand-written loop's count must be: 6 per linear weight per position, plus causal
    attention (12 head_dim per key per head per layer) — a check of the counter on this model."""
    m = C.QWEN2_LARGE_VOCAB
    h, v, inter, layers = m["hidden_size"], m["vocab_size"], m["intermediate_size"], m["num_hidden_layers"]
    heads, kv = m["num_attention_heads"], m["num_key_value_heads"]
    dim = h // heads
    linear = layers * (2 * h * heads * dim + 2 * h * kv * dim + 3 * h * inter) + h * v
    positions = sum(len(s.input_ids) for s in samples)
    keys = sum(n * (n + 1) // 2 for n in (len(s.input_ids) for s in samples))
    return 6 * linear * positions + layers * 12 * dim * heads * keys


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "large_vocab.json"))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--samples", type=int, default=256, help="training samples (steps = samples / batch)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--memory-batch", type=int, default=8)
    ap.add_argument("--memory-len", type=int, default=1024)
    ap.add_argument("--cap-gib", type=float, default=8.0, help="the memory headroom's cap on the RSS")
    ap.add_argument("--headroom-len", type=int, default=256, help="tokens per sample in the headroom search")
    ap.add_argument("--headroom-max-batch", type=int, default=256)
    ap.add_argument(
        "--passes",
        default=",".join(PASSES),
        help="which passes to run (a subset gives a partial JSON: the goals of the passes run)",
    )
    ap.add_argument(
        "--headroom-methods",
        default="",
        help="rows of the headroom search (default: HF's and TRL's best by steady tokens/s, corelooper's)",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one row's process may run")
    ap.add_argument(
        "--work-in-one-process",
        action="store_true",
        help="the work pass counts every row in one process (the test suite's smoke: one start-up; "
        "no time is measured there, and the counts are the per-row processes')",
    )
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    a = parse(argv)
    methods, passes = a.methods.split(","), set(a.passes.split(","))
    if passes - set(PASSES):
        sys.exit(f"--passes {a.passes}: use some of {','.join(PASSES)}")
    load0, t0 = [round(x, 2) for x in os.getloadavg()], time.time()
    runs = throughput(a, methods) if "throughput" in passes else {}
    counts = work(a, methods) if "work" in passes else {}
    mem = memory(a, methods) if "memory" in passes else {}
    rows = table(runs, counts, mem)
    room = {}
    if "headroom" in passes:
        best = {r["method"] for r in rows if r.get("best_of")}
        chosen = (
            a.headroom_methods.split(",")
            if a.headroom_methods
            else sorted(best | ({OURS, CHUNKED} & set(methods)))
        )
        for m in chosen:
            room[m] = headroom(a, m)
    samples = C.make_samples(a.samples, "train")
    raw = counts.get("raw_padding_free", {}).get("flops", {}).get("total")
    floor = dict(
        flops=exact_floor(samples, raw) if raw else None,
        every_position_formula=every_position_flops(samples),
        hand_written_count=raw,
    )
    goals = judge(rows, runs, floor, room)
    peak_load = max((r.get("loadavg", 0) for recs in runs.values() for r in recs), default=0)
    out = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        wall_s=round(time.time() - t0, 1),
        args=vars(a),
        model=C.QWEN2_LARGE_VOCAB,
        data=C.stats(samples),
        cpu=RB.cpu_info(),
        load=dict(start=load0, end=[round(x, 2) for x in os.getloadavg()], max_seen=peak_load),
        rows=rows,
        goals=goals,
        floor=floor,
        headroom=room,
        work=counts,
        memory=mem,
        runs=runs,
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {out['load']['start']} -> {out['load']['end']}; wrote {a.out}")
    if peak_load > (os.cpu_count() or 1):
        print(f"WARNING: the load average exceeded the {os.cpu_count()} CPUs during the run: not quotable.")
    return out


if __name__ == "__main__":
    main()
