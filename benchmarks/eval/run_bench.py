"""Evaluation that does not hoard logits: corelooper ``Loop.evaluate()`` vs ``Trainer.evaluate``.

usage: .venv/bin/python benchmarks/eval/run_bench.py [--reps 5] [--samples 2000] [--naive-samples 500]
           [--rows a,b,...] [--cl-layout padding_free|padded] [--out FILE]
       .venv/bin/python benchmarks/eval/run_bench.py --smoke      (seconds: 24 samples, every row once, in-process, no file)

Eval set: ``--samples`` samples of the SFT benchmark's long-tailed chat data (benchmarks/sft/common.py
``make_samples(n, "eval")``, 16-512 tokens, prompt masked), the SFT benchmark's tiny Llama (seed =
the repetition), batches of ``--batch`` in dataset order, padded per batch by one collator shared
by all rows. Rows (ROWS), each in its own fresh process, in a rotated order per repetition:

* ``cl_loss``: ``Loop.evaluate()``, loss only (with ``[lm] head = "trained"``, as an ``[sft]`` run's
  default: the output layer over the trained positions only, a slice of rows at a time; every
  corelooper row sets it);
* ``cl_stream``: with a streaming metric (``corelooper_lm.metrics.TokenAccuracy``: per-batch counts;
  it reads the argmax of the trained positions only, so the output layer runs over those, a slice
  at a time, and hands it the argmax: ``corelooper_lm.sliced_head``);
* ``cl_batch_hf``: ``train.batch_eval_metrics = true`` with HF-style ``compute_metrics(eval_pred,
  compute_result)`` (the same function as ``hf_batch``: HF users' code, unchanged);
* ``hf_loss``: ``Trainer.evaluate`` without ``compute_metrics``;
* ``hf_argmax``: with token-accuracy ``compute_metrics`` and ``preprocess_logits_for_metrics``
  argmax, as the HF docs recommend (keeps one id per position);
* ``hf_batch``: ``batch_eval_metrics=True`` with the same HF-style function as ``cl_batch_hf``;
* ``hf_naive``: ``compute_metrics`` on the logits themselves, no preprocessing: every batch's
  ``[batch, length, vocab]`` logits kept (padded to the longest so far, re-concatenated each batch).
  At 2,000 samples that is > 8 GB of float32 plus a copy, on a 23 GB machine shared with others,
  so this row runs on the first ``--naive-samples`` samples only (its own sample count is in the
  table); its goal line compares corelooper's 2,000-sample growth with its smaller growth, which
  can only favour HF.

Measured in the child, around the ``evaluate()`` call only (construction of the Loop/Trainer
reported apart), after one no-grad forward of the model over the first batch, the same call for
every row (``--process warm``, the default: torch's one-time set-up, ~40 MiB of growth, is then not
counted as the evaluation's; ``--process fresh``: the call is the process's first use of torch):
eval tokens/s (real tokens of the set, padding not counted, over the call's wall time), peak
RSS growth (the kernel's high-water mark reset through /proc/self/clear_refs just before the
call, minus the RSS then), the eval loss and the token accuracy. corelooper's loss is
token-weighted over the set; HF's is the mean of per-batch losses weighted by batch size: the two
are reported, and in repetition 0 corelooper's loss is also recomputed the HF way
(``loss_hf_way``) to show they are the same model on the same batches.

Goals (issue 28): corelooper >= 1.5x the tokens/s and >= 5x less memory growth than each peer
row, judged on the bootstrap 95% interval of the per-repetition paired ratios ("met" only when
the interval clears the goal, "inconclusive" when it crosses it; helpers from benchmarks/sft).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SFT = HERE.parent / "sft"
sys.path.insert(0, str(SFT))
import common as C  # noqa: E402  (the SFT benchmark's data, model and padding)

ROWS = ["cl_loss", "cl_stream", "cl_batch_hf", "hf_loss", "hf_argmax", "hf_batch", "hf_naive"]
# (ours, theirs) judged against GOALS; the first of each pair is corelooper's comparable row
PAIRS = [
    ("cl_loss", "hf_loss"),
    ("cl_stream", "hf_argmax"),
    ("cl_stream", "hf_naive"),
    ("cl_stream", "hf_batch"),
    ("cl_batch_hf", "hf_batch"),
]
GOALS = {"tok_per_s": 1.5, "rss_growth_less": 5.0}


def _sft_bench():
    """benchmarks/sft/run_bench.py (its bootstrap interval, verdict and paired ratios), reused."""
    spec = importlib.util.spec_from_file_location("sft_run_bench", SFT / "run_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the child: one row, one process -----------------------------------------------------------------


def dataset(samples):
    return [{"input_ids": s.input_ids, "labels": s.labels} for s in samples]


def collate(features):
    """Pad to the batch's longest sample (PAD, labels -100): common.pad_batch, for every row."""
    return C.pad_batch([C.Sample(f["input_ids"], f["labels"].count(-100)) for f in features])


def hf_style_batch_metric():
    """Token accuracy as HF users write it for ``batch_eval_metrics``: running counts in a closure."""
    state = {"hit": 0, "n": 0}

    def compute_metrics(eval_pred, compute_result):
        logits, labels = eval_pred
        preds, labels = logits.argmax(-1)[:, :-1], labels[:, 1:]
        mask = labels != -100
        state["hit"] += int((preds[mask] == labels[mask]).sum())
        state["n"] += int(mask.sum())
        if compute_result:
            out = {"accuracy": state["hit"] / state["n"]}
            state.update(hit=0, n=0)
            return out

    return compute_metrics


def hf_token_accuracy(eval_pred):
    """Token accuracy as HF users write it (whole set, numpy): from argmax ids or from logits."""
    import numpy as np

    preds, labels = eval_pred
    if preds.ndim == 3:
        preds = np.argmax(preds, -1)
    preds, labels = preds[:, :-1], labels[:, 1:]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


def argmax_logits(logits, labels):
    return logits.argmax(-1)


def rss_mib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def padding_free_collator(model):
    """corelooper-lm's leak-free padding-free layout (what the SFT benchmark's cl_padding_free row
    and an [sft] run use): the batch's samples flattened into one unpadded row, each attending to
    itself (segment-wise sdpa), -100 on each sample's first label; the same samples per batch."""
    import methods as M  # benchmarks/sft/methods.py

    seg = M._leak_free_collator(model, M.hparams(cl_attention="segments"))
    return lambda features: seg(
        [M._segments([C.Sample(f["input_ids"], f["labels"].count(-100)) for f in features])]
    )


def _corelooper(row, model, data, batch, out_dir, layout="padding_free"):
    from corelooper import Config, Loop, TrainArgs

    metric = None
    if row == "cl_stream":
        from corelooper_lm.metrics import TokenAccuracy

        metric = TokenAccuracy()
    elif row == "cl_batch_hf":
        metric = hf_style_batch_metric()
    args = TrainArgs(
        output_dir=out_dir,
        per_device_eval_batch_size=batch,
        disable_tqdm=True,
        use_cpu=True,
        report_to=[],
        batch_eval_metrics=row == "cl_batch_hf",
        dataloader_num_workers=0,
    )
    collator = padding_free_collator(model) if layout == "padding_free" else collate
    # [lm] head = "trained", what an [sft] run's "auto" picks for this model: the output layer over
    # the trained positions only, a slice at a time (loss only, or TokenAccuracy's argmax)
    config = Config(train=args, sections={"lm": {"head": "trained"}})
    loop = Loop(
        model,
        config,
        eval_dataset=data,
        data_collator=collator,
        compute_metrics=metric,
        blocked_plugins=["console"],
    )
    return loop.evaluate


def _hf(row, model, data, batch, out_dir):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out_dir,
        per_device_eval_batch_size=batch,
        disable_tqdm=True,
        use_cpu=True,
        report_to="none",
        batch_eval_metrics=row == "hf_batch",
        dataloader_num_workers=0,
    )
    metrics = {"hf_loss": None, "hf_batch": hf_style_batch_metric()}.get(row, hf_token_accuracy)
    trainer = Trainer(
        model=model,
        args=args,
        eval_dataset=data,
        data_collator=collate,
        compute_metrics=metrics,
        preprocess_logits_for_metrics=argmax_logits if row == "hf_argmax" else None,
    )
    return trainer.evaluate


def loss_hf_way(model, samples, batch) -> float:
    """HF's eval_loss (per-batch token-mean loss, weighted by batch size): for corelooper's rows."""
    import torch

    total = 0.0
    with torch.no_grad():
        for i in range(0, len(samples), batch):
            b = C.pad_batch(samples[i : i + batch])
            total += float(model(**b).loss) * len(samples[i : i + batch])
    return total / len(samples)


def warm_up(model, samples, batch) -> None:
    """One no-grad forward over the set's first batch, padded, the same call for every row: the state
    of a process that has run the model already (a training run that evaluates every ``eval_steps``),
    so torch's one-time set-up (its thread pool, kernel workspaces: ~40 MiB of growth, ~30 kept, here) is
    not counted as the evaluation's growth."""
    import torch

    with torch.no_grad():
        model(**C.pad_batch(samples[:batch]))


def child(row: str, seed: int, n: int, batch: int, layout: str, process: str = "warm") -> dict:
    import torch

    t0 = time.perf_counter()
    samples = C.make_samples(n, "eval")
    data, model = dataset(samples), C.make_model(seed)
    import transformers  # noqa: F401  (both sides import it: the model is a transformers Llama)

    with tempfile.TemporaryDirectory() as tmp:
        evaluate = (
            _corelooper(row, model, data, batch, tmp, layout)
            if row.startswith("cl_")
            else _hf(row, model, data, batch, tmp)
        )
        constructed = time.perf_counter() - t0
        if process == "warm":
            warm_up(model, samples, batch)
        before = rss_mib()
        reset = True
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            reset = False
        t = time.perf_counter()
        metrics = evaluate()
        wall = time.perf_counter() - t
        peak = rss_mib("VmHWM")
    tokens = sum(len(s.input_ids) for s in samples)
    rec = dict(
        row=row,
        seed=seed,
        samples=n,
        tokens=tokens,
        batch=batch,
        threads=torch.get_num_threads(),
        layout=layout if row.startswith("cl_") else "padded",
        process=process,
        construct_s=round(constructed, 3),
        eval_s=round(wall, 3),
        tok_per_s=round(tokens / wall, 1),
        rss_before_mib=round(before, 1),
        rss_growth_mib=round(peak - before, 1),
        peak_reset=reset,
        eval_loss=metrics.get("eval_loss"),
        accuracy=metrics.get("eval_accuracy"),
    )
    if row.startswith("cl_") and seed == 0:  # once: the check costs an HF-speed pass over the set
        model.eval()
        model.set_attn_implementation("sdpa")  # the padded batches of HF's loss: stock sdpa
        rec["loss_hf_way"] = round(loss_hf_way(model, samples, batch), 6)
    return rec


# -- the parent: interleaved repetitions, paired ratios, goals -----------------------------------------


def run(row: str, seed: int, a) -> dict:
    n = min(a.samples, a.naive_samples) if row == "hf_naive" else a.samples
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        row,
        "--seed",
        str(seed),
        "--samples",
        str(n),
        "--batch",
        str(a.batch),
        "--cl-layout",
        a.cl_layout,
        "--process",
        a.process,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")), None)
    rec = (
        json.loads(line)
        if line and proc.returncode == 0
        else {"row": row, "seed": seed, "failed": (proc.stdout + proc.stderr)[-2000:]}
    )
    rec["loadavg"] = round(os.getloadavg()[0], 2)
    return rec


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    table = []
    print(
        f"\n{'row':12s} {'n':>2s} {'samples':>7s} {'tok/s':>8s} {'[min-max]':>13s} {'RSS growth MiB':>14s} "
        f"{'eval loss':>9s} {'loss HF way':>11s} {'accuracy':>8s}"
    )
    for row, recs in runs.items():
        ok = [r for r in recs if "tok_per_s" in r]
        if not ok:
            print(f"{row:12s} failed: {recs[0].get('failed', '')[-400:]}")
            table.append(dict(row=row, failed=recs[0].get("failed")))
            continue
        tps, growth = [r["tok_per_s"] for r in ok], [r["rss_growth_mib"] for r in ok]
        med = statistics.median
        t = dict(
            row=row,
            n=len(ok),
            samples=ok[0]["samples"],
            tok_per_s=med(tps),
            tok_per_s_range=[min(tps), max(tps)],
            rss_growth_mib=med(growth),
            rss_growth_range=[min(growth), max(growth)],
            eval_loss=med([r["eval_loss"] for r in ok]),
            accuracy=ok[0]["accuracy"],
            loss_hf_way=ok[0].get("loss_hf_way"),
            construct_s=med([r["construct_s"] for r in ok]),
        )
        table.append(t)
        acc = f"{t['accuracy']:.4f}" if t["accuracy"] is not None else "-"
        hfway = f"{t['loss_hf_way']:.6f}" if t["loss_hf_way"] is not None else "-"
        print(
            f"{row:12s} {t['n']:2d} {t['samples']:7d} {t['tok_per_s']:8.0f} {'{:.0f}-{:.0f}'.format(*t['tok_per_s_range']):>13s} "
            f"{t['rss_growth_mib']:14.1f} {t['eval_loss']:9.6f} {hfway:>11s} {acc:>8s}"
        )
    return table


def goals(runs: dict[str, list[dict]]) -> dict:
    sft = _sft_bench()
    out = {}
    for ours, theirs in PAIRS:
        if not (runs.get(ours) and runs.get(theirs)):
            continue
        speed = sft.paired_ratios(runs, ours, theirs, "tok_per_s")
        # memory: theirs / ours (how many times less corelooper grows); a floor of 1 MiB each, so
        # a growth within the allocator's noise does not make an infinite ratio
        mine = {r["seed"]: max(r["rss_growth_mib"], 1.0) for r in runs[ours] if "rss_growth_mib" in r}
        other = {r["seed"]: max(r["rss_growth_mib"], 1.0) for r in runs[theirs] if "rss_growth_mib" in r}
        less = [other[s] / mine[s] for s in sorted(mine.keys() & other.keys())]
        for key, ratios in (("tok_per_s", speed), ("rss_growth_less", less)):
            if not ratios:
                continue
            ci, ratio = sft.median_ci95(ratios), round(statistics.median(ratios), 3)
            v = sft.verdict(ratio, GOALS[key], ci)
            out[f"{ours}_vs_{theirs}_{key}"] = dict(
                ours=ours,
                theirs=theirs,
                ratio=ratio,
                ci95=ci,
                goal=GOALS[key],
                verdict=v,
                pairs=[round(x, 3) for x in ratios],
            )
            ci_s = "{:.3f}-{:.3f}".format(*ci) if ci else "too few repetitions"
            print(f"goal {ours} vs {theirs} {key}: {ratio:.3f}x [95% {ci_s}] (goal >= {GOALS[key]}: {v})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--naive-samples", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument(
        "--cl-layout",
        default="padding_free",
        choices=["padding_free", "padded"],
        help="corelooper rows' batches: leak-free padding-free (corelooper-lm, as [sft] runs) or padded",
    )
    ap.add_argument(
        "--process",
        default="warm",
        choices=["warm", "fresh"],
        help="warm (default): every row's process runs the model once (one no-grad forward of the "
        "first batch) before the measured call, as a training run that evaluates has; fresh: "
        "the call is the process's first use of torch (its one-time set-up counted)",
    )
    ap.add_argument("--out", default=None, help="default: benchmarks/results/eval.json (--smoke: none)")
    ap.add_argument(
        "--smoke", action="store_true", help="24 samples, every row once in this process, no file"
    )
    ap.add_argument("--one", choices=ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(child(a.one, a.seed, a.samples, a.batch, a.cl_layout, a.process)), flush=True)
        return
    if a.smoke:  # every row once, in this process (seconds; its RSS figures mean nothing)
        a.reps, a.samples, a.naive_samples, a.batch = 1, 24, 24, 8
    elif a.out is None:
        a.out = str(HERE.parent / "results" / "eval.json")
    rows, load0 = a.rows.split(","), os.getloadavg()
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    for rep in range(a.reps):
        k = rep % len(rows)
        for row in rows[k:] + rows[:k]:
            rec = (
                dict(child(row, rep, a.samples, a.batch, a.cl_layout, a.process), loadavg=0)
                if a.smoke
                else run(row, rep, a)
            )
            runs[row].append(rec)
            print(
                f"rep {rep} {row:12s} tok/s={rec.get('tok_per_s')} growth={rec.get('rss_growth_mib')} MiB "
                f"loss={rec.get('eval_loss')} load={rec['loadavg']} {(rec.get('failed') or '')[-300:]}",
                file=sys.stderr,
                flush=True,
            )
    table = summarize(runs)
    judged = goals(runs)
    summary = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        reps=a.reps,
        samples=a.samples,
        cl_layout=a.cl_layout,
        process=a.process,
        naive_samples=a.naive_samples,
        batch=a.batch,
        cpus=os.cpu_count(),
        loadavg_start=[round(x, 2) for x in load0],
        loadavg_end=[round(x, 2) for x in os.getloadavg()],
        command=" ".join(sys.argv),
        goals=judged,
        table=table,
        runs=runs,
    )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"load average {summary['loadavg_start']} -> {summary['loadavg_end']}"
        + (f"; wrote {a.out}" if a.out else "")
    )
    print(
        "SUMMARY " + json.dumps({"failed": [t["row"] for t in table if "failed" in t], "goals": len(judged)})
    )
    if any("failed" in t for t in table):
        sys.exit(1)


if __name__ == "__main__":
    main()
