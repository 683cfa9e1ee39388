"""``torch.distributed.checkpoint`` without unpickling anything but DCP's own metadata.

DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``, and its
``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)`` on every non-tensor
item: a planted payload would run on every rank at resume. ``SafeReader`` reads ``.metadata``
with an unpickler that resolves only DCP's metadata classes (an explicit list) and the torch/pathlib types they
hold (Size, dtypes, layouts, memory formats), and refuses every other global, naming it;
``SafeLoadPlanner`` loads the byte items with ``weights_only=True``. The tensor data itself is
already read with ``weights_only=True`` by DCP. The format on disk stays DCP's, so resharding
(resuming with another number of processes) keeps working.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from corelooper.errors import CheckpointError

# The classes a DCP ``.metadata`` pickle holds, by name: not "any class of DCP's modules", which
# would admit Path, Future, FileSystemWriter and whatever else those modules import.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = {
    *(
        (_DCP_METADATA, n)
        for n in (
            "Metadata",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
_ALLOWED = {
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("torch.serialization", "_get_layout"),
}  # how TensorProperties pickles a layout


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} is not DCP metadata ({type(e).__name__}: {e}): refused "
            "without running it. Resume from another checkpoint."
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} holds a {type(metadata).__name__}, not DCP metadata."
        )
    return metadata


class SafeReader(FileSystemReader):
    """A FileSystemReader whose ``.metadata`` goes through the restricted unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_dcp_metadata(path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner with ``weights_only=True`` for the non-tensor items (param_groups, ...)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"A non-tensor item ({read_item.dest_index.fqn}) of the FSDP state holds an object "
                f"weights_only loading refuses ({e}): refused without running it."
            ) from None
        value = io.BytesIO()
        torch.save(obj, value)  # hand DefaultLoadPlanner an already-checked item
        value.seek(0)
        super().load_bytes(read_item, value)
