"""Ray Train's ``TorchTrainer`` around corelooper's ``Loop`` (imported only by ``corelooper ray``).

Every worker builds the ``Loop`` from the same resolved config. Ray has already joined the
workers in a process group and set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``, so
corelooper's backend (DDP through accelerate; FSDP/DeepSpeed plugins) runs exactly as under
torchrun: the same samples per step, the same numbers.

Checkpoints: corelooper writes ``checkpoint-N`` into ``train.output_dir`` as always, and
``RayReporter.on_save`` reports it to Ray with the latest logged metrics (``ray.train.report``
is a barrier, and ``on_save`` fires on every rank; each node's local rank 0 reports the folder,
so per-rank files of every node reach Ray's storage). After a worker failure Ray restarts the
whole group (``max_failures``); ``ray.train.get_checkpoint()`` then names the last checkpoint Ray
registered, and the workers resume from it (or from a newer one in ``output_dir``, see
``newest``), sample-exactly. Without one (a first start) they
resume as ``--resume-from-checkpoint auto`` would: from ``output_dir`` when it holds a
checkpoint, else from scratch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from . import SECTION


class RayReporter:
    """Reports every saved checkpoint, with the metrics logged so far, to Ray Train."""

    name = "ray_report"

    def on_save(self, loop, state, checkpoint_dir) -> None:
        import ray.train

        checkpoint = (
            ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if state.is_local_process_zero else None
        )
        ray.train.report(_metrics(state.log_history), checkpoint=checkpoint)


def _metrics(log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """Every logged key with its latest value (HF's RayTrainReportCallback does the same)."""
    merged: dict[str, Any] = {}
    for entry in log_history:
        merged.update(
            {
                k: v
                for k, v in entry.items()
                if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
            }
        )
    return merged


def train_worker(args: dict[str, Any]) -> None:
    """The function every Ray Train worker runs."""
    import ray.train

    from corelooper.config import Config
    from corelooper.loop import Loop

    source = Path(args["source"]) if args.get("source") else None
    config = Config.from_dict(args["config"], source=source)

    def train(resume: str, restarted: bool = False) -> None:
        # In the config: on another number of workers the Loop settles the batch geometry that
        # keeps the checkpoint's global batch before any plugin is configured.
        run = config.replace("train", resume_from_checkpoint=resume)
        loop = Loop(config=run, blocked_plugins=args["blocked"], plugins=[RayReporter()])
        if restarted and loop.state.is_world_process_zero:
            print(f"corelooper-ray: restarted after a failure; resuming from {resume}", flush=True)
        loop.train()

    reported = ray.train.get_checkpoint()
    if reported is None:
        train(args["resume"] or "auto")
        return
    with reported.as_directory() as directory:  # local storage: the folder itself, else a download
        train(str(newest(Path(directory), Path(config.train.output_dir))), restarted=True)


def newest(reported: Path, output_dir: Path) -> Path:
    """The later of Ray's last registered checkpoint and ``output_dir``'s newest one.

    Ray registers a report when its controller next polls the workers, so a failure right
    after a save can leave Ray one checkpoint behind; on a file system the workers share,
    ``output_dir`` then holds the newer, equally complete one.
    """
    import json

    from corelooper.checkpoints.checkpoint import list_checkpoints

    local = list_checkpoints(output_dir)
    try:
        step = json.loads((reported / "loop_state.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError):
        return local[-1] if local else reported  # corelooper's own verification names the problem
    if local and int(local[-1].name.rsplit("-", 1)[1]) > step:
        return local[-1]
    return reported


def use_gpu(setting, cluster_gpus: float) -> bool:
    """``use_gpu`` of ``[ray]``: true/false, or "auto" = whether the Ray cluster has GPUs."""
    from corelooper.errors import ConfigError

    if isinstance(setting, bool):
        return setting
    if str(setting).lower() == "auto":
        return cluster_gpus > 0
    if str(setting).lower() in ("true", "false"):
        return str(setting).lower() == "true"
    raise ConfigError(f'ray.use_gpu = {setting!r}: use true, false or "auto".')


def fit(config, blocked: list[str], resume: str | None):
    """Start (or join) Ray, run the ``TorchTrainer``, return Ray's ``Result``."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from corelooper.errors import ConfigError, TrainingError
    from corelooper.plugins import load_plugins

    config = load_plugins(config, blocked=blocked).config  # every section validated ([ray] too), defaults in
    s = config.section(SECTION)
    if s["num_workers"] < 1:
        raise ConfigError(f"ray.num_workers = {s['num_workers']}: use at least 1 worker.")
    # Ray Train copies workers' prints into its own log records too: every line would show twice
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if not ray.is_initialized():
        ray.init(
            address=s["address"] or None,
            num_cpus=s["num_cpus"] or None,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
    gpu = use_gpu(s["use_gpu"], ray.cluster_resources().get("GPU", 0))
    output_dir = Path(config.train.output_dir)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={
            "config": config.to_dict(),
            "blocked": list(blocked),
            "resume": resume,
            "source": str(config.source) if config.source else None,
        },
        scaling_config=ScalingConfig(
            num_workers=s["num_workers"], use_gpu=gpu, resources_per_worker=s["resources_per_worker"] or None
        ),
        run_config=RunConfig(
            name=s["name"] or output_dir.name,
            storage_path=s["storage_path"] or None,
            failure_config=FailureConfig(max_failures=s["max_failures"]),
        ),
    )
    try:
        return trainer.fit()
    except Exception as e:  # Ray's TrainingFailedError wraps the worker's own exception
        cause = getattr(e, "__cause__", None) or e
        raise TrainingError(
            f"Ray Train run {s['name'] or output_dir.name!r} failed after {s['max_failures']} allowed "
            f"restart(s): {type(cause).__name__}: {cause}. Raise ray.max_failures to retry more; the "
            f"checkpoints in {str(output_dir)!r} are intact."
        ) from e
