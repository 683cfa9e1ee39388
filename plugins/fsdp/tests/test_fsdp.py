"""corelooper-fsdp on 2 real CPU processes (torchrun, gloo) against one plain process.

One torchrun job runs every 2-rank scenario (start-up is the costly part); the references run
in the test process with the builtin backend (no [fsdp] section).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
import distributed_worker as dw  # noqa: E402

WRAP = {"fsdp": {"wrap": ["Block"]}}
LM = {
    "fsdp": {
        "wrap": ["Block"],
        "activation_checkpointing": True,
        "reshard_after_forward": False,
        "cpu_offload": True,
    }
}
LM_TRAIN = {
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_grad_norm": 0.5,
    "max_steps": 5,
    "save_strategy": "steps",
    "save_steps": 2,
}


def close(a, b, tol=1e-5) -> float:
    diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
    assert diff <= tol, f"differ by {diff}"
    return diff


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    runs = [
        {
            "sections": WRAP,
            "train": {"per_device_train_batch_size": 4, "max_steps": 6, "output_dir": str(tmp / "plain")},
        },
        {"task": "lm", "sections": LM, "train": {**LM_TRAIN, "output_dir": str(tmp / "lm")}},
        {
            "task": "lm",
            "sections": LM,
            "resume": str(tmp / "lm" / "checkpoint-2"),
            "train": {**LM_TRAIN, "output_dir": str(tmp / "lm_resumed")},
        },
        {
            "task": "lm",
            "sections": WRAP,
            "evaluate": False,
            "train": {
                **LM_TRAIN,
                "mixed_precision": "bf16",
                "max_steps": 3,
                "save_strategy": "no",
                "output_dir": str(tmp / "bf16"),
            },
        },
        {"task": "lm", "sections": WRAP, "eval_only": True, "train": {"output_dir": str(tmp / "eval")}},
        {
            "expect_error": True,
            "sections": {"fsdp": {"wrap": ["Blokc"]}},
            "train": {"max_steps": 1, "output_dir": str(tmp / "bad")},
        },
    ]
    return tmp, runs, dw.torchrun([dict(r) for r in runs], tmp)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_shards_and_matches_one_process(fsdp_runs, tmp_path):
    tmp, runs, results = fsdp_runs
    for run, by_rank in zip(runs[:2], results[:2], strict=True):
        r0, r1 = by_rank[0], by_rank[1]
        assert r0["backend"] == "FSDPBackend" and r0["wrapped"].startswith("FSDP")
        assert r0["world_size"] == 2
        n_full = len(r0["full_params"])
        # every rank holds a shard, not a replica
        assert len(r0["local_params"]) + len(r1["local_params"]) == n_full
        assert len(r0["local_params"]) < n_full
        train = dict(run["train"], output_dir=str(tmp_path / run.get("task", "c")), save_strategy="no")
        train["per_device_train_batch_size"] *= 2
        ref = dw.run_one({"task": run.get("task", "classify"), "train": train})
        assert ref["backend"] in ("LocalBackend", "AccelerateBackend")  # the builtin
        assert r0["losses"].keys() == ref["losses"].keys()
        close(list(r0["losses"].values()), list(ref["losses"].values()))
        if "max_grad_norm" in train:
            close(list(r0["grad_norms"].values()), list(ref["grad_norms"].values()))
        close(r0["full_params"], ref["full_params"])
        assert r0["metrics"]["eval_num_predictions"] == 13
        close([r0["metrics"]["eval_loss"]], [ref["metrics"]["eval_loss"]])


@pytest.mark.distributed
def test_fsdp_checkpoint_is_full_safetensors_plus_sharded_state(fsdp_runs):
    from safetensors.torch import load_file

    tmp, _, results = fsdp_runs
    ckpt = tmp / "lm" / "checkpoint-2"
    assert (ckpt / "fsdp_state" / ".metadata").is_file()
    assert sorted(p.name for p in (ckpt / "fsdp_state").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt / "optimizer.pt").exists()
    # the final model: one full safetensors file a plain (unsharded) model loads
    full = load_file(str(tmp / "lm" / "model.safetensors"))
    model = dw.TinyLM()
    model.load_state_dict(full)
    close(torch.cat([full[k].reshape(-1) for k in sorted(full)]).tolist(), results[1][0]["full_params"], 0)


@pytest.mark.distributed
def test_fsdp_resume_is_exact(fsdp_runs):
    _, _, results = fsdp_runs
    full, resumed = results[1][0], results[2][0]
    assert resumed["global_step"] == 5
    for step in ("3", "4", "5"):
        assert resumed["losses"][step] == full["losses"][step]
    assert resumed["full_params"] == full["full_params"]
    for r in (0, 1):
        assert results[2][r]["local_params"] == results[1][r]["local_params"]


@pytest.mark.distributed
def test_fsdp_bf16_trains_close_to_fp32(fsdp_runs):
    _, _, results = fsdp_runs
    bf16, fp32 = results[3][0]["losses"], results[1][0]["losses"]
    for step in ("1", "2", "3"):
        assert abs(bf16[step] - fp32[step]) < 0.05
    assert bf16 != {k: fp32[k] for k in bf16}, "bf16 compute had no effect"


@pytest.mark.distributed
def test_fsdp_wrap_names_a_missing_class(fsdp_runs):
    error = fsdp_runs[2][5][0]["error"]
    assert error and "fsdp.wrap" in error and "Blokc" in error and "Block" in error


@pytest.mark.distributed
def test_fsdp_evaluation_without_training(fsdp_runs, tmp_path):
    got = fsdp_runs[2][4][0]
    ref = dw.run_one({"task": "lm", "eval_only": True, "train": {"output_dir": str(tmp_path)}})
    assert got["backend"] == "FSDPBackend" and got["wrapped"].startswith("FSDP")
    assert got["metrics"]["eval_num_predictions"] == 13
    close([got["metrics"]["eval_loss"]], [ref["metrics"]["eval_loss"]])


def test_fsdp_is_inert_without_its_section(tmp_path):
    ref = dw.run_one(
        {
            "train": {"per_device_train_batch_size": 8, "max_steps": 1, "output_dir": str(tmp_path / "o")},
            "evaluate": False,
        }
    )
    assert ref["backend"] in ("LocalBackend", "AccelerateBackend")  # the builtin


@pytest.mark.slow
def test_fsdp_and_deepspeed_together_are_refused_by_the_core(tmp_path):
    """Neither plugin knows the other: the core refuses a second create_backend answer, naming
    both plugins and how to choose. (In a process of its own: both backends were built, and
    DeepSpeed's process group would outlive the test.)"""
    import subprocess

    spec = {"sections": {"fsdp": {}, "deepspeed": {}}, "train": {"max_steps": 1, "output_dir": str(tmp_path)}}
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); import distributed_worker as dw\n"
        "from corelooper.errors import ConfigError\n"
        f"try:\n    dw.run_one({spec!r})\nexcept ConfigError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    message = out.stdout
    assert "refused: Two plugins answer create_backend for this config: 'deepspeed' and 'fsdp'" in message, (
        out.stderr[-2000:]
    )
    assert "`-p no:fsdp` or `-p no:deepspeed`" in message and "([deepspeed] or [fsdp])" in message


class Payload:
    """Unpickling this runs ``touch MARKER``: the payload a hostile checkpoint would carry."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_payload_in_each_sharded_file_never_runs(fsdp_runs, tmp_path):
    """DCP unpickles .metadata and torch.load(weights_only=False)s byte items; the plugin's
    reader refuses every global but DCP's metadata classes. A payload is planted in each file of
    fsdp_state/ (the manifest rewritten to agree), and 2-rank resumes must refuse without running it."""
    import pickle
    import shutil

    from corelooper.checkpoints.manifest import write_manifest

    tmp, _, _ = fsdp_runs
    source = tmp / "lm" / "checkpoint-2"
    marker = tmp_path / "PWNED"
    runs, planted = [], []
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        out = tmp_path / name.strip("._")
        ckpt = out / "checkpoint-2"
        shutil.copytree(source, ckpt)
        (ckpt / "fsdp_state" / name).write_bytes(pickle.dumps(Payload(str(marker))))
        write_manifest(ckpt)
        planted.append(name)
        runs.append(
            {
                "task": "lm",
                "sections": LM,
                "expect_error": True,
                "resume": str(ckpt),
                "train": {**LM_TRAIN, "output_dir": str(out)},
            }
        )
    results = dw.torchrun(runs, tmp_path)
    assert not marker.exists(), "a planted payload ran"
    for name, result in zip(planted, results, strict=True):
        for rank in (0, 1):
            error = result[rank]["error"]
            assert error and error.startswith("CheckpointError"), (name, rank, error)
    assert "is not DCP metadata" in results[0][0]["error"] and "posix.system" in results[0][0]["error"]
