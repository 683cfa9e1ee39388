"""The restricted unpickler of DCP metadata admits DCP's metadata classes by name, nothing else
that DCP's modules happen to hold (Path, Future, FileSystemWriter, ...). One process, no launcher."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from corelooper_fsdp.safe_dcp import read_dcp_metadata
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from corelooper.errors import CheckpointError


def test_real_dcp_metadata_still_loads(tmp_path):
    state = {
        "model": {"w": torch.randn(3, 4), "b": torch.randn(4, dtype=torch.bfloat16)},
        "optim": {
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
            "state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 4)}},
        },
        "extra": b"bytes",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(tmp_path))
    metadata = read_dcp_metadata(tmp_path / ".metadata")
    assert isinstance(metadata, Metadata)
    assert (
        "model.w" in metadata.state_dict_metadata and "optim.state.w.exp_avg" in metadata.state_dict_metadata
    )


@pytest.mark.parametrize("name", ["FileSystemWriter", "Path", "Future", "FileSystemReader"])
def test_other_objects_of_dcp_modules_are_refused(tmp_path, name):
    """Inside a real Metadata (where the former module-wide rule let them through unnoticed)."""
    path = tmp_path / ".metadata"
    if name == "FileSystemWriter":
        path.write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, planner_data=FileSystemWriter)))
    else:  # a hand-written pickle naming the global as DCP's filesystem module holds it
        path.write_bytes(b"ctorch.distributed.checkpoint.filesystem\n" + name.encode() + b"\n.")
    with pytest.raises(CheckpointError) as info:
        read_dcp_metadata(path)
    assert f"global torch.distributed.checkpoint.filesystem.{name} is not part of DCP metadata" in str(
        info.value
    )
