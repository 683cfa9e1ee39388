"""corelooper on the shared workload.

usage: python corelooper_.py A|B [--plugins5] [--ga8] [--log1]
  --plugins5  register 5 no-op event plugins (on_step_begin/end, on_before/after_backward, on_log)
  --ga8       8 micro-batches of batch/8 per optimizer step (same samples per step)
  --log1      logging_steps=1 (a loss read-out, i.e. a host sync, every step)
  --adamw     optim="adamw_torch" (raw's optimizer) instead of the default adamw_torch_fused
Console output and plugin autoload are off so the run measures the loop, not the terminal.
"""
import os
import time

T0 = time.perf_counter()
import common as C  # noqa: E402

workload, flags = C.parse_args()
os.environ.setdefault("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
torch = C.preload_torch()
from corelooper import Loop  # noqa: E402
from corelooper.config import Config  # noqa: E402

if workload == "B":
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401,E402
t_import = time.perf_counter() - T0

import shutil  # noqa: E402
import tempfile  # noqa: E402

C.setup_threads(workload)
T1 = time.perf_counter()
cfg = C.WORKLOADS[workload]
steps, bs, log_every = cfg["steps"], cfg["batch_size"], cfg["log_every"]
ga = 8 if "--ga8" in flags else 1
model = C.make_model(workload)
probe = C.Probe().attach(model)
ds = C.make_dataset(workload)
outdir = tempfile.mkdtemp(prefix="cl_bench_")


class NoOp:
    def __init__(self, i):
        self.name = f"noop{i}"

    def on_step_begin(self, state):
        pass

    def on_step_end(self, state):
        pass

    def on_before_backward(self, loss):
        pass

    def on_after_backward(self, loss):
        pass

    def on_log(self, logs):
        pass


plugins = [NoOp(i) for i in range(5)] if "--plugins5" in flags else []
config = Config.from_dict({
    "train": dict(
        output_dir=outdir, max_steps=steps, per_device_train_batch_size=bs // ga,
        gradient_accumulation_steps=ga, learning_rate=C.LR, weight_decay=C.WEIGHT_DECAY,
        lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=C.MAX_GRAD_NORM,
        logging_steps=1 if "--log1" in flags else log_every, save_strategy="no",
        eval_strategy="no", seed=C.SEED, disable_tqdm=True, use_cpu=True,
        optim="adamw_torch" if "--adamw" in flags else "adamw_torch_fused",
    ),
})
loop = Loop(model, config, train_dataset=ds, plugins=plugins, blocked_plugins=["console"])
t_setup = time.perf_counter() - T1

T2 = time.perf_counter()
loop.train()
T3 = time.perf_counter()

losses = [e["loss"] for e in loop.state.log_history if "loss" in e][:-1]
if "--log1" in flags:
    losses = losses[log_every - 1::log_every]
shutil.rmtree(outdir, ignore_errors=True)
variant = "+".join(sorted(f.lstrip("-") for f in flags)) or "default"
# GA: n_fwd counts micro-batches; report per-step equivalents so the same-work check holds.
if ga > 1:
    probe.n_fwd //= ga
C.emit("corelooper", workload, variant, t_import, t_setup, T2, T3, probe, losses,
       extra=dict(global_step=loop.state.global_step))
