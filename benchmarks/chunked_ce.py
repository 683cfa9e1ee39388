"""Peak memory of the loss: full-logits cross-entropy vs ``corelooper_lm.chunked_ce`` (issue 19).

Each measurement runs in its own subprocess: build ``hidden [tokens, H]`` and ``lm_head.weight
[vocab, H]`` (float32, requires_grad), then forward + backward of the summed loss. The figure is
the rise of the process's peak RSS (``ru_maxrss``) over the peak after the inputs exist, i.e.
what the loss itself needs (its logits, softmax, gradients). On CPU, torch's large tensors come
from ``mmap`` and return to the OS when freed, so the peak RSS follows torch's allocations.
The losses (and gradient norms) of both ways are printed too: they must agree.

    .venv/bin/python benchmarks/chunked_ce.py                     # vocab 128k, 8k tokens (needs ~14 GiB free)
    .venv/bin/python benchmarks/chunked_ce.py --tokens 2048       # a smaller run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(impl: str, tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from corelooper_lm.chunked_ce import chunked_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    y[::7] = -100
    # Touch what the gradients will need anyway (.grad of h and w), so only the loss's own memory counts.
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if impl == "full":
        loss = F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100, reduction="sum")
    else:
        loss = chunked_cross_entropy(h, w, y, chunk_tokens=chunk or None)
    (loss / (y != -100).sum()).backward()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "impl": impl,
        "peak_mib": (after - before) / 1024,
        "seconds": round(seconds, 2),
        "loss": loss.item(),
        "grad_w_norm": w.grad.norm().item(),
        "grad_h_norm": h.grad.norm().item(),
    }


def measure(impl: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        impl,
        "--tokens",
        str(args.tokens),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--chunk",
        str(args.chunk),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128_256)  # Llama 3's vocabulary
    ap.add_argument("--hidden", type=int, default=128)  # small: the logits dominate either way
    ap.add_argument(
        "--chunk", type=int, default=0, help="tokens per chunk (0: the default, ~256 MiB of logits)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=["full", "chunked"])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "chunked_ce.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.hidden, args.chunk)))
        return
    rows = [measure("chunked", args), measure("full", args)]
    full, chunked = rows[1], rows[0]
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(
        f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk} "
        f"(one float32 logits tensor: {logits_mib:.0f} MiB)"
    )
    print("| loss | peak MiB (loss fwd+bwd) | seconds | loss value | grad_w norm |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['impl']} | {r['peak_mib']:.0f} | {r['seconds']} | {r['loss']:.4f} | {r['grad_w_norm']:.6g} |"
        )
    ratio = full["peak_mib"] / max(chunked["peak_mib"], 1e-9)
    print(
        f"full / chunked peak memory: {ratio:.1f}x; |loss difference| "
        f"{abs(full['loss'] - chunked['loss']):.3g} (relative {abs(full['loss'] - chunked['loss']) / full['loss']:.2g})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "load_avg": os.getloadavg(),
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "chunk": args.chunk,
        "rows": rows,
        "ratio": ratio,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
