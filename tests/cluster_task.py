"""A small run written as a TOML config, for tests that start real launchers (torchrun, Slurm, Ray).

``write_config(tmp, output_dir, **train)`` writes ``config.toml`` pointing at ``tests/toys.py``
(an MLP on 4-class blobs, no dropout: the weights are a function of the samples and their order
only, so runs on different launchers or world sizes can be compared to 1e-5).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOYS = REPO / "tests" / "toys.py"

TRAIN = {
    "max_steps": 12,
    "per_device_train_batch_size": 4,
    "learning_rate": 0.05,
    "logging_steps": 1,
    "save_strategy": "steps",
    "save_steps": 3,
    "eval_strategy": "no",
    "lr_scheduler_type": "linear",
    "seed": 3,
}


# A local plugin that stops the run as a scheduler's preemption would: a real SIGTERM at
# STOP_AT_STEP (the elastic-resume tests write it next to their config).
STOP_PLUGIN = """
import os
import signal

STOP = int(os.environ.get("STOP_AT_STEP", "0"))


def on_step_end(state):
    if state.global_step == STOP:  # as a scheduler's preemption would: a real SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
"""


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def write_config(directory: Path, output_dir: Path, name: str = "config.toml", **train) -> Path:
    settings = {**TRAIN, **train, "output_dir": str(output_dir)}
    lines = [
        "[model]",
        f'factory = "{TOYS}:mlp"',
        "[data]",
        f'train = "{TOYS}:blobs_train"',
        "[train]",
        *(f"{k} = {_toml(v)}" for k, v in settings.items()),
    ]
    path = directory / name
    path.write_text("\n".join(lines) + "\n")
    return path


ELASTIC = ["-p", "corelooper_streaming", "-p", "corelooper_elastic_resume"]
"""CLI arguments that load the elastic resume (installed plugins are off in ``env``)."""


def env(tmp_path: Path) -> dict[str, str]:
    """One thread per process, torchrun's debris in the test's folder, installed plugins off."""
    return {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def claim_two_processes(checkpoint_dir: Path) -> None:
    """Make a 1-process checkpoint say it was saved by 2, and re-sign its manifest (checkpoints
    are verified by checksum: an edit alone is refused as corruption)."""
    from corelooper.checkpoints.manifest import write_manifest

    path = checkpoint_dir / "loop_state.json"
    text = path.read_text()
    assert '"world_size": 1,' in text
    path.write_text(text.replace('"world_size": 1,', '"world_size": 2,'))
    (checkpoint_dir / "manifest.json").unlink()
    write_manifest(checkpoint_dir)
