"""Resume a ZeRO 1/2/3 checkpoint saved on N ranks on M ranks (or under another stage 1-3).

DeepSpeed's checkpoint holds one optimizer partition per rank (``*_optim_states.pt``), cut for
the world size it was saved with, and ``load_checkpoint`` reads only "its" partition: on another
world size it fails or loads the wrong slice. Here the partitions are merged into one
*consolidated* optimizer state and cut again for the running engine:

1. ``consolidate`` (rank 0, into a fresh folder ``<output_dir>/.tmp-elastic-<checkpoint>``; the
   saved checkpoint is only read): for every trainable parameter, by name, the full fp32 master
   weight and each optimizer state of its shape (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's
   ``momentum_buffer``, ...) as whole tensors, one safetensors file per key;
2. ``load_consolidated`` (every rank): creates the optimizer state of the new partitioning and
   copies each rank's slice of every full tensor into it; per-group hyperparameters (``lr``,
   ``betas``, ...) and per-group scalars (``step``) come from the saved rank-0 file.

Everything is read with ``safe_load.load`` (``weights_only``) or safetensors: nothing from a
checkpoint is unpickled beyond weights-only-safe types. Model weights come from the checkpoint's
``model.safetensors`` (loaded by the loop before this runs); the fp32 masters set here are the
exact ones (under bf16 the module holds rounded copies).

Layouts (DeepSpeed 0.19): ZeRO 1/2 keep one flat fp32 partition per parameter group per rank,
and ``param_slice_mappings`` says where each parameter's fragment lies in it; ZeRO-3 gives every
parameter ``ceil(numel / N)`` elements on each rank (padded at the end), parameters in order.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from corelooper.errors import CheckpointError

from .safe_load import load

FP32 = "fp32"  # the master weights, next to the optimizer state keys
META = "consolidated.json"  # written last: a folder without it is an unfinished conversion


def optim_files(state_dir: Path) -> list[Path]:
    """The per-rank optimizer partitions, in rank order (empty for ZeRO-0)."""
    files = list(Path(state_dir).glob("*_optim_states.pt"))
    return sorted(files, key=lambda p: int(p.name.split("_rank_")[1].split("_")[0]))


def saved_partitioning(state_dir: Path) -> tuple[int, int]:
    """``(zero_stage, world_size)`` a DeepSpeed checkpoint was saved with (ZeRO-0: ``(0, 0)``:
    its optimizer state is whole, any world size loads it)."""
    files = optim_files(state_dir)
    if not files:
        return 0, 0
    zero = load(files[0], map_location="cpu", mmap=True)["optimizer_state_dict"]
    count = zero.get("partition_count")  # ZeRO 1/2: one per parameter group
    if count is None:
        return int(zero["zero_stage"]), len(files)
    return int(zero["zero_stage"]), int(max(count) if isinstance(count, list) else count)


def _zero_state(shard: dict) -> tuple[dict, list[torch.Tensor]]:
    """A rank file's base optimizer state dict and its flat fp32 partitions (names per stage)."""
    zero = shard["optimizer_state_dict"]
    base = zero["base_optimizer_state"] if "base_optimizer_state" in zero else zero["optimizer_state_dict"]
    flats = (
        zero["single_partition_of_fp32_groups"]
        if "single_partition_of_fp32_groups" in zero
        else zero["fp32_flat_groups"]
    )
    return base, list(flats)


def _partitioned_keys(base: dict, flats: list[torch.Tensor]) -> list[str]:
    """Optimizer state keys held per element (shaped like the flat partition), e.g. exp_avg."""
    state = base["state"][0]
    return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1 and v.shape == flats[0].shape]


def _flats_of(shard: dict, key: str) -> list[torch.Tensor]:
    base, flats = _zero_state(shard)
    if key == FP32:
        return flats
    return [base["state"][i][key] for i in range(len(flats))]


def _full_tensors(stage: int, shards: list[dict], shapes: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Parameter name -> the whole tensor of ``key`` merged from the N saved partitions."""
    flats = [_flats_of(shard, key) for shard in shards]
    out: dict[str, torch.Tensor] = {}
    if stage <= 2:
        for g, names in enumerate(shapes):
            for name, shape in names.items():
                parts = []
                for rank, shard in enumerate(shards):
                    where = shard["optimizer_state_dict"]["param_slice_mappings"][g].get(name)
                    if where is not None:
                        parts.append(flats[rank][g].narrow(0, where.start, where.numel))
                out[name] = torch.cat(parts).view(shape).clone()
        return out
    per_rank = [torch.cat([f.reshape(-1) for f in rank_flats]) for rank_flats in flats]
    offset = 0
    for name, shape in ((n, s) for group in shapes for n, s in group.items()):
        numel = math.prod(shape)
        part = math.ceil(numel / len(shards))
        out[name] = torch.cat([f.narrow(0, offset, part) for f in per_rank])[:numel].view(shape).clone()
        offset += part
    return out


def consolidate(state_dir: Path, out: Path) -> None:
    """Merge the saved partitions into whole tensors in ``out`` (replaced if it exists)."""
    from safetensors.torch import save_file

    stage, world = saved_partitioning(state_dir)
    files = optim_files(state_dir)
    if len(files) != world:
        raise CheckpointError(
            f"Checkpoint {str(state_dir)!r} has {len(files)} of the {world} optimizer partitions "
            "(one per rank) it was saved with: the others are missing, so its optimizer state "
            "cannot be re-cut. Resume from another checkpoint."
        )
    model_state = load(sorted(Path(state_dir).glob("*model_states.pt"))[0], map_location="cpu", mmap=True)
    shards = [load(f, map_location="cpu", mmap=True) for f in files]
    keys = _partitioned_keys(*_zero_state(shards[0]))
    if out.exists():
        shutil.rmtree(out)  # an earlier conversion that did not finish
    out.mkdir(parents=True)
    for key in (FP32, *keys):
        tensors = _full_tensors(stage, shards, model_state["param_shapes"], key)
        save_file(tensors, str(out / f"{key}.safetensors"))
    meta = {
        "source": str(state_dir),
        "zero_stage": stage,
        "world_size": world,
        "keys": keys,
        "engine": {
            k: int(model_state.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")
        },
    }
    (out / META).write_text(json.dumps(meta, indent=1))


def _masters(zero) -> list[tuple[torch.Tensor, int]]:
    """The running engine's flat fp32 partitions with their parameter group index."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3: one per sub-group
        return [(f, zero.sub_group_to_group_id[i]) for i, f in enumerate(zero.fp32_partitioned_groups_flat)]
    return [(f, i) for i, f in enumerate(zero.single_partition_of_fp32_groups)]


def _restore_groups(zero, saved_base: dict, keys: list[str]) -> None:
    """Hyperparameters of each group, and a fresh state per partition: zeros for the per-element
    keys (filled below), the saved group's scalars (``step``) for the others."""
    base = zero.optimizer
    groups = saved_base["param_groups"]
    if len(groups) != len(base.param_groups):
        raise CheckpointError(
            f"The checkpoint's optimizer has {len(groups)} parameter groups, this run's has "
            f"{len(base.param_groups)}: resume with the optimizer settings it was saved with."
        )
    for group, saved in zip(base.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for flat, g in _masters(zero):
        saved_state = saved_base["state"][groups[g]["params"][0]]
        state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in saved_state.items() if k not in keys}
        state.update({k: torch.zeros_like(flat) for k in keys})
        base.state[flat] = state
    if not hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO 1/2: link the fragments to it
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        for i, (flat, _) in enumerate(_masters(zero)):
            lazy_init_hp_params_optimizer_state(zero.bit16_groups[i], flat, base.state)


def _place(zero, param, value: torch.Tensor, key: str) -> None:
    """Copy this rank's slice of the full ``value`` into the partition of ``param``."""
    state_key = None if key == FP32 else key
    if not hasattr(param, "ds_id"):  # ZeRO 1/2: DeepSpeed's tensor-fragment API
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        if state_key is None:
            safe_set_full_fp32_param(param, value)
        else:
            safe_set_full_optimizer_state(param, value, state_key)
        return
    # ZeRO-3 (its set_full_hp_param cannot place the padded last slice of an uneven split)
    target, _ = zero._get_fp32_opt_state_partition(
        param, release_swap_buffers=False, optim_state_key=state_key
    )
    n, rank = target.numel(), zero._get_param_partition_rank(param)
    padded = torch.zeros(n * zero._get_param_partition_world_size(param), dtype=target.dtype)
    padded[: value.numel()] = value.reshape(-1)
    target.data.copy_(padded.narrow(0, rank * n, n).to(target.device))


def load_consolidated(engine, folder: Path, state_dir: Path) -> None:
    """Load ``consolidate``'s output into the running engine's partitioning (every rank)."""
    from safetensors import safe_open

    meta = json.loads((folder / META).read_text())
    zero = engine.optimizer
    shard0 = load(optim_files(state_dir)[0], map_location="cpu", mmap=True)
    saved_base, _ = _zero_state(shard0)
    _restore_groups(zero, saved_base, meta["keys"])
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    for key in (FP32, *meta["keys"]):
        with safe_open(str(folder / f"{key}.safetensors"), framework="pt") as f:
            missing = [n for n, _ in params if n not in f.keys()]
            if missing:
                raise CheckpointError(
                    f"Checkpoint {str(state_dir)!r} has no optimizer state for {missing[:3]}: it was "
                    "saved from another model. Resume with the model it was saved with."
                )
            for name, param in params:
                _place(zero, param, f.get_tensor(name), key)
    global_state = shard0["optimizer_state_dict"]
    if global_state.get("dynamic_loss_scale"):  # fp16: the loss scale it had reached
        zero.loss_scaler = global_state["loss_scaler"]
    for k, v in meta["engine"].items():
        setattr(engine, k, v)


def reshard(engine, state_dir: Path, work: Path, is_main: bool) -> None:
    """Rank 0 converts ``state_dir`` into ``work``, every rank loads it, rank 0 removes it. An
    error on rank 0 is raised on every rank (no rank waits for a conversion that failed)."""
    error = None
    if is_main:
        try:
            consolidate(state_dir, work)
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a layout this code does not know: said on every rank
            _, world = saved_partitioning(state_dir)
            error = (
                f"Could not merge the DeepSpeed optimizer partitions in {str(state_dir)!r} for "
                f"this world size ({type(e).__name__}: {e}). The checkpoint was not changed: "
                f"resume it on {world} processes, the world size it was saved with."
            )
        if error is not None:
            shutil.rmtree(work, ignore_errors=True)
    message = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)  # between our own ranks, not from a file
    if message[0] is not None:
        raise CheckpointError(message[0])
    load_consolidated(engine, work, state_dir)
    if dist.is_initialized():
        dist.barrier()
    if is_main:
        shutil.rmtree(work, ignore_errors=True)
