"""Where an SFT row's time goes: torch.profiler over the framework call, self CPU time by kind of op.

usage: python profile_split.py [METHOD ...] [--samples 256] [--threads 1] [--out results/sft_profile_split.json]
(default methods: cl_padding_free cl_padding_free_all raw_padding_free trl_grouped hf_grouped)

Each method runs in its own process (``run_one.py METHOD --torch-profile FILE``). The split:

- ``lm_head``: matmuls with the vocabulary as one dimension (the output layer, forward and backward);
- ``linear``: every other matmul (attention projections, MLP);
- ``attention``: scaled-dot-product attention kernels and their backward, and the ops that build
  masks (comparisons, ``masked_fill``, ``tril``);
- ``loss``: (log-)softmax, cross-entropy, NLL and TRL's chunked log-prob tiles' non-matmul ops;
- ``optimizer``: the AdamW kernels (fused or for-each) and the gradient norm for clipping;
- ``elementwise``: norms, activations, residual adds, embeddings, RoPE;
- ``memory``: copies, fills and zeroing, cat/index/gather/split and view-like ops (padding, packing,
  the trained-positions gather, gradient zeroing);
- ``python``: the call's wall time not covered by any op's self time on the main thread
  (framework, collation, data preparation, the Python side of autograd).

Self times are exclusive, so the kinds add up to the ops' total; shares are of the call's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = ["cl_padding_free", "cl_padding_free_all", "raw_padding_free", "trl_grouped", "hf_grouped"]
KINDS = ("lm_head", "linear", "attention", "loss", "optimizer", "elementwise", "memory", "other")
ATTENTION = ("scaled_dot_product", "sdpa", "efficient_attention", "flash_attention")
MASK_OPS = {
    "masked_fill",
    "tril",
    "triu",
    "logical_and",
    "logical_or",
    "bitwise_and",
    "bitwise_or",
    "eq",
    "ge",
    "le",
    "lt",
    "gt",
    "ne",
    "arange",
}
LOSS = ("cross_entropy", "nll_loss", "log_softmax", "softmax", "logsumexp", "_log_softmax")
OPTIM = ("adam", "_foreach_", "lerp", "addcdiv", "addcmul", "linalg_vector_norm", "clamp")
ELEMENTWISE = (
    "rms_norm",
    "layer_norm",
    "pow",
    "rsqrt",
    "mean",
    "silu",
    "gelu",
    "mul",
    "add",
    "sub",
    "div",
    "neg",
    "embedding",
    "sigmoid",
    "sum",
    "where",
    "sqrt",
    "exp",
    "cos",
    "sin",
    "threshold",
)
MEMORY = {
    "copy",
    "cat",
    "index",
    "index_select",
    "index_put_impl",
    "gather",
    "split",
    "split_with_sizes",
    "slice",
    "select",
    "view",
    "unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "contiguous",
    "as_strided",
    "expand",
    "clone",
    "to",
    "to_copy",
    "empty",
    "empty_strided",
    "zeros",
    "zero",
    "fill",
    "stack",
    "pad",
    "constant_pad_nd",
    "unbind",
    "narrow",
    "squeeze",
    "unsqueeze",
    "t",
    "nonzero",
    "masked_select",
    "scatter",
    "flatten",
    "repeat",
    "new_empty",
    "new_zeros",
    "ones",
    "full",
    "detach",
    "alias",
    "resize",
    "chunk",
    "lift_fresh",
    "set",
    "item",
    "local_scalar_dense",
    "embedding_dense_backward_copy",
}


def kind(name: str, shapes: list, vocab: int) -> str:
    op = name.split("::")[-1].lower()
    if op in ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm", "addmm_", "_addmm_activation"):
        dims = [d for s in shapes if isinstance(s, (list, tuple)) for d in s]
        return "lm_head" if vocab in dims else "linear"
    bare = op.strip("_")
    if bare in MASK_OPS or any(key in op for key in ATTENTION):
        return "attention"
    for k, keys in (("loss", LOSS), ("optimizer", OPTIM)):
        if any(key in op for key in keys):
            return k
    if bare in MEMORY:
        return "memory"
    if any(key in op for key in ELEMENTWISE):
        return "elementwise"
    return "other"


def split(events: list[dict], wall_s: float, vocab: int) -> dict:
    """Seconds and shares of ``wall_s`` per kind, from the profile's op events (self CPU time)."""
    seconds = dict.fromkeys(KINDS, 0.0)
    for e in events:
        seconds[kind(e["name"], e.get("shapes") or [], vocab)] += e["self_cpu_us"] / 1e6
    ops = sum(seconds.values())
    seconds["python"] = max(0.0, wall_s - ops)
    return {k: {"s": round(v, 3), "share": round(v / wall_s, 4)} for k, v in seconds.items()}


def profile_events(prof) -> list[dict]:
    """Op events with their input shapes and self CPU time (grouped by name and shapes)."""
    out = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.self_cpu_time_total <= 0 or not e.key.startswith(("aten::", "trl", "_")):
            continue
        out.append(
            {"name": e.key, "shapes": e.input_shapes, "self_cpu_us": e.self_cpu_time_total, "count": e.count}
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("methods", nargs="*", default=DEFAULT)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "sft_profile_split.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import common as C

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in a.methods:
            prof = Path(tmp) / f"{method}.json"
            cmd = [
                sys.executable,
                str(HERE / "run_one.py"),
                method,
                "--samples",
                str(a.samples),
                "--threads",
                str(a.threads),
                "--torch-profile",
                str(prof),
            ]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
            )
            if proc.returncode != 0 or not prof.exists():
                print(f"{method}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            rec = json.loads(proc.stdout.strip().splitlines()[-1])
            data = json.loads(prof.read_text())
            rows[method] = {
                "wall_s": data["wall_s"],
                "trained_tok_per_s": rec.get("trained_tok_per_s"),
                "positions_computed": rec.get("positions_computed"),
                "split": split(data["events"], data["wall_s"], C.VOCAB),
            }
    print(f"{'method':24s} {'wall s':>7s} " + " ".join(f"{k:>11s}" for k in (*KINDS, "python")))
    for m, r in rows.items():
        print(
            f"{m:24s} {r['wall_s']:7.2f} "
            + " ".join(f"{r['split'][k]['share'] * 100:10.1f}%" for k in (*KINDS, "python"))
        )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            {"samples": a.samples, "threads": a.threads, "load": os.getloadavg()[0], "rows": rows}, indent=1
        )
    )


if __name__ == "__main__":
    main()
