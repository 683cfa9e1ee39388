"""Two real processes (accelerate.debug_launcher, gloo on CPU) where only rank 1 hits the FAKE OOM.

``python auto_batch_two_ranks.py OUT_DIR`` runs two trainings, each in 2 processes:
``oom`` (batch 16; rank 1's model raises torch.OutOfMemoryError above 8 rows from the start
and above 4 rows after step 2; rank 0's never does), ``probe`` (the same limits, found by the start-up probe) and ``fsdp``
(a sharded model: refused at start-up), and writes
``OUT_DIR/<mode>.rank<R>.json``. Used by test_auto_batch_size.py.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(mode: str, out: str) -> None:
    import torch
    from auto_batch_toys import blobs, mlp

    from corelooper import Loop
    from corelooper.config import Config

    class Squeeze:
        name = "squeeze"

        def on_step_end(self, loop, state):
            if state.global_step == 2 and loop.backend.process_index == 1:
                loop.backend.unwrap_model(loop.model).train_limit = 4

    train = dict(
        output_dir=f"{out}/{mode}",
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        disable_tqdm=True,
        num_train_epochs=1,
        per_device_train_batch_size=16,
        seed=0,
        auto_find_batch_size=mode == "oom",
    )
    model = mlp()
    raw = {"train": train}
    if mode == "probe":  # rank 1 alone fails the start-up probe at 16: both must use 8
        raw = {
            "train": {**train, "auto_find_batch_size": True, "max_steps": 1},
            "auto_batch_size": {"probe": True},
        }
    if mode == "fsdp":  # sharded: must be refused at start-up, on every rank, without hanging
        raw = {"train": {**train, "auto_find_batch_size": True}, "fsdp": {"wrap": ["Linear"]}}
    loop = Loop(
        model, Config.from_dict(raw), train_dataset=blobs(128), plugins=[Squeeze()] if mode == "oom" else []
    )
    rank = loop.backend.process_index
    if mode == "fsdp":
        from corelooper.errors import ConfigError

        try:
            loop.train()
            error = None
        except ConfigError as e:
            error = str(e)
        Path(out, f"{mode}.rank{rank}.json").write_text(json.dumps({"error": error}))
        return
    if mode in ("oom", "probe") and rank == 1:
        model.train_limit = 8
    loop.train()
    inner = loop.backend.unwrap_model(loop.model)
    flat = torch.cat([p.detach().flatten() for p in inner.parameters()])
    result = {
        "weights": flat.tolist(),
        "ooms": inner.ooms,
        "global_step": loop.state.global_step,
        "train_batch_size": loop.state.train_batch_size,
        "gradient_accumulation_steps": loop.state.gradient_accumulation_steps,
        "micro_batch_size": loop.plugins.get("auto_batch_size.run").train_size,
        "shrinks": [
            [h["step"], h["train_micro_batch_size"]]
            for h in loop.state.log_history
            if "train_micro_batch_size" in h
        ],
        "train_sizes": inner.train_sizes(),
        "losses": [h["loss"] for h in loop.state.log_history if "loss" in h and "train_runtime" not in h],
    }
    Path(out, f"{mode}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from accelerate import debug_launcher

    from corelooper.plugins import load_plugins

    load_plugins()  # import every installed plugin once, before the processes are forked
    for mode in ("oom", "probe", "fsdp"):
        debug_launcher(partial(worker, mode, sys.argv[1]), num_processes=2)
