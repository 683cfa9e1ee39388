"""A 2-rank run whose rank 1 stops inside a hook at step 3 (the hang test's model, data, plugin)."""

from __future__ import annotations

import os
import time


def model():
    import torch
    from doctor_toys import Classifier

    return Classifier(torch.nn.ReLU())


def train():
    from doctor_toys import samples

    return samples(n=64)


def on_step_end(state):
    if os.environ.get("RANK") == "1" and state.global_step == 3:
        time.sleep(600)  # a rank stuck in a plugin: the other waits in the next collective
