"""DeepSpeed checkpoints read with ``torch.load(weights_only=True)``.

DeepSpeed's ``TorchCheckpointEngine.load`` calls ``torch.load(weights_only=False)`` on the
module and optimizer files of a checkpoint: a planted payload would run on every rank at
resume. ``SafeCheckpointEngine`` loads them with ``weights_only=True``, allowing only the few
DeepSpeed and torch types those files hold (listed in ``ALLOWED``: enums and plain state
containers, no callables), so anything else is refused with the file named.
"""

from __future__ import annotations

import pickle

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from corelooper.errors import CheckpointError


def allowed_globals() -> list:
    """The non-tensor types a DeepSpeed 0.19 ZeRO 0-3 checkpoint (corelooper's use) pickles."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaleProfile

        allowed.append(LossScaleProfile)
    except ImportError:
        pass
    return allowed


def load(path, map_location=None, mmap: bool = False):
    """``torch.load(weights_only=True)`` with ``ALLOWED``'s types; anything else is refused with
    the file named (``mmap``: tensor data is read when used, not up front)."""
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).split("WeightsUnpickler error:", 1)[-1].strip().splitlines()[0][:200]
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} holds an object that weights_only loading refuses "
            f"({first}): refused without running it. Resume from another checkpoint."
        ) from None


class SafeCheckpointEngine(TorchCheckpointEngine):
    """TorchCheckpointEngine whose ``load`` never unpickles an arbitrary object."""

    def load(self, path: str, map_location=None):
        return load(path, map_location=map_location)


def check_state_files(state_dir) -> None:
    """Every rank checks every ``.pt`` file of the DeepSpeed state before DeepSpeed reads any
    (``mmap``: only the pickled structure is read, not the tensor data), so a refused file
    stops all ranks alike, before a collective one of them would never reach."""
    from pathlib import Path

    for path in sorted(Path(state_dir).rglob("*.pt")):
        try:
            load(path, map_location="cpu", mmap=True)  # a refused file raises, naming it
        except RuntimeError as e:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} is unreadable (truncated or corrupt?): {e}"
            ) from None
