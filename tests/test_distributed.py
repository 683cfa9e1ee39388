"""Real multi-process DDP on CPU (gloo, torchrun, 2 ranks) against one process with 2x the batch.

One torchrun job runs every distributed scenario of this file (start-up is the costly part);
the one-process references run in the test process itself.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import distributed_worker as dw  # noqa: E402


def params(result) -> torch.Tensor:
    return torch.tensor(result["local_params"], dtype=torch.float64)


def assert_close_losses(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert got.keys() == want.keys(), (got, want)
    for step in want:
        assert abs(got[step] - want[step]) <= tol, f"step {step}: {got[step]} vs {want[step]}"


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    runs = [
        # 2 ranks x batch 4 (reference: 1 x batch 8); 48 samples: 6 steps, one epoch
        {"train": {"per_device_train_batch_size": 4, "max_steps": 6, "output_dir": str(tmp / "plain")}},
        # GA 2 on variable-length sequences with -100 padding, clipping on
        {
            "task": "lm",
            "train": {
                "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "max_steps": 5,
                "max_grad_norm": 0.5,
                "output_dir": str(tmp / "lm"),
            },
        },
        # with dropout (per-rank RNG), checkpoints every 3 steps, then a resume from step 3
        {
            "dropout": 0.2,
            "train": {
                "per_device_train_batch_size": 4,
                "max_steps": 8,
                "save_strategy": "steps",
                "save_steps": 3,
                "num_train_epochs": 2,
                "output_dir": str(tmp / "full"),
            },
        },
        {
            "dropout": 0.2,
            "resume": str(tmp / "full" / "checkpoint-3"),
            "train": {
                "per_device_train_batch_size": 4,
                "max_steps": 8,
                "save_strategy": "steps",
                "save_steps": 3,
                "num_train_epochs": 2,
                "output_dir": str(tmp / "resumed"),
            },
        },
        # evaluate() before train() must not leave the model unwrapped (each rank on its own)
        {
            "evaluate_first": True,
            "train": {
                "per_device_train_batch_size": 4,
                "max_steps": 6,
                "output_dir": str(tmp / "eval_first"),
            },
        },
    ]
    return tmp, runs, dw.torchrun([dict(r) for r in runs], tmp)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_is_really_distributed_and_ranks_agree(ddp_runs):
    _, _, results = ddp_runs
    for by_rank in results:
        r0, r1 = by_rank[0], by_rank[1]
        assert r0["world_size"] == r1["world_size"] == 2
        assert r0["wrapped"] == "DistributedDataParallel"
        assert torch.equal(params(r0), params(r1)), "ranks drifted apart: not really DDP"
        assert r0["losses"] == r1["losses"]


@pytest.mark.distributed
def test_ddp_matches_one_process_with_twice_the_batch(ddp_runs, tmp_path):
    _, runs, results = ddp_runs
    for run, by_rank in zip(runs[:2], results[:2], strict=True):
        ref_train = dict(run["train"], output_dir=str(tmp_path / run.get("task", "c")))
        ref_train["per_device_train_batch_size"] *= 2
        ref = dw.run_one({**run, "train": ref_train})
        assert ref["world_size"] == 1
        assert_close_losses(by_rank[0]["losses"], ref["losses"])
        assert len(ref["losses"]) == run["train"]["max_steps"]
        if "max_grad_norm" in run["train"]:
            for step, norm in ref["grad_norms"].items():
                assert abs(by_rank[0]["grad_norms"][step] - norm) <= 1e-5
        diff = (params(by_rank[0]) - params(ref)).abs().max().item()
        assert diff <= 1e-5, f"final weights differ by {diff}"
        # evaluation: the whole eval set once (13 samples: uneven over 2 ranks), same loss
        assert by_rank[0]["metrics"]["eval_num_predictions"] == 13
        assert abs(by_rank[0]["metrics"]["eval_loss"] - ref["metrics"]["eval_loss"]) <= 1e-5
        assert by_rank[0]["metrics"] == by_rank[1]["metrics"]


@pytest.mark.distributed
def test_ddp_resume_is_exact(ddp_runs):
    tmp, _, results = ddp_runs
    full, resumed = results[2], results[3]
    ckpt = tmp / "full" / "checkpoint-3"
    assert sorted(p.name for p in ckpt.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert resumed[0]["global_step"] == 8
    for step in ("4", "5", "6", "7", "8"):
        assert resumed[0]["losses"][step] == full[0]["losses"][step]
    for r in (0, 1):
        assert torch.equal(params(resumed[r]), params(full[r]))


@pytest.mark.distributed
def test_ddp_evaluate_before_train_still_trains_distributed(ddp_runs):
    _, _, results = ddp_runs
    plain, eval_first = results[0], results[4]
    assert eval_first[0]["wrapped"] == "DistributedDataParallel"
    assert eval_first[0]["losses"] == plain[0]["losses"]
    assert torch.equal(params(eval_first[0]), params(plain[0]))


@pytest.mark.distributed
def test_only_main_process_writes(ddp_runs):
    tmp, _, _ = ddp_runs
    lines = [json.loads(x) for x in (tmp / "full" / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if "loss" in x and "train_runtime" not in x]
    assert steps == list(range(1, 9)), "metrics.jsonl has lines from more than one rank"
    assert (tmp / "full" / "model.safetensors").is_file()
