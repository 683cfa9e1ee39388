"""A REAL CUDA out-of-memory case for corelooper-auto-batch-size (needs one CUDA GPU; ~1 minute).

    python plugins/auto_batch_size/scripts/real_cuda_oom.py [--free-gib 3]

A ballast tensor leaves only ``--free-gib`` of GPU memory free; an MLP over (1024 x 1024)
samples needs ~100 MB of activations per sample, so the configured micro-batch of 64 runs out
of memory for real. The run with ``auto_find_batch_size = true`` must find a smaller size, keep
the step count, and end with the weights of a run configured with that size and the matching
accumulation from the start. Prints one JSON line with the numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile

import torch
from torch import nn

from corelooper import Loop, hookimpl
from corelooper.config import Config


class Wide(nn.Module):
    def __init__(self, dim: int = 1024, hidden: int = 8192):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def data(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1024, 1024, generator=g)
    return [{"x": x[i], "labels": x[i].flip(-1)} for i in range(n)]


def run(out: str, batch: int, ga: int, auto: bool, samples: list, extra=None) -> tuple[Loop, dict]:
    torch.manual_seed(0)
    train = dict(
        output_dir=out,
        save_strategy="no",
        logging_steps=1,
        max_steps=3,
        seed=0,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga,
        auto_find_batch_size=auto,
        learning_rate=1e-4,
        disable_tqdm=True,
    )
    loop = Loop(Wide(), Config.from_dict({"train": train}), train_dataset=samples)
    if extra is not None:
        loop.plugins.register(extra, "real_cuda_oom.memory")
    loop.train()
    weights = {
        k: v.detach().float().cpu() for k, v in loop.backend.unwrap_model(loop.model).state_dict().items()
    }
    return loop, weights


class MemoryAtShrink:
    """Records the device memory each time the run logs a smaller micro-batch (a plugin object)."""

    def __init__(self, ballast_bytes: int) -> None:
        self.ballast, self.seen = ballast_bytes, []

    @hookimpl
    def on_log(self, loop, logs: dict) -> None:
        if "train_micro_batch_size" in logs:
            self.seen.append(
                {
                    "new_size": logs["train_micro_batch_size"],
                    "free_gib": gib(torch.cuda.mem_get_info()[0]),
                    "allocated_beyond_ballast_gib": gib(torch.cuda.memory_allocated() - self.ballast),
                }
            )


def gib(n: int) -> float:
    return round(n / 2**30, 3)


def configured(out: str, size: int, samples: list, ballast_bytes: int) -> tuple[dict, dict | None]:
    """A run configured with ``size`` x ``64 // size`` accumulation from the start: whether it
    fits, its peak beyond the ballast, and its weights (None when it ran out of memory)."""
    gc.collect()  # a Loop's plugins refer back to it: the last run is freed by the collector
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        loop, weights = run(out, size, 64 // size, False, samples)
    except Exception as e:  # noqa: BLE001 — an OOM is the answer
        return {
            "size": size,
            "fits": False,
            "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
        }, None
    info = {
        "size": size,
        "fits": True,
        "steps": loop.state.global_step,
        "peak_beyond_ballast_gib": gib(torch.cuda.max_memory_allocated() - ballast_bytes),
    }
    return info, weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--free-gib", type=float, default=3.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    samples = data(64 * 3)
    free, total = torch.cuda.mem_get_info()
    ballast = torch.empty(int(free - args.free_gib * 2**30), dtype=torch.uint8, device="cuda")
    memory = MemoryAtShrink(ballast.numel())
    with tempfile.TemporaryDirectory() as tmp:
        auto, w_auto = run(f"{tmp}/auto", 64, 1, True, samples, extra=memory)
        shrinks = [h for h in auto.state.log_history if "train_micro_batch_size" in h]
        size = shrinks[-1]["train_micro_batch_size"] if shrinks else 64  # the size it settled on
        steps_auto = auto.state.global_step
        del auto  # its model, gradients and optimizer state: the reference run needs that memory
        ref, w_ref = configured(f"{tmp}/ref", size, samples, ballast.numel())
        # would a larger size have fitted? (did auto_find_batch_size halve once too often)
        larger = [
            configured(f"{tmp}/x{n}", n, samples, ballast.numel())[0] for n in (size * 2, size * 4) if n <= 64
        ]
    del ballast
    result = {
        "gpu": torch.cuda.get_device_name(),
        "total_gib": round(total / 2**30, 1),
        "free_gib_left": args.free_gib,
        "configured": "64 x 1",
        "found_micro_batch_size": size,
        "shrinks": shrinks,
        "memory_at_each_shrink": memory.seen,
        "steps_auto": steps_auto,
        "reference_run": ref,
        "larger_sizes_configured": larger,
    }
    if w_ref is None:  # printed all the same: the numbers say what happened
        result["error"] = f"the run configured with the found size ({size} x {64 // size}) ran out of memory"
    else:
        result["max_weight_diff_vs_ref"] = max((w_auto[k] - w_ref[k]).abs().max().item() for k in w_auto)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
