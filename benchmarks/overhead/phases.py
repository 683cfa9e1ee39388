"""Where corelooper's train() spends its fixed time (workload A, as corelooper_.py runs it).

usage: python phases.py [--reps N]

Each repetition is a fresh process (first calls are part of the cost, as in run_bench.py) that
wraps the parts of ``Loop.train`` that the hand-written loop does not do with perf_counter
timers and prints one JSON line; the driver prints the median milliseconds of each part. The
timers add ~1 µs per call: the per-step ones (``guard.poll``) are left out for that reason.
"""

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child():
    import functools
    import tempfile

    sys.path.insert(0, HERE)
    import common as C

    C.preload_torch()
    import corelooper.checkpoints.checkpoint as ck
    import corelooper.config as cf
    import corelooper.loop as lp
    import corelooper.checkpoints.loop_side as lc
    import corelooper.checkpoints.lock as lk
    import corelooper.checkpoints.run_dir as od
    from corelooper import Loop
    from corelooper.config import Config

    C.setup_threads("A")
    spent = {}

    def wrap(owner, name):
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

        setattr(owner, name, timed)

    for owner, name in [
        (lp, "set_seed"),
        (lp.Loop, "_setup_train"),
        (lk.RunLock, "acquire"),
        (ck, "prepare_output_dir"),
        (cf.Config, "write"),
        (lp.Loop, "log"),
        (lc, "finish"),
        (ck, "check_finite"),
        (ck, "save_weights"),
        (ck, "_fsync_files"),
        (ck, "_fsync_dir"),
        (lk.RunLock, "release"),
        (od, "_clear_debris"),
    ]:
        wrap(owner, name)
    cfg = C.WORKLOADS["A"]
    config = Config.from_dict(
        {
            "train": dict(
                output_dir=tempfile.mkdtemp(prefix="cl_phases_"),
                max_steps=cfg["steps"],
                per_device_train_batch_size=cfg["batch_size"],
                learning_rate=C.LR,
                weight_decay=C.WEIGHT_DECAY,
                lr_scheduler_type="linear",
                warmup_steps=0,
                max_grad_norm=C.MAX_GRAD_NORM,
                logging_steps=cfg["log_every"],
                save_strategy="no",
                eval_strategy="no",
                seed=C.SEED,
                disable_tqdm=True,
                use_cpu=True,
                optim="adamw_torch_fused",
            )
        }
    )
    loop = Loop(C.make_model("A"), config, train_dataset=C.make_dataset("A"))
    t = time.perf_counter()
    loop.train()
    spent["train (all)"] = time.perf_counter() - t
    print(json.dumps({k: round(v * 1e3, 3) for k, v in spent.items()}), file=sys.__stderr__)


def main():
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 7
    runs = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, cwd=HERE)
        runs.append(json.loads(out.stderr.strip().splitlines()[-1]))
    print(
        f"{'part of train()':24s} {'median ms':>9s}  [min-max]   ({reps} fresh processes, load {os.getloadavg()[0]:.2f})"
    )
    for key in runs[0]:
        xs = [r[key] for r in runs]
        print(f"{key:24s} {statistics.median(xs):9.2f}  [{min(xs):.2f}-{max(xs):.2f}]")
    print(
        "nested: prepare_output_dir holds write and _clear_debris; finish holds check_finite, "
        "save_weights and the fsyncs"
    )


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
