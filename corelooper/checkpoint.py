"""Checkpoints: save / load / rotate / find-latest, with atomic directory writes.

A checkpoint is written to ``output_dir/.tmp-checkpoint-N``, every file flushed to disk, then
renamed to ``checkpoint-N``: a folder named ``checkpoint-N`` is always complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .seeding import rng_state, set_rng_state
from .state import LoopState

PREFIX = "checkpoint-"
WEIGHTS = "model.safetensors"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


# -- output dir -------------------------------------------------------------------------------


def prepare_output_dir(loop, output_dir: Path, resuming: bool) -> None:
    """Create ``output_dir`` and write the resolved config; refuse to mix two runs in it."""
    output_dir.mkdir(parents=True, exist_ok=True)
    existing = list_checkpoints(output_dir)
    if existing and not resuming and not loop.args.overwrite_output_dir:
        raise CheckpointError(
            f"output_dir {str(output_dir)!r} already holds a run ({len(existing)} checkpoints, "
            f"latest {existing[-1].name}). Resume it with --resume-from-checkpoint latest, choose "
            "another train.output_dir, or set train.overwrite_output_dir = true to start over."
        )
    if existing and loop.args.overwrite_output_dir and not resuming:
        for path in existing:
            shutil.rmtree(path)
    if not resuming:
        metrics = output_dir / "metrics.jsonl"
        if metrics.exists():
            metrics.unlink()
    loop.config.write(output_dir / "config.toml")


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resolve(resume: str | Path, output_dir: Path) -> Path:
    if str(resume) == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(
                f"--resume-from-checkpoint latest: no complete checkpoint in {str(output_dir)!r}."
            )
        return found[-1]
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint {str(path)!r} does not exist (or is not a folder).")
    return path


# -- writing ------------------------------------------------------------------------------------


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_weights(state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    # safetensors refuses tensors that share memory (tied weights): store contiguous copies.
    seen: dict[int, str] = {}
    tensors = {}
    for k, v in state_dict.items():
        v = v.detach()
        ptr = v.untyped_storage().data_ptr() if v.numel() else None
        if ptr is not None and ptr in seen:
            v = v.clone()
        if ptr is not None:
            seen.setdefault(ptr, k)
        tensors[k] = v.contiguous().cpu()
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})


def plugin_states(loop) -> dict[str, Any]:
    """State of every plugin with ``state_dict``/``load_state_dict`` (JSON-serialisable)."""
    out = {}
    for name, plugin in loop.plugins.pm.list_name_plugin():
        if callable(getattr(plugin, "state_dict", None)) and callable(getattr(plugin, "load_state_dict", None)):
            out[name] = plugin.state_dict()
    return out


def save_checkpoint(loop) -> Path:
    s, backend = loop.state, loop.backend
    output_dir = Path(loop.args.output_dir)
    final = output_dir / f"{PREFIX}{s.global_step}"
    tmp = output_dir / f".tmp-{PREFIX}{s.global_step}"
    if s.best_global_step == s.global_step:
        s.best_model_checkpoint = str(final)
    state_dict = backend.model_state_dict(loop.model)
    if backend.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    backend.wait_for_everyone()
    if backend.is_main_process:
        save_weights(state_dict, tmp)
        torch.save(loop.scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "loop_state.json").write_text(json.dumps(s.to_dict(), indent=1))
        (tmp / "plugins.json").write_text(json.dumps(plugin_states(loop), indent=1))
        loop.config.write(tmp / "config.toml")
    backend.save_training_state(loop.optimizer, tmp)
    torch.save(rng_state(), tmp / f"rng_state_{backend.process_index}.pth")
    backend.wait_for_everyone()
    if backend.is_main_process:
        _fsync_tree(tmp)
        if final.exists():  # the same step saved again (e.g. at the end): replace it whole
            old = output_dir / f".old-{PREFIX}{s.global_step}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        rotate_checkpoints(loop, output_dir)
    backend.wait_for_everyone()
    loop._fire("on_save", checkpoint_dir=final)
    return final


def rotate_checkpoints(loop, output_dir: Path) -> None:
    """Keep ``save_total_limit`` checkpoints, never deleting the best nor the latest."""
    limit = loop.args.save_total_limit
    if not limit:
        return
    found = list_checkpoints(output_dir)
    best = loop.state.best_model_checkpoint
    keep = {found[-1]} if found else set()
    if best:
        keep.add(Path(best))
    removable = [p for p in found if p not in keep]
    excess = len(found) - max(limit, len(keep))
    for path in removable[: max(0, excess)]:
        shutil.rmtree(path, ignore_errors=True)


def save_model(loop, directory: Path) -> None:
    """The final (or best) model: ``directory/model.safetensors``."""
    state_dict = loop.backend.model_state_dict(loop.model)
    if loop.backend.is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
        save_weights(state_dict, directory)
    loop.backend.wait_for_everyone()


# -- reading ------------------------------------------------------------------------------------


def load_weights(loop, directory: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = directory / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {str(directory)!r} has no {WEIGHTS}.")
    try:
        loaded = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is unreadable (truncated or corrupt?): {e}") from None
    model = loop.backend.unwrap_model(loop.model)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    wrong = [
        f"{k}: checkpoint {tuple(loaded[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected if k in loaded and loaded[k].shape != expected[k].shape
    ]
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            parts.append("shape mismatch: " + "; ".join(wrong[:5]))
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:5]}")
        if unexpected:
            parts.append(f"not in the model: {unexpected[:5]}")
        raise CheckpointError(
            f"Checkpoint {str(path)!r} does not match the model ({', '.join(parts)}). Was it "
            "saved from another model config?"
        )
    loop.backend.load_model_state_dict(loop.model, loaded)


def load_model(loop, directory: Path) -> None:
    load_weights(loop, directory)


def _read(path: Path, what: str):
    if not path.is_file():
        raise CheckpointError(f"Checkpoint file {str(path)!r} is missing ({what}).")
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text())
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} ({what}) is unreadable (truncated or corrupt?): "
            f"{type(e).__name__}: {e}"
        ) from None


def load_checkpoint(loop, directory: Path) -> None:
    """Restore model, optimizer, scheduler, RNG, loop and plugin state from ``directory``."""
    backend, s = loop.backend, loop.state
    state = _read(directory / "loop_state.json", "loop state")
    plugins = _read(directory / "plugins.json", "plugin states")
    scheduler = _read(directory / "scheduler.pt", "scheduler state")
    load_weights(loop, directory)
    try:
        backend.load_training_state(loop.optimizer, directory)
    except FileNotFoundError as e:
        raise CheckpointError(f"Checkpoint {str(directory)!r}: missing optimizer state ({e}).") from None
    except (RuntimeError, ValueError, EOFError) as e:
        raise CheckpointError(f"Checkpoint {str(directory)!r}: unreadable optimizer state: {e}") from None
    loop.scheduler.load_state_dict(scheduler)
    rng_path = directory / f"rng_state_{backend.process_index}.pth"
    if rng_path.exists():
        set_rng_state(_read(rng_path, "RNG state"))
    restored = LoopState.from_dict(state)
    for key in ("global_step", "epoch", "step_in_epoch", "micro_batches_in_epoch", "log_history",
                "best_metric", "best_global_step", "best_model_checkpoint",
                "num_input_tokens_seen", "total_samples_seen"):
        setattr(s, key, getattr(restored, key))
    s.plugin_states = plugins
    for name, plugin in loop.plugins.pm.list_name_plugin():
        if name in plugins and callable(getattr(plugin, "load_state_dict", None)):
            plugin.load_state_dict(plugins[name])
    loop._fire("on_load_checkpoint", checkpoint_dir=directory)
