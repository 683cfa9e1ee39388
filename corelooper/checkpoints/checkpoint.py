"""Checkpoints: save and load a run's full training state, atomically and verified by content.

The functions take what they need as arguments and return what they did; they fire no events
and read no loop internals. The loop fires ``on_save`` / ``on_load_checkpoint`` itself and applies
what ``load_checkpoint`` returns.

Run-folder functions (``resolve``, ``list_checkpoints``, rotation, ...) are in ``run_dir.py``;
the lock in ``lock.py``; the manifest in ``manifest.py``.

A checkpoint is written to ``output_dir/.tmp-checkpoint-N``; every file is fsynced, then
``manifest.json`` (size and checksum of every file) is written last and the folder renamed to
``checkpoint-N``. It counts as complete only when its manifest verifies; a temp folder is never
promoted. The files of ``checkpoint-N/`` are listed in docs/checkpoints.md.
Nothing is ever unpickled from a checkpoint: JSON, safetensors, ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, DataError, PluginError, TrainingError
from ..seeding import rng_state, set_rng_state
from ..state import LoopState
from . import manifest, resume_settings, run_dir, weights
from .ioerrors import errno_of, io_error
from .manifest import MANIFEST
from .run_dir import PREFIX, last_finite_checkpoint, list_checkpoints, prepare_output_dir, resolve
from .weights import WEIGHTS, WEIGHTS_INDEX, parse_size, read_weights, save_weights

__all__ = [
    "MANIFEST",
    "PREFIX",
    "WEIGHTS",
    "WEIGHTS_INDEX",
    "NonFiniteWeights",
    "Restored",
    "RunParts",
    "apply_plugin_states",
    "collect_plugin_states",
    "last_finite_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_weights",
    "loader_state",
    "parse_size",
    "prepare_output_dir",
    "read_weights",
    "resolve",
    "save_checkpoint",
    "save_model",
    "save_weights",
    "verify",
]

RESTORED_FIELDS = (
    "global_step",
    "epoch",
    "step_in_epoch",
    "micro_batches_in_epoch",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
    "num_input_tokens_seen",
    "total_samples_seen",
)


class NonFiniteWeights(TrainingError):
    """A save found NaN/inf weights: nothing was written."""


@dataclass
class Restored:
    """What ``load_checkpoint`` read and did not apply itself."""

    directory: Path
    loop_state: LoopState
    plugin_states: dict[str, Any] = field(default_factory=dict)
    extra_process_state: dict[str, Any] = field(default_factory=dict)
    changes: list[str] = field(default_factory=list)

    def apply(self, state: LoopState) -> None:
        """Copy the saved position, history and best metric into the loop's ``state``."""
        for key in RESTORED_FIELDS:
            setattr(state, key, getattr(self.loop_state, key))
        state.plugin_states = self.plugin_states


# -- writing ------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    if sys.platform == "win32":  # directories cannot be opened for fsync there
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_files(path: Path) -> None:
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def check_finite(state_dict: dict[str, torch.Tensor], backend, what: str, output_dir: Path) -> None:
    """Refuse to write non-finite weights. Every rank calls it and all agree (one reduce)."""
    finite = weights.all_finite(state_dict)
    if backend.num_processes > 1:
        finite = bool(backend.reduce_sum(torch.tensor(float(not finite), device=backend.device)) == 0)
    if not finite:
        last = last_finite_checkpoint(output_dir)
        raise NonFiniteWeights(
            f"The model's weights hold NaN or inf: {what} was not written (a non-finite checkpoint "
            f"would replace good ones). The last finite checkpoint is "
            f"{str(last) if last else 'none (no complete checkpoint yet)'}; resume from it with a lower "
            "train.learning_rate or train.max_grad_norm, and check the loss for the step it broke at."
        )


@dataclass(frozen=True)
class RunParts:
    """The run's objects a checkpoint saves and restores (the Loop passes its own)."""

    model: Any
    backend: Any
    optimizer: Any
    scheduler: Any
    config: Any
    state: LoopState


def save_checkpoint(
    output_dir: Path,
    run: RunParts,
    *,
    plugin_states: dict[str, Any],
    extra_process_state: dict[str, Any] | None = None,
    data_state: dict[str, Any] | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-{global_step}`` atomically and rotate (save_total_limit); returns
    its path. Every rank calls it. Refuses (NonFiniteWeights, exit 6) when a weight is NaN/inf; an
    OS failure is an IOFailure (exit 5) naming errno, path and the checkpoint still intact. Sets
    state.best_model_checkpoint when this step is the best one."""
    output_dir = Path(output_dir)
    backend, state = run.backend, run.state
    final = output_dir / f"{PREFIX}{state.global_step}"
    tmp = output_dir / f".tmp-{PREFIX}{state.global_step}"
    state_dict = backend.model_state_dict(run.model)
    check_finite(state_dict, backend, f"checkpoint {final.name}", output_dir)
    if state.best_global_step == state.global_step:
        state.best_model_checkpoint = str(final)
    try:
        if backend.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        backend.wait_for_everyone()
        _write_files(tmp, state_dict, run, plugin_states, extra_process_state or {}, data_state)
        backend.wait_for_everyone()
        if backend.is_main_process:
            manifest.write_manifest(tmp, while_hashing=_fsync_files)  # fsync and hash overlap
            _fsync_dir(tmp)  # the folder is renamed into place as a whole
            _put_in_place(tmp, final)
            run_dir.rotate_checkpoints(
                output_dir, run.config.train.save_total_limit, keep=final, best=state.best_model_checkpoint
            )
    except BaseException as exc:
        if backend.is_main_process:  # never leave half a checkpoint behind (it is never listed anyway)
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and errno_of(exc, output_dir) is not None:
            raise io_error(exc, f"writing {final.name}", output_dir, run_dir.intact_note(output_dir)) from exc
        raise
    backend.wait_for_everyone()
    return final


def _write_files(tmp: Path, state_dict, run: RunParts, plugin_states, extra, data_state) -> None:
    backend, config = run.backend, run.config
    rank = backend.process_index
    if backend.is_main_process:
        save_weights(state_dict, tmp, config.train.save_max_shard_size, backend.unwrap_model(run.model))
        weights.torch_save(run.scheduler.state_dict(), tmp / "scheduler.pt")
        config.write(tmp / "config.toml")
    backend.save_training_state(run.optimizer, tmp)
    weights.torch_save(rng_state(), tmp / f"rng_state_{rank}.pth")
    (tmp / f"process_state_{rank}.json").write_text(json.dumps(extra))
    if data_state is not None:
        (tmp / f"data_state_{rank}.json").write_text(json.dumps(data_state))
    if backend.is_main_process:
        (tmp / "plugins.json").write_text(json.dumps(plugin_states, indent=1))
        saved = run.state.to_dict()
        saved["best_model_checkpoint"] = run_dir.relative_to_run(
            run.state.best_model_checkpoint
        )  # relocatable
        (tmp / "loop_state.json").write_text(json.dumps(saved, indent=1))


def _put_in_place(tmp: Path, final: Path) -> None:
    """Rename the verified temp folder to its final name (replacing a same-step one whole)."""
    if final.exists():  # the same step saved again (e.g. at the end)
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def save_model(
    directory: Path, *, model, backend, max_shard_size: int | str = "5GB", finished: dict | None = None
) -> None:
    """The final (or best) model in ``directory`` (sharded above the limit), written to a temp
    folder first and moved in file by file, so a kill leaves only ``.tmp-`` debris. ``finished``
    (the loop state) is moved in last, as ``run_dir.FINISHED``: the run is finished only with both."""
    directory = Path(directory)
    state_dict = backend.model_state_dict(model)
    check_finite(state_dict, backend, f"the final model in {str(directory)!r}", directory)
    if backend.is_main_process:
        tmp = directory / ".tmp-final-model"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            save_weights(state_dict, tmp, max_shard_size, backend.unwrap_model(model))
            if finished is not None:
                (tmp / run_dir.FINISHED).write_text(json.dumps(finished, indent=1))
            _fsync_files(tmp)  # its files move out of it: the folder that must be durable is `directory`
            for name in os.listdir(directory):  # an earlier save's layout would shadow this one
                shard = name.startswith("model-") and "-of-" in name and name.endswith(".safetensors")
                if name in (WEIGHTS, WEIGHTS_INDEX, run_dir.FINISHED) or shard:
                    (directory / name).unlink(missing_ok=True)
            for p in sorted(tmp.iterdir(), key=lambda p: p.name == run_dir.FINISHED):  # the state last
                os.replace(p, directory / p.name)
            tmp.rmdir()
            _fsync_dir(directory)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(e, OSError) and errno_of(e, directory) is None:
                raise
            raise io_error(e, "writing the final model", directory, run_dir.intact_note(directory)) from e
    backend.wait_for_everyone()


def collect_plugin_states(named_objects: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``{name: obj.state_dict()}`` of the registered stateful objects, checked JSON-serialisable."""
    out = {}
    for name, obj in named_objects:
        try:
            state = obj.state_dict()
            json.dumps(state)
        except Exception as e:
            raise PluginError(
                f"Plugin {name!r} failed in state_dict() while a checkpoint was being saved: "
                f"{type(e).__name__}: {e}. state_dict() must return JSON-serialisable data. "
                "The previous checkpoints are untouched."
            ) from e
        out[name] = state
    return out


def loader_state(loader, what: str = "training dataset") -> dict[str, Any] | None:
    """A loader's position for ``data_state`` (its ``state_dict()``), or None when it has none."""
    if loader is None or not callable(getattr(loader, "state_dict", None)):
        return None
    state = loader.state_dict()
    try:
        json.dumps(state)
    except TypeError as e:
        raise DataError(
            f"The {what}'s state_dict() must be JSON-serialisable to be checkpointed ({e}). Return "
            "numbers, strings, lists and dicts from its state_dict()."
        ) from None
    return state


# -- reading ------------------------------------------------------------------------------------


def _read(path: Path, what: str):
    if not path.is_file():
        raise CheckpointError(f"Checkpoint file {str(path)!r} is missing ({what}).")
    try:
        if path.suffix == ".json":
            return json.loads(path.read_bytes())
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} ({what}) is unreadable (truncated or corrupt, or it holds "
            f"objects that weights_only loading refuses): {type(e).__name__}: {first_line(e)}. Resume "
            "from another checkpoint (--resume-from-checkpoint latest skips it)."
        ) from None


def first_line(error: BaseException) -> str:
    """torch's load errors run to several paragraphs: their first line says what failed."""
    return (str(error).strip().splitlines() or [""])[0]


def _is_adapter_checkpoint(model, directory: Path) -> bool:
    return (directory / "adapter_model.safetensors").is_file() and callable(
        getattr(model, "load_adapter", None)
    )


def _full_shapes(model, backend) -> dict[str, tuple[int, ...]] | None:
    shapes = getattr(backend, "full_parameter_shapes", None)  # optional Backend method
    return shapes(model) if callable(shapes) else None


def load_weights(directory: Path, *, model, backend) -> None:
    """Load the weights of ``directory`` into ``model`` (through the backend)."""
    directory = Path(directory)
    module = backend.unwrap_model(model)
    if _is_adapter_checkpoint(module, directory):
        # A PEFT model saves only its adapter; it loads it in place, as HF Trainer does.
        module.load_adapter(str(directory), getattr(module, "active_adapter", "default"), is_trainable=True)
        return
    loaded = read_weights(directory)
    if not weights.all_finite(loaded):  # the manifest's "finite" is not trusted: the files may have changed
        raise CheckpointError(
            f"Checkpoint {str(directory)!r} holds NaN or inf weights, although its manifest says they "
            "were finite when saved: it was changed afterwards. Load another checkpoint."
        )
    shapes = {k: tuple(v.shape) for k, v in loaded.items()}
    fill = weights.check_shapes(module, shapes, str(directory), _full_shapes(module, backend))
    aliases = weights.tied_keys(module.state_dict())
    for k in fill:  # tied weights: the saved twin holds the values
        loaded[k] = loaded[next(a for a in aliases[k] if a in loaded)]
    backend.load_model_state_dict(model, loaded)


def verify(directory: Path, *, model=None, backend=None, config=None) -> dict[str, Any]:
    """Check a checkpoint before anything is changed: its manifest (every file's size and
    checksum), and — given a model and config — the same model config and matching weight
    names and shapes. Returns its loop state (a dict)."""
    directory = Path(directory)
    manifest.verify(directory)
    state = _read(directory / "loop_state.json", "loop state")
    if config is not None:
        resume_settings.check_same_model(config, directory)
    if model is not None:
        module = backend.unwrap_model(model) if backend is not None else model
        if not _is_adapter_checkpoint(module, directory):  # the adapter library checks its shapes
            found = weights.weight_shapes(directory)
            weights.check_shapes(module, found, str(directory), _full_shapes(module, backend))
    return state


def load_checkpoint(directory: Path, run: RunParts) -> Restored:
    """Verify ``directory``, load model/optimizer/scheduler/RNG in place, return the rest:
    ``Restored.apply(state)`` copies the saved LoopState fields; ``.plugin_states`` (name -> state),
    ``.extra_process_state`` (this rank's dict given at save, e.g. the log window), ``.changes``."""
    directory = Path(directory)
    saved = verify(directory, model=run.model, backend=run.backend, config=run.config)
    changes = resume_settings.compare(run.config, directory, saved, run.state)  # refused ones raise here
    plugins = _read(directory / "plugins.json", "plugin states")
    scheduler_state = _read(directory / "scheduler.pt", "scheduler state")
    rank = run.backend.process_index
    rng_path = directory / f"rng_state_{rank}.pth"
    same_world = saved.get("world_size", 1) == run.state.world_size
    rng = _read(rng_path, "RNG state") if rng_path.exists() or same_world else None
    load_weights(directory, model=run.model, backend=run.backend)
    _load_optimizer(directory, run.backend, run.optimizer, run.config)
    run.scheduler.load_state_dict(scheduler_state)
    resume_settings.apply(
        run.config,
        saved_train=resume_settings.saved_train(directory),
        optimizer=run.optimizer,
        scheduler=run.scheduler,
    )
    extra: dict[str, Any] = {}
    if rng is not None:
        if "log_window" in rng:  # checkpoints of 0.1: the log window lived in the RNG file
            extra["log_window"] = rng.pop("log_window")
        set_rng_state(rng)
    extra_path = directory / f"process_state_{rank}.json"
    if extra_path.is_file():
        extra.update(_read(extra_path, "process state"))
    restored = LoopState.from_dict(saved)
    restored.best_model_checkpoint = run_dir.from_run(saved.get("best_model_checkpoint"), directory)
    return Restored(
        directory=directory,
        loop_state=restored,
        plugin_states=plugins,
        extra_process_state=extra,
        changes=changes,
    )


def _load_optimizer(directory: Path, backend, optimizer, config) -> None:
    try:
        backend.load_training_state(optimizer, directory)
    except FileNotFoundError as e:
        missing = e.filename or directory
        raise CheckpointError(
            f"Checkpoint file {str(missing)!r} is missing (optimizer state). "
            f"{_sections_dropped(directory, config) or 'Resume from another checkpoint.'}"
        ) from None
    except CheckpointError:
        raise
    except Exception as e:  # incl. UnpicklingError: weights_only refused an object
        where = directory / "optimizer.pt" if (directory / "optimizer.pt").exists() else directory
        raise CheckpointError(
            f"Checkpoint file {str(where)!r} (optimizer state) is unreadable (truncated, from another "
            f"optimizer, or holding objects weights_only loading refuses): {type(e).__name__}: "
            f"{first_line(e)}. Resume from another checkpoint (--resume-from-checkpoint latest skips it)."
        ) from None


def _sections_dropped(directory: Path, config) -> str:
    """Why an optimizer file can be missing from a sound checkpoint: it was saved by a backend a
    plugin section chose (a sharding engine's own state format), and this run's
    config no longer has that section ("" when nothing was dropped)."""
    try:
        saved = resume_settings.saved_sections(directory)
    except CheckpointError:
        return ""
    dropped = sorted(saved - set(config.sections) - set(config.CORE))
    if not dropped:
        return ""
    names = ", ".join(f"[{name}]" for name in dropped)
    return (
        f"The checkpoint was saved by a run with {names}, which this config does not have: its "
        f"optimizer state is in the format of the backend chosen there. Resume with {names} in "
        "the config, or start a new run from its model.safetensors."
    )


def apply_plugin_states(
    named_objects: Iterable[tuple[str, Any]], states: dict[str, Any], directory: Path
) -> None:
    """``obj.load_state_dict(states[name])`` for every registered object with a saved state."""
    for name, obj in named_objects:
        if name not in states:
            continue
        try:
            obj.load_state_dict(states[name])
        except Exception as e:
            raise PluginError(
                f"Plugin {name!r} failed in load_state_dict() restoring {str(directory)!r}: "
                f"{type(e).__name__}: {e}."
            ) from e
