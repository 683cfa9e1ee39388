"""corelooper-tensorboard: TensorBoard event files for every corelooper run.

Active as soon as it is installed (local files, cheap): training loss, learning rate, gradient
norm, throughput and every evaluation metric, each at its ``global_step``, with HF's tag names
(``train/loss``, ``eval/accuracy``, ...), plus the resolved config as text and as hparams.
``[tensorboard] enabled = false`` or ``-p no:tensorboard`` turns it off for a project.
Only the main process writes. ``torch.utils.tensorboard`` is imported when training starts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__version__ = "0.2.0"

SECTION = "tensorboard"
DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "log_dir": "",  # empty: <output_dir>/tensorboard
    "log_hparams": True,
    "flush_secs": 120,
}


def tag(key: str) -> str:
    """HF's ``rewrite_logs``: ``eval_loss`` -> ``eval/loss``, ``test_x`` -> ``test/x``, else ``train/``."""
    for prefix in ("eval", "test"):
        if key.startswith(prefix + "_"):
            return f"{prefix}/{key[len(prefix) + 1 :]}"
    return f"train/{key}"


def scalars(values: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a logs/metrics dict, under their TensorBoard tags."""
    out = {}
    for k, v in values.items():
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[tag(k)] = float(v)
    return out


def flat_hparams(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{"train": {"learning_rate": 3e-4}}`` -> ``{"train.learning_rate": 3e-4}``; values that are not
    TensorBoard hparam types (lists, tables) become strings, unset ones are left out."""
    out: dict[str, Any] = {}
    for section, values in config.items():
        for k, v in values.items():
            if isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
                out[f"{section}.{k}"] = v
            elif v is not None:
                out[f"{section}.{k}"] = str(v)
    return out


def corelooper_config_sections() -> dict[str, dict[str, Any]]:
    return {SECTION: dict(DEFAULTS)}


def corelooper_settings() -> dict[str, Any]:
    """A logger: loaded only when train.report_to wants it (HF's report_to); HF's 4.x
    ``logging_dir`` is ``[tensorboard] log_dir``."""
    return {
        "report_to": [SECTION],
        "train": {"logging_dir": lambda value, train: {SECTION: {"log_dir": value}} if value else None},
    }


def inactive_reason(config) -> str | None:
    """Why this plugin does nothing for ``config`` (``None``: it is active)."""
    if not {**DEFAULTS, **config.sections.get(SECTION, {})}["enabled"]:
        return "[tensorboard] enabled = false"
    return None


def corelooper_configure(config, plugins) -> None:
    """One logger (one event file) for every run."""
    reason = inactive_reason(config)
    if reason:
        plugins.set_inactive(SECTION, reason)
    else:
        plugins.register(TensorBoardLogger(), f"{SECTION}.run")


class TensorBoardLogger:
    """One run's TensorBoard writer (main process only)."""

    def __init__(self) -> None:
        self.writer = None
        self.training = False

    def log_dir(self, loop) -> Path:
        configured = loop.config.section(SECTION).get("log_dir") or ""
        return Path(configured) if configured else Path(loop.args.output_dir) / "tensorboard"

    def _writer(self, loop, state, purge_step: int | None = None):
        if not state.is_world_process_zero:
            return None
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # ~1 s: only when needed

            cfg = loop.config.section(SECTION)
            self.writer = SummaryWriter(
                log_dir=str(self.log_dir(loop)),
                purge_step=purge_step,
                flush_secs=int(cfg.get("flush_secs", DEFAULTS["flush_secs"])),
            )
        return self.writer

    # -- events --------------------------------------------------------------------------------
    def on_train_begin(self, loop, state) -> None:
        # On resume, events a killed run wrote after the checkpoint's step are hidden (purge_step).
        purge = state.global_step + 1 if state.global_step > 0 else None
        self.close()
        writer = self._writer(loop, state, purge_step=purge)
        if writer is None:
            return
        self.training = True
        from corelooper.config import dumps_toml

        resolved = loop.config.to_dict()
        text = "\n".join("    " + line for line in dumps_toml(resolved).splitlines())
        writer.add_text("config", text, state.global_step)
        if loop.config.section(SECTION).get("log_hparams", True):
            self._write_hparams(writer, loop, resolved)

    def _write_hparams(self, writer, loop, resolved: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        metrics = {"train/loss": 0.0}
        if loop.args.eval_strategy != "no":
            metrics["eval/loss"] = 0.0
        # In this run's own event file (add_hparams would open a second run in a sub-folder).
        file_writer = writer._get_file_writer()
        for summary in hparams(flat_hparams(resolved), metrics):
            file_writer.add_summary(summary)

    def on_log(self, loop, state, logs) -> None:
        self._write(loop, state, logs)  # evaluation metrics too (on_log before on_evaluate, as HF)

    def on_predict(self, loop, state, metrics) -> None:
        self._write(loop, state, metrics)
        self.flush()

    def _write(self, loop, state, values: dict) -> None:
        # No flush per write: the writer flushes every flush_secs, at the end of train() and of
        # each evaluation, at each checkpoint, and closes when the Loop ends.
        writer = self._writer(loop, state)
        if writer is None:
            return
        for name, value in scalars(values).items():
            writer.add_scalar(name, value, state.global_step)

    def on_evaluate(self) -> None:
        self.flush()

    def on_save(self) -> None:
        self.flush()  # a checkpoint and the curves up to it reach the disk together

    def on_train_end(self) -> None:
        self.flush()  # also after a preemption (state.preempted)
        self.training = False

    def on_exception(self) -> None:
        self.flush()
        self.training = False

    def corelooper_unconfigure(self) -> None:
        self.close()

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        self.training = False
        if self.writer is not None:
            self.writer.close()
            self.writer = None
