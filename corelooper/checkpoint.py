"""Checkpoints: save / verify / load / rotate / find-latest, with atomic directory writes.

A checkpoint is written to ``output_dir/.tmp-checkpoint-N``; every file is fsynced, a
``manifest.json`` listing each file and its size is written last, and only then is the folder
renamed to ``checkpoint-N`` (and the parent folder fsynced). So a folder named ``checkpoint-N``
is always complete, and a ``kill -9`` at any moment leaves the previous checkpoints untouched.

Contents of ``checkpoint-N/``::

    model.safetensors                  weights (or model-0000k-of-0000n.safetensors +
                                       model.safetensors.index.json above save_max_shard_size;
                                       HF PreTrainedModels via save_pretrained, + config.json)
    optimizer.pt  scheduler.pt  [scaler.pt]    torch.save'd state dicts (tensors and numbers only)
    rng_state_{rank}.pth               python / numpy / torch CPU / CUDA RNG states, per process
    loop_state.json                    LoopState: global_step, epoch, position in the epoch, ...
    plugins.json                       state_dict() of every stateful plugin
    data_state_{rank}.json             a streaming loader's position per shard (streaming.py)
    config.toml                        the resolved config (text, never a pickled object)
    manifest.json                      file -> size in bytes; written last
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from . import streaming
from .errors import CheckpointError, PluginError
from .seeding import rng_state, set_rng_state
from .state import LoopState

PREFIX = "checkpoint-"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MANIFEST = "manifest.json"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_TMP_RE = re.compile(r"^\.(tmp|old)-checkpoint-\d+$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


# -- output dir -------------------------------------------------------------------------------


def prepare_output_dir(loop, output_dir: Path, resuming: bool) -> None:
    """Create ``output_dir`` and write the resolved config; refuse to mix two runs in it."""
    parse_size(loop.args.save_max_shard_size)  # a bad value fails now, not at the first save
    output_dir.mkdir(parents=True, exist_ok=True)
    existing = list_checkpoints(output_dir)
    final_model = [p for p in (output_dir / WEIGHTS, output_dir / WEIGHTS_INDEX) if p.exists()]
    held = [*existing, *final_model]
    if held and not resuming and not loop.args.overwrite_output_dir:
        what = (f"{len(existing)} checkpoints, latest {existing[-1].name}" if existing
                else f"a finished model, {final_model[0].name}")
        raise CheckpointError(
            f"output_dir {str(output_dir)!r} already holds a run ({what}). Resume it with "
            "--resume-from-checkpoint latest, choose another train.output_dir, or set "
            "train.overwrite_output_dir = true to start over (that deletes its checkpoints)."
        )
    if held and loop.args.overwrite_output_dir and not resuming:
        for path in existing:
            shutil.rmtree(path)
        for path in final_model:
            path.unlink()
    _clear_debris(output_dir)
    if not resuming:
        metrics = output_dir / "metrics.jsonl"
        if metrics.exists():
            metrics.unlink()
    loop.config.write(output_dir / "config.toml")


def _clear_debris(output_dir: Path) -> None:
    """Folders of a save that was killed. A complete one (manifest written) whose
    ``checkpoint-N`` is missing was killed between its renames: it is put in place; the rest
    are incomplete and removed."""
    for stale in sorted(output_dir.iterdir(), key=lambda p: not p.name.startswith(".tmp")):
        if not (_TMP_RE.match(stale.name) and stale.is_dir()):
            continue
        final = output_dir / stale.name.split("-", 1)[1]
        if not final.exists() and (stale / MANIFEST).is_file():
            os.replace(stale, final)
        else:
            shutil.rmtree(stale, ignore_errors=True)


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resolve(resume: str | Path, output_dir: Path) -> Path:
    """``"latest"`` -> the newest complete checkpoint in ``output_dir``; else the folder given."""
    if str(resume) == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(
                f"--resume-from-checkpoint latest: there is no complete checkpoint in "
                f"{str(output_dir)!r} (folders named checkpoint-N). Start without "
                "--resume-from-checkpoint, or pass the path of a checkpoint folder."
            )
        return found[-1]
    path = Path(resume)
    if not path.is_dir():
        hint = ""
        if path.name.startswith(".tmp-"):
            hint = " (a .tmp- folder is an incomplete save and cannot be resumed)"
        raise CheckpointError(
            f"Checkpoint {str(path)!r} does not exist (or is not a folder){hint}. Pass a "
            "checkpoint-N folder, or 'latest' for the newest one in train.output_dir."
        )
    return path


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5e9, ``"500MiB"`` -> 500 * 2**20, ints pass through (bytes)."""
    if isinstance(size, int):
        return size
    m = _SIZE_RE.match(str(size))
    if not m:
        raise CheckpointError(
            f"train.save_max_shard_size = {size!r} is not a size: use bytes (an int) or a "
            "string like '5GB', '500MB', '2GiB'."
        )
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


# -- writing ------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    if sys.platform == "win32":  # directories cannot be opened for fsync there
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _untie(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors; safetensors refuses tensors that share memory (tied weights)."""
    seen: set[int] = set()
    tensors = {}
    for k, v in state_dict.items():
        v = v.detach()
        ptr = v.untyped_storage().data_ptr() if v.numel() else None
        if ptr is not None and ptr in seen:
            v = v.clone()
        if ptr is not None:
            seen.add(ptr)
        tensors[k] = v.contiguous().cpu()
    return tensors


def _is_hf_model(model) -> bool:
    return callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config")


def save_weights(state_dict: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str = "5GB",
                 model=None) -> None:
    """``directory/model.safetensors``, or shards + ``model.safetensors.index.json`` above
    ``max_shard_size``. A Hugging Face ``PreTrainedModel`` is written by its own
    ``save_pretrained`` (same file names, plus config.json) so ``from_pretrained`` loads it."""
    limit = parse_size(max_shard_size)
    if model is not None and _is_hf_model(model):
        model.save_pretrained(directory, state_dict=state_dict, max_shard_size=limit)
        return
    from safetensors.torch import save_file

    tensors = _untie(state_dict)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(directory / WEIGHTS), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))


def plugin_states(loop) -> dict[str, Any]:
    """State of every plugin with ``state_dict``/``load_state_dict`` (JSON-serialisable)."""
    out = {}
    for name, plugin in loop.plugins.pm.list_name_plugin():
        if callable(getattr(plugin, "state_dict", None)) and callable(getattr(plugin, "load_state_dict", None)):
            try:
                state = plugin.state_dict()
                json.dumps(state)
            except Exception as e:
                raise PluginError(
                    f"Plugin {name!r} failed in state_dict() while a checkpoint was being saved: "
                    f"{type(e).__name__}: {e}. state_dict() must return JSON-serialisable data. "
                    "The previous checkpoints are untouched."
                ) from e
            out[name] = state
    return out


def _write_manifest(directory: Path) -> None:
    files = {p.relative_to(directory).as_posix(): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file()}
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(loop) -> Path:
    """Write ``output_dir/checkpoint-{global_step}`` atomically; rotate; fire ``on_save``."""
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
    try:
        if backend.is_main_process:
            save_weights(state_dict, tmp, loop.args.save_max_shard_size, backend.unwrap_model(loop.model))
            torch.save(loop.scheduler.state_dict(), tmp / "scheduler.pt")
            loop.config.write(tmp / "config.toml")
        backend.save_training_state(loop.optimizer, tmp)
        torch.save(_process_state(loop), tmp / f"rng_state_{backend.process_index}.pth")
        streaming.save_data_state(loop, tmp)  # data_state_{rank}.json: a streaming loader's position
        if backend.is_main_process:
            (tmp / "plugins.json").write_text(json.dumps(plugin_states(loop), indent=1))
            (tmp / "loop_state.json").write_text(json.dumps(s.to_dict(), indent=1))
    except BaseException:
        if backend.is_main_process:  # never leave half a checkpoint behind (it is never listed anyway)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    backend.wait_for_everyone()
    if backend.is_main_process:
        _fsync_tree(tmp)
        _write_manifest(tmp)
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. at the end): replace it whole
            old = output_dir / f".old-{PREFIX}{s.global_step}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(output_dir)
        rotate_checkpoints(loop, output_dir, keep=final)
    backend.wait_for_everyone()
    loop._fire("on_save", checkpoint_dir=final)
    return final


def _process_state(loop) -> dict[str, Any]:
    """This process's RNG states, and its unlogged loss window (so that the first log after a
    resume averages the same steps as an uninterrupted run would; one host sync, at save time)."""
    state = rng_state()
    window = getattr(loop, "_window", None)
    if window is not None and window[1]:
        loss, steps, samples, tokens = window
        state["log_window"] = {"loss": float(loss), "steps": steps, "samples": samples, "tokens": tokens}
    return state


def rotate_checkpoints(loop, output_dir: Path, keep: Path | None = None) -> list[Path]:
    """Keep ``save_total_limit`` checkpoints, oldest deleted first, never the best one, the
    newest one nor ``keep`` (the one just written). Returns the deleted folders."""
    limit = loop.args.save_total_limit
    if not limit:
        return []
    found = list_checkpoints(output_dir)
    protected = {found[-1].name} if found else set()
    if keep is not None:
        protected.add(keep.name)
    best = loop.state.best_model_checkpoint
    if best:
        protected.add(Path(best).name)
    removable = [p for p in found if p.name not in protected]
    excess = len(found) - max(limit, len(found) - len(removable))
    deleted = removable[: max(0, excess)]
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def keep_only_best(output_dir: Path, best: str | Path) -> list[Path]:
    """End of training with ``save_total_limit = 1`` and a best checkpoint (HF 5.x
    ``_finalize_training``): every other checkpoint is deleted, the best one stays. Returns
    the deleted folders."""
    deleted = [p for p in list_checkpoints(output_dir) if p.name != Path(best).name]
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def save_model(loop, directory: Path) -> None:
    """The final (or best) model: ``directory/model.safetensors`` (sharded above the limit)."""
    state_dict = loop.backend.model_state_dict(loop.model)
    if loop.backend.is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("model-*-of-*.safetensors"):  # shards of an earlier save
            old.unlink()
        save_weights(state_dict, directory, loop.args.save_max_shard_size,
                     loop.backend.unwrap_model(loop.model))
        sharded = any(directory.glob("model-*-of-*.safetensors"))
        stale = directory / (WEIGHTS if sharded else WEIGHTS_INDEX)
        if stale.exists():  # left by an earlier save of the other layout: it would shadow this one
            stale.unlink()
    loop.backend.wait_for_everyone()


# -- reading ------------------------------------------------------------------------------------


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"Checkpoint file {str(index)!r} is unreadable (truncated or corrupt?): {e}."
            ) from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(
                    f"Checkpoint {str(directory)!r}: shard {f.name!r}, named in {WEIGHTS_INDEX}, is missing."
                )
        return files, weight_map
    path = directory / WEIGHTS
    if not path.is_file():
        raise CheckpointError(
            f"Checkpoint {str(directory)!r} has no model weights ({WEIGHTS} or {WEIGHTS_INDEX})."
        )
    return [path], None


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors model in ``directory``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files, _ = _weight_files(directory)
    loaded: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            loaded.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} is unreadable (truncated or corrupt?): {e}."
            ) from None
    return loaded


def _weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes from the safetensors headers only (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    files, _ = _weight_files(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for k in f.keys():
                    shapes[k] = tuple(f.get_slice(k).get_shape())
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} is unreadable (truncated or corrupt?): {e}."
            ) from None
    return shapes


def _aliases(state_dict: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Key -> other keys sharing its storage (tied weights, which save_pretrained drops)."""
    by_ptr: dict[tuple[int, int], list[str]] = {}
    for k, v in state_dict.items():
        v = getattr(v, "_local_tensor", v)  # a sharded (FSDP2 DTensor) value: its local shard
        if v.numel():
            by_ptr.setdefault((v.untyped_storage().data_ptr(), v.storage_offset()), []).append(k)
    return {k: [o for o in group if o != k] for group in by_ptr.values() if len(group) > 1 for k in group}


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape (DeepSpeed ZeRO-3 keeps a 0-size placeholder, and ds_shape)."""
    return tuple(getattr(t, "ds_shape", None) or t.shape)


def check_shapes(model: torch.nn.Module, found: dict[str, tuple[int, ...]], where: str) -> list[str]:
    """Raise a CheckpointError naming every mismatch; returns keys to fill from their alias."""
    expected = model.state_dict()
    expected.update({n: p for n, p in model.named_parameters() if hasattr(p, "ds_shape")})  # ZeRO-3
    aliases = _aliases(expected)
    fill = [k for k in expected if k not in found and any(a in found for a in aliases.get(k, ()))]
    missing = sorted(set(expected) - set(found) - set(fill))
    unexpected = sorted(set(found) - set(expected))
    wrong = [
        f"{k}: checkpoint {tuple(found[k])} vs model {_shape(expected[k])}"
        for k in expected if k in found and tuple(found[k]) != _shape(expected[k])
    ]
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            parts.append(f"{len(wrong)} shape mismatches: " + "; ".join(wrong[:5]))
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:5]}")
        if unexpected:
            parts.append(f"not in the model: {unexpected[:5]}")
        raise CheckpointError(
            f"Checkpoint {where!r} does not match the model ({', '.join(parts)}). It was saved from "
            "another model (config); resume with the model config it was trained with, or start a "
            "new run in another train.output_dir."
        )
    return fill


def _is_adapter_checkpoint(model, directory: Path) -> bool:
    return (directory / "adapter_model.safetensors").is_file() and callable(getattr(model, "load_adapter", None))


def load_weights(loop, directory: Path) -> None:
    model = loop.backend.unwrap_model(loop.model)
    if _is_adapter_checkpoint(model, directory):
        # A PEFT model (corelooper-peft) saves only its adapter; load it in place, as HF Trainer does.
        model.load_adapter(str(directory), getattr(model, "active_adapter", "default"), is_trainable=True)
        return
    loaded = read_weights(directory)
    fill = check_shapes(model, {k: tuple(v.shape) for k, v in loaded.items()}, str(directory))
    aliases = _aliases(model.state_dict())
    for k in fill:  # tied weights: the saved twin holds the values
        loaded[k] = loaded[next(a for a in aliases[k] if a in loaded)]
    loop.backend.load_model_state_dict(loop.model, loaded)


def load_model(loop, directory: Path) -> None:
    load_weights(loop, directory)


def _read(path: Path, what: str):
    if not path.is_file():
        raise CheckpointError(f"Checkpoint file {str(path)!r} is missing ({what}).")
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text())
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} ({what}) is unreadable (truncated or corrupt?): "
            f"{type(e).__name__}: {e}"
        ) from None


def verify(loop, directory: Path) -> dict[str, Any]:
    """Check a checkpoint before anything is changed: every file of its manifest present with
    its size, the same model config, matching weight names and shapes. Returns its loop state."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"Checkpoint {str(directory)!r} is incomplete: it has no {MANIFEST} (written last by "
            "every complete save). Resume from an earlier checkpoint."
        )
    manifest = _read(manifest_path, "list of files")
    for name, size in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file {str(path)!r} is missing (listed in {MANIFEST}).")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} is {actual} bytes, but {size} were written: it was "
                "truncated or changed after the save. Resume from another checkpoint."
            )
    state = _read(directory / "loop_state.json", "loop state")
    _check_same_model_config(loop, directory)
    model = loop.backend.unwrap_model(loop.model) if loop.backend else loop.model
    if not _is_adapter_checkpoint(model, directory):  # peft checks its adapter's shapes itself
        check_shapes(model, _weight_shapes(directory), str(directory))
    return state


def _check_same_model_config(loop, directory: Path) -> None:
    """An output_dir of another run: its [model] section differs from this config's."""
    path = directory / "config.toml"
    if not path.is_file() or not loop.config.model.factory:
        return
    from .config import tomllib  # tomli on Python 3.10

    try:
        saved = tomllib.loads(path.read_text()).get("model", {})
    except tomllib.TOMLDecodeError as e:
        raise CheckpointError(f"Checkpoint file {str(path)!r} is unreadable: {e}.") from None
    mine = {"factory": loop.config.model.factory, "args": loop.config.model.args}
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {v!r}"
             for k, v in mine.items() if saved.get(k, {} if k == "args" else None) != v]
    if diffs:
        raise CheckpointError(
            f"Checkpoint {str(directory)!r} belongs to a different run ({'; '.join(diffs)}). Resume "
            "with the config it was trained with, or choose another train.output_dir."
        )


def load_checkpoint(loop, directory: Path) -> None:
    """Restore model, optimizer, scheduler, RNG, loop and plugin state from ``directory``."""
    backend, s = loop.backend, loop.state
    state = verify(loop, directory)
    plugins = _read(directory / "plugins.json", "plugin states")
    scheduler = _read(directory / "scheduler.pt", "scheduler state")
    rng_path = directory / f"rng_state_{backend.process_index}.pth"
    rng = _read(rng_path, "RNG state") if rng_path.exists() or state.get("world_size", 1) == s.world_size else None
    _warn_if_not_exact(loop, state)
    load_weights(loop, directory)
    try:
        backend.load_training_state(loop.optimizer, directory)
    except FileNotFoundError as e:
        missing = e.filename or directory
        raise CheckpointError(
            f"Checkpoint file {str(missing)!r} is missing (optimizer state). Resume from another "
            "checkpoint."
        ) from None
    except (RuntimeError, ValueError, EOFError, KeyError) as e:
        where = directory / "optimizer.pt" if (directory / "optimizer.pt").exists() else directory
        raise CheckpointError(
            f"Checkpoint file {str(where)!r} (optimizer state) is unreadable (truncated, or from "
            f"another optimizer?): {type(e).__name__}: {e}"
        ) from None
    loop.scheduler.load_state_dict(scheduler)
    if rng is not None:
        set_rng_state(rng)
        loop._resumed_window = rng.get("log_window")
    streaming.load_data_state(loop, directory)  # a streaming loader's position (or a warning)
    restored = LoopState.from_dict(state)
    for key in ("global_step", "epoch", "step_in_epoch", "micro_batches_in_epoch", "log_history",
                "best_metric", "best_global_step", "best_model_checkpoint",
                "num_input_tokens_seen", "total_samples_seen"):
        setattr(s, key, getattr(restored, key))
    s.plugin_states = plugins
    for name, plugin in loop.plugins.pm.list_name_plugin():
        if name in plugins and callable(getattr(plugin, "load_state_dict", None)):
            try:
                plugin.load_state_dict(plugins[name])
            except Exception as e:
                raise PluginError(
                    f"Plugin {name!r} failed in load_state_dict() restoring {str(directory)!r}: "
                    f"{type(e).__name__}: {e}."
                ) from e
    loop._fire("on_load_checkpoint", checkpoint_dir=directory)


def _warn_if_not_exact(loop, state: dict[str, Any]) -> None:
    """A resume with another batch geometry continues, but cannot repeat the same batches."""
    s = loop.state
    changed = [
        f"{k} {state[k]} -> {v}" for k, v in (
            ("world_size", s.world_size), ("train_batch_size", s.train_batch_size),
            ("gradient_accumulation_steps", s.gradient_accumulation_steps),
        ) if k in state and state[k] != v
    ]
    if changed:
        import warnings

        warnings.warn(
            f"Resuming with a different batch geometry ({', '.join(changed)}): training continues "
            "from the checkpoint, but not with the batches an uninterrupted run would have seen.",
            stacklevel=3,
        )
