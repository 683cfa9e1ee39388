"""One rank of a 2-process run of the same script under ``transformers.Trainer`` or
``corelooper_hf.Trainer`` (``argv``: hf|cl, output folder): writes what the test compares."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trainer_dropin import Recorder, args_for, lm_rows, tiny_llama, weighted_loss  # noqa: E402

# The typical job's sharded backends, as HF's TrainingArguments name them.
SHARDING = {
    "ddp": {},
    "zero3": {
        "deepspeed": {
            "zero_optimization": {"stage": 3},
            "gradient_clipping": 0.5,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
        }
    },
    "fsdp2": {"fsdp": "full_shard", "fsdp_config": {"version": 2}},
}


def main(which: str, out: str, sharding: str = "ddp") -> None:
    from corelooper_hf import Trainer
    from transformers import Trainer as HFTrainer

    base = HFTrainer if which == "hf" else Trainer
    args = args_for(
        out,
        remove_unused_columns=False,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        max_steps=6,
        **SHARDING[sharding],
    )
    recorder = Recorder()
    trainer = weighted_loss(base)(
        callbacks=[recorder],
        model=tiny_llama(seed=1),
        args=args,
        train_dataset=lm_rows(32, seed=5, difficulty=True),
        eval_dataset=lm_rows(10, seed=6, difficulty=True),
    )
    result = trainer.train()
    rank = int(os.environ.get("RANK", 0))
    params = {  # FSDP2 holds DTensor shards: the whole tensor (a collective) on every rank
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().sum().item()
        for n, p in trainer.model.named_parameters()
    }
    Path(out, f"result.rank{rank}.json").write_text(
        json.dumps(
            {
                "log_history": trainer.state.log_history,
                "params": params,
                "step": trainer.state.global_step,
                "train_output": [result.global_step, result.training_loss],
                "events": recorder.events,
            }
        )
    )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
