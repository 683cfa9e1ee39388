"""Scaling from 1 to 2 processes on CPU (gloo): corelooper's DDP, FSDP2, ZeRO-2 and ZeRO-3
backends, and a hand-written torch DDP loop on the same workload for a ratio.

usage: python benchmarks/scaling.py [--steps 30] [--warmup 5] [--repeats 2] [--only ddp,fsdp,...]

Workload: a causal MLP LM (vocab 512, dim 128, 2 residual blocks, seq 64), per-process
batch 8 (weak scaling: the global batch grows with the processes), AdamW, no eval/checkpoints.
Each configuration runs under ``torch.distributed.run``; rank 0 times steps warmup..steps
(after the first steps' lazy imports and allocations). 1 process runs with 1 and with 2 threads,
2 processes with 1 thread each (this machine has 2 cores). Prints a table and writes
benchmarks/results/scaling.json. Interleaved repeats; the median is reported.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VOCAB, DIM, BLOCKS, SEQ, BATCH = 512, 128, 2, 64, 8
SECTIONS = {
    "ddp": {},
    "fsdp": {"fsdp": {"wrap": ["Block"]}},
    "zero2": {"deepspeed": {"zero_stage": 2}},
    "zero3": {"deepspeed": {"zero_stage": 3}},
}


def build_model():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
            self.norm = nn.LayerNorm(DIM)

        def forward(self, h):
            return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, input_ids):
            h = self.embed(input_ids)
            h = h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[None, :, None]
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    torch.manual_seed(0)
    return LM()


def dataset(n: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def worker_corelooper(kind: str, steps: int, warmup: int) -> float:
    """Samples/s (global) of corelooper with backend ``kind`` in this torchrun job."""
    from corelooper.config import Config
    from corelooper.loop import Loop

    world = int(os.environ.get("WORLD_SIZE", 1))
    marks = {}

    class Timer:
        name = "timer"

        def on_step_end(self, state):
            if state.global_step in (warmup, steps):
                marks[state.global_step] = time.perf_counter()

    out = tempfile.mkdtemp()
    cfg = Config.from_dict(
        {
            "train": {
                "output_dir": out,
                "max_steps": steps,
                "per_device_train_batch_size": BATCH,
                "save_strategy": "no",
                "eval_strategy": "no",
                "logging_steps": 10**6,
                "disable_tqdm": True,
                "max_grad_norm": 1.0,
                "learning_rate": 1e-3,
            },
            "plugins": {"disable": ["console", "jsonl", "tensorboard", "wandb"]},
            **SECTIONS[kind],
        }
    )
    loop = Loop(build_model(), cfg, train_dataset=dataset(BATCH * world * (steps + 1)), plugins=[Timer()])
    loop.train()
    return BATCH * world * (steps - warmup) / (marks[steps] - marks[warmup])


def worker_raw(steps: int, warmup: int) -> float:
    """The same workload as a hand-written DDP loop (DistributedSampler-free slicing)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = dataset(BATCH * world * (steps + 1))
    ids = torch.stack([d["input_ids"] for d in data])
    for step in range(1, steps + 1):
        if step == warmup + 1:
            start = time.perf_counter()
        batch = ids[(step - 1) * BATCH * world :][rank * BATCH : (rank + 1) * BATCH]
        logits = model(batch)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rate = BATCH * world * (steps - warmup) / (time.perf_counter() - start)
    dist.destroy_process_group()
    return rate


def run_config(kind: str, nproc: int, threads: int, steps: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rate.json"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "TMPDIR": tmp,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            __file__,
            "--worker",
            kind,
            str(steps),
            str(warmup),
            str(result),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"{kind} x{nproc} failed:\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())["samples_per_second"]


def main() -> None:
    args = sys.argv[1:]
    opt = {k: v for k, v in zip(args[::2], args[1::2], strict=False)}
    steps, warmup = int(opt.get("--steps", 30)), int(opt.get("--warmup", 5))
    repeats = int(opt.get("--repeats", 2))
    kinds = opt.get("--only", "raw,ddp,fsdp,zero2,zero3").split(",")
    layouts = [(1, 1), (1, 2), (2, 1)]  # (processes, threads per process)
    rates: dict[str, list[float]] = {}
    for _ in range(repeats):  # interleaved: machine noise hits every configuration alike
        for kind in kinds:
            for nproc, threads in layouts:
                key = f"{kind} {nproc}p x {threads}t"
                rates.setdefault(key, []).append(run_config(kind, nproc, threads, steps, warmup))
                print(f"{key}: {rates[key][-1]:.1f} samples/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"\nworkload: LM dim {DIM}, {BLOCKS} blocks, seq {SEQ}, batch {BATCH}/process, "
        f"steps {warmup}..{steps}, median of {repeats}"
    )
    print(
        "| backend | 1 proc x 1 thread | 1 proc x 2 threads | 2 procs x 1 thread | 2p / 1p(1t) | 2p / 1p(2t) | vs raw DDP (2p) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in kinds:
        a, b, c = (med[f"{kind} {n}p x {t}t"] for n, t in layouts)
        raw = med.get("raw 2p x 1t")
        vs_raw = f"{c / raw:.2f}" if raw else "-"
        print(f"| {kind} | {a:.1f} | {b:.1f} | {c:.1f} | {c / a:.2f} | {c / b:.2f} | {vs_raw} |")
    out = HERE / "results" / "scaling.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps({"samples_per_second": rates, "median": med, "steps": steps, "warmup": warmup}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, steps, warmup, result = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        rate = worker_raw(steps, warmup) if kind == "raw" else worker_corelooper(kind, steps, warmup)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(result).write_text(json.dumps({"samples_per_second": rate}))
    else:
        main()
