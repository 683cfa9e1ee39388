"""Preprocessing at scale: a chat JSONL of N conversations (chat_data.py) tokenized with a chat
template, assistant-masked and packed (bfd, 512) — corelooper-sft vs TRL's ``SFTTrainer``, same
tokenizer, same tiny Llama, one optimizer step each.

usage: python preprocess.py [--sizes 10000 100000] [--reps 3] [--work DIR] [--only cl|trl] [--no-warm-up]
       python preprocess.py one {cl,trl} --data F.jsonl --tokenizer DIR --out DIR   (one run, one JSON line)

Each run is a fresh process with fresh caches (``HF_DATASETS_CACHE``, ``CORELOOPER_SFT_CACHE``);
it records the wall time from process start to the first optimizer step (imports, JSON -> Arrow,
tokenizing, masking, packing, model build, one step), the time spent preparing the data set alone
(corelooper_sft.pipeline.prepare / SFTTrainer._prepare_dataset), the CPU time of both (user +
system: what a loaded machine distorts least), and the peak RSS at that step.
corelooper is then started a second time on the same caches: its preparation should be a cache
read. Repetitions are interleaved (cl, cl second start, TRL; the order of cl and TRL alternates
from one repetition to the next) and judged on the ratios of the same repetition: TRL / corelooper
for the time and CPU time to the first optimizer step and for the preparation, with the bootstrap
95% interval of their median (run_bench.median_ci95) and the goal's verdict (run_bench.verdict:
"met" only when the whole interval is at or over 2x); the second start's share of the first.
Writes ``results/preprocess.json`` (runs and summary); the load average of every run is in it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CONFIG = """\
[model]
factory = "{here}/chat_data.py:make_model"
tokenizer = "{tok}"
[data]
train = "{data}"
[train]
output_dir = "{out}/run"
max_steps = 1
per_device_train_batch_size = 8
learning_rate = 3e-3
optim = "adamw_torch_fused"
save_strategy = "no"
report_to = "none"
[sft]
assistant_only_loss = true
packing = true
packing_strategy = "bfd"
max_length = 512
"""


def _first_step_hook(prep: dict) -> None:
    """At the first optimizer step: print the record and leave (what follows is not measured)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def done(*_):
        use = resource.getrusage(resource.RUSAGE_SELF)
        rec = dict(
            to_first_step_s=round(time.perf_counter() - T0, 3),
            prepare_s=round(prep.get("s", 0.0), 3),
            cpu_to_first_step_s=round(use.ru_utime + use.ru_stime, 3),
            prepare_cpu_s=round(prep.get("cpu", 0.0), 3),
            peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            load=os.getloadavg(),
        )
        print("RESULT " + json.dumps(rec), flush=True)
        os._exit(0)

    register_optimizer_step_post_hook(done)


def _timed(owner, name: str, prep: dict) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t, c = time.perf_counter(), time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            prep["s"] = prep.get("s", 0.0) + time.perf_counter() - t
            prep["cpu"] = prep.get("cpu", 0.0) + time.process_time() - c

    setattr(owner, name, wrapper)


def one_cl(data: Path, tok: Path, out: Path) -> None:
    import corelooper_sft.pipeline as P
    import corelooper_sft.setup as S
    from corelooper.cli.app import app

    prep: dict = {}
    _timed(S, "prepare", prep)  # setup.prepare_split calls it by this name
    _first_step_hook(prep)
    cfg = out / "c.toml"
    cfg.write_text(CONFIG.format(here=HERE, tok=tok, data=data, out=out))
    del P
    app(["run", str(cfg)], standalone_mode=False)


def one_trl(data: Path, tok: Path, out: Path) -> None:
    import chat_data
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    prep: dict = {}
    _timed(SFTTrainer, "_prepare_dataset", prep)
    _first_step_hook(prep)
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("json", data_files=[str(data)], split="train")
    args = SFTConfig(
        output_dir=str(out / "run"),
        max_steps=1,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        optim="adamw_torch_fused",
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        assistant_only_loss=True,
        packing=True,
        packing_strategy="bfd",
        max_length=512,
    )
    trainer = SFTTrainer(
        model=chat_data.make_model(),
        args=args,
        train_dataset=ds,
        processing_class=AutoTokenizer.from_pretrained(str(tok)),
    )
    trainer.train()


def run_one(method: str, data: Path, tok: Path, out: Path, cache: Path) -> dict:
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(cache / "hf"),
        "CORELOOPER_SFT_CACHE": str(cache / "sft"),
        "TOKENIZERS_PARALLELISM": "true",
    }
    cmd = [
        sys.executable,
        __file__,
        "one",
        method,
        "--data",
        str(data),
        "--tokenizer",
        str(tok),
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if not found:
        raise SystemExit(f"{method} gave no result (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return {"method": method, **json.loads(found[-1][7:])}


def warm_up(data: Path) -> None:
    """Before a size's first timed run: the libraries' files and the data file in the page cache.
    Repetition 0 starts with corelooper's run, which otherwise alone paid a cold disk (~13 s more
    to its first step than any later run at 100k, with the same CPU time)."""
    modules = (
        "import torch, transformers, datasets, trl, accelerate, corelooper, corelooper_sft, corelooper_hf"
    )
    subprocess.run([sys.executable, "-c", modules], check=True, capture_output=True)
    with data.open("rb") as fh:
        while fh.read(1 << 24):
            pass


def bench(sizes: list[int], reps: int, work: Path, only: str | None, warm: bool = True) -> list[dict]:
    import chat_data

    tok = chat_data.write_tokenizer(work / "tokenizer")
    out = []
    for n in sizes:
        data = work / f"chats-{n}.jsonl"
        if not data.exists():
            t = time.perf_counter()
            chat_data.write_jsonl(data, n)
            print(
                f"wrote {data} ({data.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t:.0f} s",
                flush=True,
            )
        if warm:
            warm_up(data)
        for rep in range(reps):
            for method in ("cl", "trl") if rep % 2 == 0 else ("trl", "cl"):
                if only and method != only:
                    continue
                cache = Path(tempfile.mkdtemp(prefix=f"pp-{method}-", dir=work))
                runs = [run_one(method, data, tok, Path(tempfile.mkdtemp(dir=work)), cache)]
                if method == "cl":  # the second start, same data and settings: the cache
                    runs.append(
                        {
                            **run_one(method, data, tok, Path(tempfile.mkdtemp(dir=work)), cache),
                            "method": "cl (second start)",
                        }
                    )
                for r in runs:
                    r.update(conversations=n, rep=rep, mb=round(data.stat().st_size / 1e6, 1))
                    print(json.dumps(r), flush=True)
                    out.append(r)
    return out


GOAL = 2.0  # issue 28: >= 2x TRL's SFTTrainer preprocessing, as time to the first optimizer step


def summarize(rows: list[dict]) -> list[dict]:
    """Per size: TRL / corelooper per repetition (paired), medians, 95% intervals, verdicts."""
    import statistics

    from run_bench import median_ci95, verdict

    out = []
    for n in sorted({r["conversations"] for r in rows}):
        by = {(r["method"], r["rep"]): r for r in rows if r["conversations"] == n}
        reps = sorted({rep for m, rep in by if ("cl", rep) in by and ("trl", rep) in by})
        row: dict = {"conversations": n, "reps": len(reps)}
        for key in ("to_first_step_s", "cpu_to_first_step_s", "prepare_s", "prepare_cpu_s", "peak_rss_mb"):
            ratios = [by[("trl", k)][key] / by[("cl", k)][key] for k in reps if by[("cl", k)][key]]
            med = round(statistics.median(ratios), 3) if ratios else None
            row[key] = {
                "trl_over_cl": med,
                "ci95": median_ci95(ratios),
                "per_rep": [round(x, 3) for x in ratios],
            }
            if key in ("to_first_step_s", "cpu_to_first_step_s"):
                row[key]["verdict"] = verdict(med, GOAL, row[key]["ci95"])
        second = [
            by[("cl (second start)", k)]["prepare_cpu_s"] / by[("cl", k)]["prepare_cpu_s"]
            for k in reps
            if ("cl (second start)", k) in by
        ]
        row["second_start_prepare_share"] = round(statistics.median(second), 4) if second else None
        out.append(row)
        for key in ("to_first_step_s", "cpu_to_first_step_s"):
            r = row[key]
            print(
                f"goal ({n} conversations, TRL / corelooper, {key}): {r['trl_over_cl']}x "
                f"(95% interval {r['ci95']}, {len(reps)} reps) vs >= {GOAL}x: {r['verdict']}",
                flush=True,
            )
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        ap = argparse.ArgumentParser()
        ap.add_argument("one")
        ap.add_argument("method", choices=["cl", "trl"])
        ap.add_argument("--data", type=Path, required=True)
        ap.add_argument("--tokenizer", type=Path, required=True)
        ap.add_argument("--out", type=Path, required=True)
        a = ap.parse_args()
        (one_cl if a.method == "cl" else one_trl)(a.data, a.tokenizer, a.out)
        raise SystemExit("no optimizer step was taken")
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "cl-preprocess")
    ap.add_argument("--only", choices=["cl", "trl"], default=None)
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "preprocess.json")
    ap.add_argument(
        "--no-warm-up",
        action="store_true",
        help="skip warm_up's untimed start (the test suite's smoke: one process less; the first "
        "run's times then include a cold disk, so no figures)",
    )
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    rows = bench(a.sizes, a.reps, a.work, a.only, warm=not a.no_warm_up)
    res = a.out
    res.write_text(
        json.dumps(
            dict(
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command=" ".join(sys.argv),
                uname=os.uname().nodename,
                runs=rows,
                summary=summarize(rows),
            ),
            indent=1,
        )
    )
    print(f"wrote {res}")


if __name__ == "__main__":
    main()
