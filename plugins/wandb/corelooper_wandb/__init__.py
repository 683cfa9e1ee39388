"""corelooper-wandb: Weights & Biases tracking for corelooper runs.

Active when the config has a ``[wandb]`` section, or ``WANDB_PROJECT``/``WANDB_MODE`` is set in the
environment (so installing it never sends anything to the network by surprise); ``WANDB_MODE=disabled``,
``[wandb] enabled = false`` or ``-p no:wandb`` turn it off. Only the main process talks to W&B.

The run id is kept in every checkpoint (``plugins.json``), so ``--resume-from-checkpoint`` continues
the same W&B run. Metrics are plotted against ``train/global_step`` (``define_metric``), with HF's
names (``train/loss``, ``eval/accuracy``); the end-of-training figures go to the run summary.
"""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path
from typing import Any

__version__ = "0.2.0"

SECTION = "wandb"
DEFAULTS: dict[str, Any] = {
    "enabled": True,
    "project": "",  # default: WANDB_PROJECT, else "corelooper"
    "entity": "",  # default: WANDB_ENTITY / your default entity
    "name": "",  # default: train.run_name
    "tags": [],
    "group": "",
    "notes": "",
    "job_type": "",
    "mode": "",  # online | offline | disabled; default: WANDB_MODE, else online
    "dir": "",  # default: WANDB_DIR, else train.output_dir
}
STEP = "train/global_step"
# Figures of the whole run (HF's single-value scalars): to the summary, not to the charts.
SUMMARY_KEYS = (
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "train_loss",
    "total_flos",
)


def tag(key: str) -> str:
    for prefix in ("eval", "test"):
        if key.startswith(prefix + "_"):
            return f"{prefix}/{key[len(prefix) + 1 :]}"
    return f"train/{key}"


def new_run_id() -> str:
    """8 characters of [a-z0-9], like W&B's own ids (chosen here so a checkpoint can store it)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _numbers(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            v = v.item()
        if isinstance(v, (int, float, str)) and not isinstance(v, bool):
            out[k] = v
    return out


def corelooper_config_sections() -> dict[str, dict[str, Any]]:
    return {SECTION: {**DEFAULTS, "tags": []}}


def corelooper_settings() -> dict[str, Any]:
    return {"report_to": [SECTION]}  # a logger: loaded only when train.report_to wants it (HF's)


def settings(config) -> dict[str, Any]:
    return {**DEFAULTS, **config.sections.get(SECTION, {})}


def inactive_reason(config) -> str | None:
    """Why this plugin does nothing for ``config`` (``None``: it is active)."""
    cfg = settings(config)
    mode = cfg["mode"] or os.environ.get("WANDB_MODE", "")
    if not cfg["enabled"]:
        return "[wandb] enabled = false"
    if mode == "disabled" or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "W&B disabled (WANDB_MODE=disabled)"
    if SECTION not in config.sections and not os.environ.get("WANDB_PROJECT") and not mode:
        return "no [wandb] section and neither WANDB_PROJECT nor WANDB_MODE is set"
    return None


def corelooper_configure(config, plugins) -> None:
    """One W&B run for every corelooper run; its id is checkpointed (a resume continues it)."""
    reason = inactive_reason(config)
    if reason:
        plugins.set_inactive(SECTION, reason)
        return
    logger = WandbLogger()
    plugins.register(logger, f"{SECTION}.run")
    plugins.register_for_checkpointing(SECTION, logger)


class WandbLogger:
    """One run's W&B logger (main process only)."""

    def __init__(self) -> None:
        self.run = None
        self.run_id: str | None = None  # the id of the current (or last) run, saved in checkpoints
        self._resume_id: str | None = None  # from a checkpoint being loaded
        self.closed = False  # the Loop ended (corelooper_unconfigure)

    def _active(self, loop, state) -> bool:
        return state.is_world_process_zero

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_id = state.get("run_id")

    # -- the run ----------------------------------------------------------------------------------
    def _init(self, loop, run_id: str):
        import wandb

        cfg = settings(loop.config)
        directory = Path(cfg["dir"] or os.environ.get("WANDB_DIR") or loop.args.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(
                project=cfg["project"] or os.environ.get("WANDB_PROJECT") or "corelooper",
                entity=cfg["entity"] or None,
                name=cfg["name"] or loop.args.run_name or None,
                tags=list(cfg["tags"]) or None,
                group=cfg["group"] or None,
                notes=cfg["notes"] or None,
                job_type=cfg["job_type"] or None,
                mode=cfg["mode"] or None,
                dir=str(directory),
                id=run_id,
                resume="allow",
                config=loop.config.to_dict(),
                allow_val_change=True,
                reinit="finish_previous",
            )
        except Exception as e:  # no API key, no network, a bad entity/project ...
            from corelooper.errors import PluginError

            raise PluginError(
                f"wandb.init failed: {type(e).__name__}: {e}. Log in (`wandb login` or WANDB_API_KEY), "
                'or log offline (WANDB_MODE=offline or [wandb] mode = "offline"), or run without W&B '
                "(-p no:wandb, or remove the [wandb] section)."
            ) from e
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP, step_sync=True)
        self.run, self.run_id = run, run.id
        return run

    def on_train_begin(self, loop, state) -> None:
        if not self._active(loop, state):
            return
        resume_id = self._resume_id if state.global_step > 0 else None
        self._resume_id = None
        if self.run is not None and resume_id in (None, self.run_id):
            run = self.run  # opened by an evaluate() before train(), or an earlier train(): one run
        else:
            self._finish()
            run = self._init(loop, resume_id or new_run_id())
        model = loop.backend.unwrap_model(loop.model) if loop.backend else loop.model
        run.config.update(
            {"model/num_parameters": sum(p.numel() for p in model.parameters())}, allow_val_change=True
        )

    def _log(self, loop, state, values: dict[str, Any]) -> None:
        if not self._active(loop, state):
            return
        run = self.run  # open from the first log until the Loop ends (corelooper_unconfigure)
        if run is None:
            run = self._init(loop, self.run_id or new_run_id())
        try:
            self._send(run, state, values)
        finally:
            if self.closed:  # a log after the Loop was closed: into the same run, finished again
                self._finish()

    def _send(self, run, state, values: dict[str, Any]) -> None:
        values = _numbers(values)
        for key in SUMMARY_KEYS:
            if key in values:
                run.summary[key] = values.pop(key)
        if values:
            run.log({**{tag(k): v for k, v in values.items()}, STEP: state.global_step})

    def on_log(self, loop, state, logs) -> None:
        self._log(loop, state, logs)  # evaluation metrics too (on_log before on_evaluate, as in HF)

    def on_predict(self, loop, state, metrics) -> None:
        self._log(loop, state, metrics)

    def on_train_end(self, loop, state) -> None:
        if self.run is None:
            return
        summary = {"global_step": state.global_step, "epoch": state.epoch, "preempted": state.preempted}
        if state.best_metric is not None:
            summary.update(best_metric=state.best_metric, best_global_step=state.best_global_step)
        self.run.summary.update(summary)
        if state.preempted:
            self.run.mark_preempting()  # W&B shows it as preempted; a resume continues this run id
        # The run stays open: evaluate()/predict() after train() log into it; it ends with the Loop.

    def on_exception(self, exception) -> None:
        self._finish(exit_code=1)

    def corelooper_unconfigure(self) -> None:
        self.closed = True
        self._finish()

    def _finish(self, exit_code: int | None = None) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:
            # At interpreter exit W&B's own exit handler may finish the run before the Loop's
            # finalizer gets here: the run is finished, which is what was asked.
            if type(e).__name__ != "AlreadyJoinedError":
                raise
