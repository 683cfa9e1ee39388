"""corelooper-deepspeed: ZeRO 1/2/3 on 2 real CPU processes (torchrun, gloo) against one plain
process; save, stop, resume; offload; config mapping and refusals.

One torchrun job runs every 2-rank scenario; the references run in the test process.
DeepSpeed's JIT-built ops are avoided (plain torch AdamW, no shm comm build).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
import distributed_worker as dw  # noqa: E402

TRAIN = {
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_grad_norm": 0.5,
    "max_steps": 5,
    "save_strategy": "steps",
    "save_steps": 2,
}
STAGES = (1, 2, 3)


def close(a, b, tol=1e-5) -> float:
    diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
    assert diff <= tol, f"differ by {diff}"
    return diff


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds")
    (tmp / "ds.json").write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_clipping": "auto",
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            }
        )
    )
    (tmp / "bad.json").write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    runs = []
    for stage in STAGES:
        runs.append(
            {
                "task": "lm",
                "sections": {"deepspeed": {"zero_stage": stage}},
                "train": {**TRAIN, "output_dir": str(tmp / f"zero{stage}")},
            }
        )
    for stage in STAGES:
        runs.append(
            {
                "task": "lm",
                "sections": {"deepspeed": {"zero_stage": stage}},
                "resume": str(tmp / f"zero{stage}" / "checkpoint-2"),
                "train": {**TRAIN, "output_dir": str(tmp / f"zero{stage}_resumed")},
            }
        )
    runs += [
        # ZeRO-Offload (optimizer state in CPU memory) with a plain torch optimizer
        {
            "task": "lm",
            "sections": {"deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"}},
            "train": {**TRAIN, "save_strategy": "no", "output_dir": str(tmp / "offload")},
        },
        # a DeepSpeed JSON file with "auto" values
        {
            "task": "lm",
            "sections": {"deepspeed": {"config": str(tmp / "ds.json")}},
            "train": {**TRAIN, "save_strategy": "no", "output_dir": str(tmp / "json")},
        },
        {
            "task": "lm",
            "sections": {"deepspeed": {"zero_stage": 3}},
            "eval_only": True,
            "train": {"output_dir": str(tmp / "eval")},
        },
        {
            "expect_error": True,
            "sections": {"deepspeed": {"config": str(tmp / "bad.json")}},
            "train": {"max_steps": 1, "output_dir": str(tmp / "bad")},
        },
    ]
    return tmp, runs, dw.torchrun([dict(r) for r in runs], tmp, timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    train = {**TRAIN, "per_device_train_batch_size": 4, "save_strategy": "no", "output_dir": str(out)}
    return dw.run_one({"task": "lm", "train": train})


def assert_matches(result, ref):
    assert result["losses"].keys() == ref["losses"].keys()
    close(list(result["losses"].values()), list(ref["losses"].values()))
    close(list(result["grad_norms"].values()), list(ref["grad_norms"].values()))
    close(result["full_params"], ref["full_params"])
    close([result["metrics"]["eval_loss"]], [ref["metrics"]["eval_loss"]])
    assert result["metrics"]["eval_num_predictions"] == 13


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_matches_one_process(ds_runs, reference, stage):
    _, _, results = ds_runs
    r0, r1 = results[STAGES.index(stage)][0], results[STAGES.index(stage)][1]
    assert r0["backend"] == "DeepSpeedBackend" and r0["wrapped"] == "DeepSpeedEngine"
    assert r0["world_size"] == 2
    assert reference["backend"] in ("LocalBackend", "AccelerateBackend")  # the builtin
    assert_matches(r0, reference)
    if stage == 3:  # parameters really partitioned: each rank holds about half
        assert len(r0["local_params"]) < len(r0["full_params"])
    else:
        assert r0["local_params"] == r1["local_params"]


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_resume_is_exact(ds_runs, stage):
    tmp, _, results = ds_runs
    full, resumed = results[STAGES.index(stage)], results[3 + STAGES.index(stage)]
    assert resumed[0]["global_step"] == 5
    for step in ("3", "4", "5"):
        assert resumed[0]["losses"][step] == full[0]["losses"][step]
    assert resumed[0]["full_params"] == full[0]["full_params"]
    ckpt = tmp / f"zero{stage}" / "checkpoint-2"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "deepspeed" / "state").is_dir()
    optim_shards = sorted(p.name for p in (ckpt / "deepspeed" / "state").glob("*optim_states.pt"))
    assert len(optim_shards) == 2, optim_shards  # one optimizer partition per rank


@pytest.mark.distributed
def test_exported_model_is_consolidated(ds_runs):
    from safetensors.torch import load_file

    tmp, _, results = ds_runs
    full = load_file(str(tmp / "zero3" / "model.safetensors"))
    model = dw.TinyLM()
    model.load_state_dict(full)  # every tensor whole, not a ZeRO-3 partition
    close(torch.cat([full[k].reshape(-1) for k in sorted(full)]).tolist(), results[2][0]["full_params"], 0)


@pytest.mark.distributed
def test_offload_and_json_config_match(ds_runs, reference):
    _, _, results = ds_runs
    assert_matches(results[6][0], reference)
    assert_matches(results[7][0], reference)


@pytest.mark.distributed
def test_json_optimizer_section_is_refused(ds_runs):
    error = ds_runs[2][9][0]["error"]
    assert error and "bad.json" in error and "'optimizer'" in error and "remove it" in error


@pytest.mark.distributed
def test_zero3_evaluation_without_training(ds_runs, tmp_path):
    got = ds_runs[2][8][0]
    ref = dw.run_one({"task": "lm", "eval_only": True, "train": {"output_dir": str(tmp_path)}})
    assert got["backend"] == "DeepSpeedBackend"
    assert got["metrics"]["eval_num_predictions"] == 13
    close([got["metrics"]["eval_loss"]], [ref["metrics"]["eval_loss"]])


def test_config_mapping_never_leaves_deepspeed_defaults():
    from corelooper_deepspeed import DEFAULTS, ds_config

    args = SimpleNamespace(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        max_grad_norm=0.0,
        mixed_precision="bf16",
    )
    cfg = ds_config.build(args, dict(DEFAULTS), world_size=2, on_cuda=False)
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed's default would be 1.0
    assert cfg["train_batch_size"] == 24 and cfg["gradient_accumulation_steps"] == 3
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    args.max_grad_norm = 0.7
    assert ds_config.build(args, dict(DEFAULTS), 2, False)["gradient_clipping"] == 0.7
    from corelooper.errors import ConfigError

    with pytest.raises(ConfigError, match="offload_param.*zero_stage = 3"):
        ds_config.build(args, {**DEFAULTS, "offload_param": "cpu"}, 2, False)


def test_deepspeed_is_inert_without_its_section(tmp_path):
    ref = dw.run_one(
        {
            "train": {"per_device_train_batch_size": 8, "max_steps": 1, "output_dir": str(tmp_path / "o")},
            "evaluate": False,
        }
    )
    assert ref["backend"] in ("LocalBackend", "AccelerateBackend")  # the builtin


def test_plugin_import_does_not_import_deepspeed():
    import subprocess

    code = "import sys, corelooper_deepspeed, corelooper_fsdp; print('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


class Payload:
    """Unpickling this runs ``touch MARKER``: the payload a hostile checkpoint would carry."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_payload_in_each_state_file_never_runs(ds_runs, tmp_path):
    """DeepSpeed's own loader is torch.load(weights_only=False); the plugin swaps in a
    weights_only engine. A payload planted in each .pt file of a ZeRO-2 checkpoint (manifest
    rewritten to agree) must be refused on both ranks without running."""
    import shutil

    from corelooper.checkpoints.manifest import write_manifest

    tmp, _, _ = ds_runs
    source = tmp / "zero2" / "checkpoint-2"
    marker = tmp_path / "PWNED"
    names = sorted(p.name for p in (source / "deepspeed" / "state").glob("*.pt"))
    assert len(names) == 3
    runs = []
    for i, name in enumerate(names):
        ckpt = tmp_path / f"run{i}" / "checkpoint-2"
        shutil.copytree(source, ckpt)
        torch.save({"module": Payload(str(marker))}, ckpt / "deepspeed" / "state" / name)
        write_manifest(ckpt)
        runs.append(
            {
                "task": "lm",
                "sections": {"deepspeed": {"zero_stage": 2}},
                "expect_error": True,
                "resume": str(ckpt),
                "train": {**TRAIN, "output_dir": str(ckpt.parent)},
            }
        )
    results = dw.torchrun(runs, tmp_path, timeout=300)
    assert not marker.exists(), "a planted payload ran"
    for name, result in zip(names, results, strict=True):
        errors = [result[r]["error"] for r in (0, 1)]
        assert any(e and "refused without running it" in e for e in errors), (name, errors)
