"""HF Trainer equivalent: Trainer on the same model and data, stopped after its first step."""

import os
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from benchmarks.startup import workload


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = workload.model()

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class Stop(TrainerCallback):
    def on_step_end(self, *a, **k):
        print(f"FIRST_STEP {time.time():.6f}", flush=True)
        os._exit(0)


ds = workload.dataset()
items = [{"x": x, "labels": y} for x, y in ds]
args = TrainingArguments(
    output_dir="/tmp/hf-startup-bench",
    max_steps=10,
    per_device_train_batch_size=32,
    learning_rate=1e-3,
    optim="adamw_torch_fused",
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    use_cpu=True,
)
Trainer(model=Model(), args=args, train_dataset=items, callbacks=[Stop()]).train()
