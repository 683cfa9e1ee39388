"""The ``[doctor]`` section and its defaults (no torch: read by ``corelooper --help``/``plugins``)."""

SECTION = "doctor"
#: The doctor's log keys are ``doctor/<key>``: loggers and metrics.jsonl get them all, the
#: console prints namespaced keys only with ``corelooper run --verbose``.
PREFIX = "doctor/"
DEFAULTS = {
    "enabled": True,
    # non-finite values (fires with the core guard, train.on_nonfinite)
    "explain_nonfinite": True,
    "max_nonfinite_reports": 3,
    "save_weights_on_nonfinite": True,
    # loss spikes
    "spike_factor": 3.0,
    "spike_window": 20,
    "spike_per_step": False,
    "on_spike": "log",
    # memory
    "memory": True,
    "memory_history": False,
    # hangs
    "hang_timeout": 300.0,
    "hang_step_factor": 20.0,
    # slow steps
    "timing": True,
    # the share of time inside plugins' event hooks: pluggy's hook-call monitoring around every
    # hook call (a few µs each, every step), so off unless asked for
    "time_hooks": False,
    "input_bound_share": 0.3,
    # CUDA: count host-device syncs per step (torch.cuda.set_sync_debug_mode("warn"), warnings
    # counted, not shown); nothing to count on the CPU
    "count_syncs": True,
}
ON_SPIKE = ("log", "skip_batch")
#: Once the median step time is known, a step may take hang_step_factor x median, but never
#: less than this (a first evaluation or a checkpoint write must not look like a hang).
MIN_ADAPTIVE_TIMEOUT = 30.0
