"""corelooper-doctor: non-finite values, loss spikes, out-of-memory, hangs and slow steps,
diagnosed where they happen, and ``corelooper doctor RUN_DIR`` afterwards.

On by default once installed (``[doctor] enabled = false`` turns it off); cheap when nothing is
wrong: no host-device sync per step, nothing but one clock read and a few counters per event
on healthy steps. This
module must not import torch: ``corelooper --help`` imports every installed plugin.
"""

from __future__ import annotations

from .settings import DEFAULTS, SECTION

__version__ = "0.2.0"

#: Name of the per-run object (and its key in a checkpoint's plugins.json).
RUN_PLUGIN_NAME = "doctor.run"


def corelooper_config_sections():
    return {SECTION: dict(DEFAULTS)}


def inactive_reason(config) -> str | None:
    if not config.section(SECTION).get("enabled", True):
        return "[doctor] enabled = false"
    return None


def corelooper_configure(config, plugins) -> None:
    """One fresh ``Doctor`` per run (the new per-run lifecycle)."""
    reason = inactive_reason(config)
    if reason:
        plugins.set_inactive(SECTION, reason)
        return
    from .run import Doctor  # imports torch lazily inside its methods

    doctor = Doctor(config)
    plugins.register(doctor, RUN_PLUGIN_NAME)
    for name, hooks in doctor.hook_objects().items():  # per-step hooks only for what is on
        plugins.register(hooks, name)
    plugins.register_for_checkpointing(SECTION, doctor)  # the skipped batches (on_spike)


def corelooper_add_commands(app) -> None:
    from .cli import add_commands

    add_commands(app)
