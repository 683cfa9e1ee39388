"""The run folder: which checkpoints it holds, which one to resume, rotation and clean-up.

A ``checkpoint-N`` folder counts only when its ``manifest.json`` verifies (``manifest.py``).
Nothing here ever promotes a temporary folder: a ``.tmp-checkpoint-N`` is a save that did not
finish and is deleted at start-up, as are ``.deleting-checkpoint-N`` (a rotation cut short)
and stray ``.tmp*`` files (a final-model write killed before its rename).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from ..config import parse_size
from ..errors import CheckpointError, ConfigError
from . import manifest
from .ioerrors import check_is_folder, io_error

logger = logging.getLogger("corelooper")

PREFIX = "checkpoint-"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
FINISHED = "loop_state.json"  # beside the final model: the run's state when it finished
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_OLD_RE = re.compile(r"^\.old-checkpoint-(\d+)$")
_DEBRIS_RE = re.compile(r"^\.(tmp|deleting)-checkpoint-\d+$|^\.tmp")


def prepare_output_dir(output_dir: Path, config, *, resuming: bool, overwrite: bool) -> None:
    """Create ``output_dir``, clear the debris of killed saves, write the resolved config;
    refuse to start a second run over a finished or started one (unless ``overwrite``).
    Rank 0 calls it, under the RunLock."""
    parse_size(config.train.save_max_shard_size)  # a bad value fails now, not at the first save
    output_dir = Path(output_dir)
    try:
        check_is_folder(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        _clear_debris(output_dir)
        # Only the folders corelooper wrote (a manifest): another tool's checkpoint-N (an HF
        # Trainer's, being resumed from) is not this run's to delete.
        existing = [p for p in list_checkpoints(output_dir) if (p / manifest.MANIFEST).is_file()]
        final_model = final_model_files(output_dir)
        if (existing or final_model) and not resuming:
            if not overwrite:  # a usage problem (exit 2), nothing wrong with the checkpoints
                what = (  # the parenthesis opened below closes here
                    f"{len(existing)} checkpoints, latest {existing[-1].name}). Resume it with "
                    "--resume-from-checkpoint latest, choose"
                    if existing
                    else f"a finished model, {final_model[0].name}, and no checkpoint to resume). Choose"
                )
                raise ConfigError(
                    f"output_dir {str(output_dir)!r} already holds a run ({what} another "
                    "train.output_dir, or set train.overwrite_output_dir = true to start over (that "
                    "deletes it)."
                )
            for path in existing:
                _remove_dir(path)
            for path in [*final_model, output_dir / FINISHED]:
                path.unlink(missing_ok=True)
        if not resuming:
            (output_dir / "metrics.jsonl").unlink(missing_ok=True)
        config.write(output_dir / "config.toml")
    except OSError as e:
        raise io_error(e, "preparing the output folder", output_dir) from None


def _clear_debris(output_dir: Path) -> None:
    """Remove what killed saves and rotations left. The one repair: a ``.old-checkpoint-N``
    (a complete checkpoint being replaced by a re-save of the same step) whose replacement
    never arrived is put back — it was complete before, and its manifest must still verify."""
    for p in sorted(output_dir.iterdir()):
        m = _OLD_RE.match(p.name)
        if m and p.is_dir():
            final = output_dir / f"{PREFIX}{m.group(1)}"
            if not final.exists() and manifest.problem(p) is None:
                os.replace(p, final)
            else:
                _remove_dir(p)
        elif _DEBRIS_RE.match(p.name):
            if p.is_dir():
                _remove_dir(p)
            else:
                p.unlink(missing_ok=True)


def _remove_dir(path: Path) -> None:
    """Rename away first, then delete: a kill mid-delete leaves a ``.deleting-`` folder that
    no listing counts and the next start-up removes, never a half-empty ``checkpoint-N``."""
    if not path.exists():
        return
    doomed = path.with_name(f".deleting-{path.name.lstrip('.')}")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def list_checkpoints(output_dir: Path) -> list[Path]:
    """``checkpoint-N`` folders, oldest first (temporary folders are never listed)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(found)]


def final_model_files(output_dir: Path) -> list[Path]:
    """The finished run's weights in ``output_dir`` (one file, or a sharded model's index)."""
    return [p for p in (Path(output_dir) / WEIGHTS, Path(output_dir) / WEIGHTS_INDEX) if p.exists()]


def step_of(checkpoint: Path) -> int:
    return int(_CKPT_RE.match(Path(checkpoint).name)[1])


def finished_state(output_dir: Path) -> dict | None:
    """The loop state a finished run left beside its final model (``FINISHED``); None without
    both, when it is unreadable (the checkpoints decide), or when a checkpoint is newer."""
    output_dir = Path(output_dir)
    if not (output_dir / FINISHED).is_file() or not final_model_files(output_dir):
        return None
    try:
        saved = json.loads((output_dir / FINISHED).read_text())
        saved["global_step"] = int(saved["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    newest = list_checkpoints(output_dir)[-1:]
    return None if newest and step_of(newest[0]) > saved["global_step"] else saved


def last_finite_checkpoint(output_dir: Path) -> Path | None:
    """The newest checkpoint that verifies (every one written is finite): for messages like
    "the last finite checkpoint is checkpoint-15"."""
    return next((p for p in reversed(list_checkpoints(output_dir)) if manifest.problem(p) is None), None)


def intact_note(output_dir: Path) -> str:
    last = last_finite_checkpoint(output_dir)
    return f"{last.name} is intact" if last else "no complete checkpoint was written yet"


def resolve(resume: str | Path, output_dir: Path, for_training: bool = True) -> Path | None:
    """``"latest"``: the newest checkpoint of ``output_dir`` that verifies, saying in one line
    which newer ones were skipped and why. ``"auto"``: the same, or ``None`` (start fresh) when
    the run has no checkpoint yet, so one command both starts a job and resumes it after a
    requeue. A path: that folder, refused unless it verifies.
    ``for_training=False`` (eval/predict): a folder without a manifest (an exported model, a
    finished run's output_dir, also ``latest``'s when it has no checkpoint) is accepted; one with a
    manifest must still verify."""
    output_dir = Path(output_dir)
    if str(resume) == "auto":
        if not list_checkpoints(output_dir):
            return None
        resume = "latest"
    if str(resume) == "latest":
        skipped = []
        for path in reversed(list_checkpoints(output_dir)):
            why = manifest.problem(path) or unloadable(path)
            if why is None:
                if skipped:
                    logger.warning("resuming from %s; skipped newer %s", path.name, "; ".join(skipped))
                return path
            skipped.append(f"{path.name} ({why})")
        finished = final_model_files(output_dir)
        if finished and not for_training and not skipped:  # eval/predict: a run saved without checkpoints
            return output_dir
        if (
            for_training and not skipped and finished_state(output_dir)
        ):  # the loop decides: done, or no resume
            return None
        more = f" ({'; '.join(skipped)})" if skipped else ""
        done = f" Its run finished: {finished[0].name}." if finished else ""
        fix = (
            "Start without it, or pass the path of a checkpoint folder"
            if for_training
            else "Pass a checkpoint folder"
        )
        raise CheckpointError(
            f"{'--resume-from-checkpoint' if for_training else '--checkpoint'} latest: there is no "
            f"complete checkpoint in {str(output_dir)!r}{more}.{done} {fix}."
        )
    path = Path(resume)
    if not path.is_dir():
        hint = (
            " (a .tmp- folder is an incomplete save and cannot be resumed)"
            if path.name.startswith(".tmp-")
            else ""
        )
        raise CheckpointError(
            f"Checkpoint {str(path)!r} does not exist (or is not a folder){hint}. Pass a "
            "checkpoint-N folder, or 'latest' for the newest one in train.output_dir."
        )
    if for_training or (path / manifest.MANIFEST).exists():
        manifest.verify(path)  # refused, naming the file, when it does not verify
    return path


def unloadable(directory: Path) -> str | None:
    """Which torch file of a checkpoint that verifies does not load with ``weights_only`` (a
    file with pickled objects, written by other code): found now, so that ``latest`` skips the
    checkpoint as it skips one that fails its checksum. Memory-mapped: the tensors are not read."""
    import torch

    for path in sorted([*directory.glob("*.pt"), *directory.glob("*.pth")]):
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # UnpicklingError (an object weights_only refuses), RuntimeError
            return f"{path.name} does not load with weights_only: {type(e).__name__}"
    return None


def rotate_checkpoints(
    output_dir: Path, limit: int | None, keep: Path | None = None, best: str | Path | None = None
) -> list[Path]:
    """Keep ``limit`` checkpoints, oldest deleted first, never the best one, the newest one nor
    ``keep`` (the one just written, the newest finite one); ones of a later step than ``keep`` (a
    future a resume from an earlier step left behind) go first. Returns the deleted folders."""
    if not limit:
        return []
    found, mark = list_checkpoints(output_dir), keep and _CKPT_RE.match(Path(keep).name)
    found.sort(key=lambda p: not (mark and step_of(p) > int(mark[1])))  # stable: stale first
    protected = {Path(p).name for p in (*found[-1:], keep, best) if p}
    deleted = [p for p in found if p.name not in protected][: max(0, len(found) - limit)]
    for path in deleted:
        _remove_dir(path)
    return deleted


def keep_only_best(output_dir: Path, best: str | Path) -> None:
    """End of training with ``save_total_limit = 1`` and a best checkpoint (HF 5.x
    ``_finalize_training``): every other checkpoint is deleted, the best one stays."""
    for path in list_checkpoints(output_dir):
        if path.name != Path(best).name:
            _remove_dir(path)


def relative_to_run(path: str | Path | None) -> str | None:
    """A checkpoint path as stored on disk: its folder name, resolved against the folder that
    holds the checkpoint when read back (so a moved or copied run still finds it)."""
    return Path(path).name if path else None


def from_run(stored: str | None, checkpoint_dir: Path) -> str | None:
    """The stored name (or an absolute path of an older version) -> a path in this run folder."""
    return str(Path(checkpoint_dir).parent / Path(stored).name) if stored else None
