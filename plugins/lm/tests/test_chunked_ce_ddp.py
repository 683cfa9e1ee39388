"""The chunked loss under real DDP (torchrun, 2 CPU ranks, gloo): an HF Llama trained with
``[lm] loss = "chunked"`` and GA 2 on 2 ranks matches one process with 2x the batch that uses the
model's own (HF) loss. The output layer's weight is used outside the DDP-wrapped forward: its
gradient must still be averaged over the ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import distributed_worker as dw  # noqa: E402


@pytest.mark.slow
@pytest.mark.distributed
def test_chunked_loss_under_ddp_matches_one_process_with_hf_loss(tmp_path):
    train = {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "max_grad_norm": 1.0,
        "output_dir": str(tmp_path / "ddp"),
    }
    run = {"task": "llama", "n_train": 24, "train": train, "sections": {"lm": {"loss": "chunked"}}}
    # the second run proves the setting reaches the ranks' loss: a model that is no HF LM is refused
    refused = {
        "task": "lm",
        "expect_error": True,
        "train": {**train, "output_dir": str(tmp_path / "refused")},
        "sections": {"lm": {"loss": "chunked"}},
    }
    by_rank, errors = dw.torchrun([dict(run), refused], tmp_path)
    for rank in (0, 1):
        assert "ConfigError: lm.loss = 'chunked' needs a Hugging Face causal LM" in errors[rank]["error"]
    ref = dw.run_one(
        {
            **run,
            "sections": {},
            "train": {**train, "per_device_train_batch_size": 4, "output_dir": str(tmp_path / "one")},
        }
    )
    r0, r1 = by_rank[0], by_rank[1]
    assert r0["world_size"] == 2 and r0["wrapped"] == "DistributedDataParallel"
    assert torch.equal(torch.tensor(r0["local_params"]), torch.tensor(r1["local_params"]))  # ranks agree
    assert r0["losses"].keys() == ref["losses"].keys() and len(ref["losses"]) == 3
    for step, loss in ref["losses"].items():
        assert abs(r0["losses"][step] - loss) <= 1e-5, step
    diff = (torch.tensor(r0["local_params"]) - torch.tensor(ref["local_params"])).abs().max().item()
    assert diff <= 1e-5, f"final weights differ by {diff}"
    assert abs(r0["metrics"]["eval_loss"] - ref["metrics"]["eval_loss"]) <= 1e-5
    torch.manual_seed(0)
    init = torch.cat([p.detach().reshape(-1) for p in dw.tiny_llama().parameters()])
    assert (torch.tensor(ref["local_params"]) - init).abs().max().item() > 1e-3  # it trained
