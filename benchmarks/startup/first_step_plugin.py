"""Prints the wall-clock time of the first optimizer step, then ends the process."""

import os
import time


def on_optimizer_step():
    print(f"FIRST_STEP {time.time():.6f}", flush=True)
    os._exit(0)
