"""Resuming the drop-in ``Trainer`` from a checkpoint ``transformers.Trainer`` wrote: a run moves over
mid-training.

``read`` takes everything from the folder into memory before the run starts (weights from
``model.safetensors`` — or ``pytorch_model.bin`` — optimizer, scheduler, this process's RNG and
``trainer_state.json``), every ``.pt``/``.pth``/``.bin`` file with ``torch.load(weights_only=True)``
(numpy's RNG arrays allowed, as HF allows them); ``training_args.bin`` is a pickle and is never
opened. ``HFCheckpoint.restore(loop)`` puts it into the run when ``train()`` begins, as HF's loop
does: then training continues at HF's step, epoch and position in the epoch, with HF's history,
best metric and (``restore_callback_states_from_checkpoint``) callback states.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from corelooper.errors import CheckpointError

# LoopState fields trainer_state.json holds under the same name.
STATE_FIELDS = (
    "global_step",
    "epoch",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
    "num_input_tokens_seen",
)


def is_hf_checkpoint(path: str | Path) -> bool:
    """A folder ``transformers.Trainer`` wrote: its ``trainer_state.json``, no corelooper manifest."""
    from corelooper.checkpoints.manifest import MANIFEST

    folder = Path(path)
    return (folder / "trainer_state.json").is_file() and not (folder / MANIFEST).is_file()


@dataclass
class HFCheckpoint:
    folder: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict | None
    scheduler: dict | None
    rng: dict | None
    trainer_state: dict[str, Any]

    def restore(self, loop, trainer) -> None:
        """Optimizer, scheduler, RNG and the loop's position (``on_train_begin``; the weights
        were loaded before the backend prepared the model)."""
        if self.optimizer is not None:
            loop.optimizer.load_state_dict(self.optimizer)
        if self.scheduler is not None:
            loop.scheduler.load_state_dict(self.scheduler)
        if self.rng is not None:
            _set_rng(self.rng)
        state, saved = loop.state, self.trainer_state
        for name in STATE_FIELDS:
            if saved.get(name) is not None:
                setattr(state, name, saved[name])
        if state.steps_per_epoch:  # HF's position: whole epochs done, then steps into this one
            state.step_in_epoch = state.global_step % state.steps_per_epoch
            state.micro_batches_in_epoch = state.step_in_epoch * loop.args.gradient_accumulation_steps
        trainer.state.total_flos = saved.get("total_flos", 0.0)
        trainer.state.log_history = list(saved.get("log_history", []))
        if getattr(trainer.args, "restore_callback_states_from_checkpoint", False):
            from .bridge import StatefulCallbacks

            StatefulCallbacks(trainer.bridge).load_state_dict(saved.get("stateful_callbacks", {}))


def read(folder: str | Path, process_index: int, world_size: int) -> HFCheckpoint:
    """Everything a resume needs from an HF checkpoint folder, in memory; one paragraph when a
    file is missing or unreadable."""
    folder = Path(folder)
    try:
        trainer_state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{folder}/trainer_state.json cannot be read ({e}): not a usable HF checkpoint."
        ) from None
    rng_name = f"rng_state_{process_index}.pth" if world_size > 1 else "rng_state.pth"
    return HFCheckpoint(
        folder=folder,
        weights=_weights(folder),
        optimizer=_load(folder / "optimizer.pt"),
        scheduler=_load(folder / "scheduler.pt"),
        rng=_load(folder / rng_name),
        trainer_state=trainer_state,
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    shards = sorted(folder.glob("model*.safetensors"))
    if shards:
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            weights.update(load_file(str(shard)))
        return weights
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        weights = {}
        for shard in bins:
            weights.update(_load(shard))
        return weights
    adapter = folder / "adapter_model.safetensors"
    if adapter.is_file():
        return load_file(str(adapter))
    raise CheckpointError(
        f"{folder} holds no weights (model.safetensors, pytorch_model.bin or adapter_model.safetensors): "
        "not a complete HF checkpoint. Resume from another checkpoint-N of that run."
    )


def _load(path: Path):
    """``torch.load(weights_only=True)``, with numpy's RNG arrays allowed (as HF's ``safe_globals``)."""
    if not path.is_file():
        return None
    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle of anything else is refused: never unpickled
        raise CheckpointError(
            f"{path} cannot be read with torch.load(weights_only=True) ({type(e).__name__}: {e}); corelooper "
            "never unpickles arbitrary objects from a checkpoint. Resume from a checkpoint without it."
        ) from None


def _set_rng(saved: dict) -> None:
    import numpy as np

    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.random.set_rng_state(saved["cpu"])
    cuda = saved.get("cuda")
    if cuda is not None and torch.cuda.is_available():  # all devices' states, or this one's
        if isinstance(cuda, (list, tuple)):
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            torch.cuda.random.set_rng_state(cuda)


def load_weights(model, weights: dict[str, torch.Tensor], folder: Path) -> None:
    """The checkpoint's weights into ``model`` (a PEFT model: its adapter's); tied weights HF did
    not write may be missing, nothing else."""
    if hasattr(model, "peft_config") and not any(k.startswith("base_model.") for k in weights):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, weights)
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied and not any(k.endswith(t) for t in tied)]
    if missing or unexpected:
        raise CheckpointError(
            f"The weights in {folder} do not fit this model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}. Resume with the model that run trained (the same class and config)."
        )
