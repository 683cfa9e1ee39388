"""corelooper on the shared workload.

usage: python corelooper_.py A|B [--plugins5 | --pluginsN] [--ga8] [--log1] [--adamw] [--lean]
  --pluginsN  register N no-op event plugins (on_step_begin/end, on_before/after_backward, on_log)
  --ga8       8 micro-batches of batch/8 per optimizer step (same samples per step)
  --log1      logging_steps=1 (a loss read-out, i.e. a host sync, every step)
  --adamw     optim="adamw_torch" (raw's optimizer) instead of the default adamw_torch_fused
  --lean      plugin autoload off and the console plugin blocked (what the benchmark measured
              before 2026-12: not what a user gets; kept to show what the default plugins cost)
By default corelooper runs as a user gets it: every installed plugin autoloaded (whatever
`scripts/setup` / `benchmarks/setup` installed, e.g. corelooper-tensorboard), the console on,
stdout redirected to a file by the driver (not a tty).
"""

import os
import time

T0 = time.perf_counter()
import common as C  # noqa: E402

workload, flags = C.parse_args()
if "--lean" in flags:
    os.environ["CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"] = "1"
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


n_noop = next((int(f[len("--plugins") :]) for f in flags if f.startswith("--plugins")), 0)
plugins = [NoOp(i) for i in range(n_noop)]
config = Config.from_dict(
    {
        "train": dict(
            output_dir=outdir,
            max_steps=steps,
            per_device_train_batch_size=bs // ga,
            gradient_accumulation_steps=ga,
            learning_rate=C.LR,
            weight_decay=C.WEIGHT_DECAY,
            lr_scheduler_type="linear",
            warmup_steps=0,
            max_grad_norm=C.MAX_GRAD_NORM,
            logging_steps=1 if "--log1" in flags else log_every,
            save_strategy="no",
            eval_strategy="no",
            seed=C.SEED,
            disable_tqdm=True,
            use_cpu=True,
            optim="adamw_torch" if "--adamw" in flags else "adamw_torch_fused",
        ),
    }
)
loop = Loop(
    model, config, train_dataset=ds, plugins=plugins, blocked_plugins=["console"] if "--lean" in flags else ()
)
t_setup = time.perf_counter() - T1

T2 = time.perf_counter()
loop.train()
T3 = time.perf_counter()

losses = [e["loss"] for e in loop.state.log_history if "loss" in e][:-1]
if "--log1" in flags:
    losses = losses[log_every - 1 :: log_every]
shutil.rmtree(outdir, ignore_errors=True)
variant = "+".join(sorted(f.lstrip("-") for f in flags)) or "default"
# GA: n_fwd counts micro-batches; report per-step equivalents so the same-work check holds.
if ga > 1:
    probe.n_fwd //= ga
C.emit(
    "corelooper",
    workload,
    variant,
    t_import,
    t_setup,
    T2,
    T3,
    probe,
    losses,
    extra=dict(global_step=loop.state.global_step),
)
