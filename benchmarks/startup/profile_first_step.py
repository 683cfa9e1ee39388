"""Local plugin for benchmarks/startup_profile.py: at the first optimizer step, stop the profiler
the driver started (if any), write its stats, print the wall time, end the process."""

import os
import time

PROFILER = None  # set by benchmarks/startup_profile.py before the CLI runs
STATS_PATH = os.environ.get("CORELOOPER_BENCH_PROFILE_OUT", "")


def on_optimizer_step():
    if PROFILER is not None:
        PROFILER.disable()
        PROFILER.dump_stats(STATS_PATH)
    print(f"FIRST_STEP {time.time():.6f}", flush=True)
    os._exit(0)
