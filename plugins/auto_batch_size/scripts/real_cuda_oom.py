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
import json
import tempfile

import torch
from torch import nn

from corelooper import Loop
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


def run(out: str, batch: int, ga: int, auto: bool, samples: list) -> tuple[Loop, dict]:
    torch.manual_seed(0)
    train = dict(output_dir=out, save_strategy="no", logging_steps=1, max_steps=3, seed=0,
                 per_device_train_batch_size=batch, gradient_accumulation_steps=ga,
                 auto_find_batch_size=auto, learning_rate=1e-4, disable_tqdm=True)
    loop = Loop(Wide(), Config.from_dict({"train": train}), train_dataset=samples)
    loop.train()
    weights = {k: v.detach().float().cpu() for k, v in loop.backend.unwrap_model(loop.model).state_dict().items()}
    return loop, weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--free-gib", type=float, default=3.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    samples = data(64 * 3)
    free, total = torch.cuda.mem_get_info()
    ballast = torch.empty(int(free - args.free_gib * 2**30), dtype=torch.uint8, device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        auto, w_auto = run(f"{tmp}/auto", 64, 1, True, samples)
        size = auto.state.micro_batch_size
        torch.cuda.empty_cache()
        ref, w_ref = run(f"{tmp}/ref", size, 64 // size, False, samples)
    del ballast
    diff = max((w_auto[k] - w_ref[k]).abs().max().item() for k in w_auto)
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(), "total_gib": round(total / 2**30, 1),
        "free_gib_left": args.free_gib, "configured": "64 x 1", "found_micro_batch_size": size,
        "shrinks": [h for h in auto.state.log_history if "train_micro_batch_size" in h],
        "steps_auto": auto.state.global_step, "steps_ref": ref.state.global_step,
        "max_weight_diff_vs_ref": diff,
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }))


if __name__ == "__main__":
    main()
