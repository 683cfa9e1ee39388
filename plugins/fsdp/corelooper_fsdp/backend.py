"""``FSDPBackend``: the loop's Backend protocol on top of FSDP2 (``fully_shard``).

Why not accelerate's FSDP plugin: accelerate enables FSDP only for GPU distributed types, so
on CPU it silently returns a DDP model. torch's ``fully_shard`` works on any device mesh.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
import torch.distributed as dist

from corelooper.backends.base import TorchDistributedCollectives, prepare_process_group
from corelooper.errors import CheckpointError, ConfigError

SHARDED_DIR = "fsdp_state"  # torch.distributed.checkpoint folder inside a checkpoint
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "no": None, "": None}


def ensure_process_group(on_cuda: bool) -> None:
    """Join the torchrun / accelerate-launch group from the environment (a group of one when the
    script was started with plain ``python``)."""
    if dist.is_initialized():
        return
    prepare_process_group()
    dist.init_process_group(backend="nccl" if on_cuda else "gloo")


def checkpointed(module: torch.nn.Module) -> None:
    """Recompute ``module``'s forward in backward (non-reentrant; FQNs unchanged)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if module.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    module.forward = run


class FSDPBackend(TorchDistributedCollectives):
    """Parameters, gradients and optimizer state sharded over all ranks (FSDP2 / DTensor)."""

    shards_parameters = True
    fixed_accumulation = False

    def __init__(self, options: dict, mixed_precision: str = "no", use_cpu: bool = False):
        self.options = options
        on_cuda = torch.cuda.is_available() and not use_cpu
        ensure_process_group(on_cuda)
        self._set_rank_attributes(on_cuda)
        self.mixed_precision = mixed_precision
        param_dtype = options.get("param_dtype") or mixed_precision
        if param_dtype not in _DTYPES:
            raise ConfigError(f'fsdp.param_dtype = {param_dtype!r}: use "bf16", "fp16", "fp32" or "".')
        if options.get("reduce_dtype", "fp32") not in _DTYPES:
            raise ConfigError(
                f'fsdp.reduce_dtype = {options["reduce_dtype"]!r}: use "fp32", "bf16" or "fp16".'
            )
        if param_dtype == "fp16":
            raise ConfigError(
                "FSDP with fp16 needs a sharded gradient scaler, which corelooper-fsdp does not "
                'provide: use train.mixed_precision = "bf16" (or fsdp.param_dtype = "bf16").'
            )
        self.param_dtype = _DTYPES[param_dtype]
        self.reduce_dtype = _DTYPES[options.get("reduce_dtype", "fp32")]
        self.model = None
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.num_processes,))

    @classmethod
    def from_loop(cls, loop) -> FSDPBackend:
        if getattr(loop.args, "torch_compile", False):
            raise ConfigError(
                "train.torch_compile = true with [fsdp]: compile the blocks inside your model "
                "factory instead (corelooper-fsdp shards the uncompiled module tree)."
            )
        return cls(loop.config.section("fsdp"), loop.args.mixed_precision, loop.args.use_cpu)

    # -- model ---------------------------------------------------------------------------
    def _wrap_classes(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        names = list(self.options.get("wrap") or [])
        if not names:
            names = list(getattr(model, "_no_split_modules", None) or [])
        if names:
            present = {type(m).__name__ for m in model.modules()}
            missing = sorted(set(names) - present)
            if missing:
                raise ConfigError(
                    f"fsdp.wrap names {missing}, which are not module classes of "
                    f"{type(model).__name__} (it has {sorted(present)[:12]}). Use class names from "
                    "that list."
                )
            return [m for m in model.modules() if type(m).__name__ in names and m is not model]
        return [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        units = self._wrap_classes(model)
        if self.options.get("activation_checkpointing"):
            if not units:
                raise ConfigError(
                    f"fsdp.activation_checkpointing = true, but {type(model).__name__} has no units "
                    "to checkpoint: name its block classes in fsdp.wrap."
                )
            for unit in units:
                checkpointed(unit)
        model.to(self.device)
        kwargs = {
            "mesh": self.mesh,
            "reshard_after_forward": bool(self.options.get("reshard_after_forward", True)),
        }
        if self.param_dtype is not None or self.reduce_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype, output_dtype=None
            )
        if self.options.get("cpu_offload") and self.device.type != "cpu":
            # (on a CPU device everything already lives in CPU memory: nothing to offload)
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model
        return model

    def prepare(self, model, optimizer):
        # fully_shard swaps every parameter for a DTensor one: point the optimizer (built on
        # the plain module, still without state) at the new parameters, by name.
        if self.model is model:  # sharded for an evaluate() before train(): the optimizer
            return model, optimizer  # was built on the sharded parameters already
        names = {id(p): n for n, p in model.named_parameters()}
        model = self._shard(model)
        new = dict(model.named_parameters())
        if optimizer.state:
            raise ConfigError("corelooper-fsdp needs a fresh optimizer (it already holds state).")
        for group in optimizer.param_groups:
            group["params"] = [new[names[id(p)]] for p in group["params"]]
        return model, optimizer

    def prepare_model(self, model):
        return self._shard(model) if self.model is None else model

    @contextlib.contextmanager
    def no_sync(self, model):
        """Accumulate unsharded gradients locally; the last micro-batch reduce-scatters them."""
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def backward(self, loss):
        loss.backward()

    def clip_grad_norm(self, model, max_norm: float):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def optimizer_step(self, optimizer) -> None:
        optimizer.step()

    def unwrap_model(self, model):
        return model  # fully_shard changes the module in place

    # -- state -----------------------------------------------------------------------------
    def model_state_dict(self, model):
        """The full model, gathered to rank 0 on CPU (empty dict on other ranks)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state_dict(self, model, state_dict, strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # broadcast_from_rank0 turns the values it is given into DTensors: hand it a copy.
        set_model_state_dict(
            model,
            dict(state_dict) if self.is_main_process else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict),
        )

    def save_training_state(self, optimizer, directory) -> None:
        """Model + optimizer as sharded ``torch.distributed.checkpoint`` state (every rank writes
        its own shard; no gather)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, optimizer)
        if not self.options.get("sharded_state", True):
            model_sd = {}
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(Path(directory) / SHARDED_DIR))

    def load_training_state(self, optimizer, directory) -> None:
        """The sharded state back, with nothing unpickled but DCP's metadata classes (safe_dcp).

        DCP reads by name and global offsets, not by file: a checkpoint saved on N processes
        loads onto this run's mesh of any size (re-sharded; a 1-process run is a mesh of one)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = Path(directory) / SHARDED_DIR
        if not (path / ".metadata").is_file():
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} has no FSDP state ({SHARDED_DIR}/): it was saved by "
                "another backend. Resume it without [fsdp], or start a new run from its "
                "model.safetensors (model.factory loading those weights)."
            )
        from .safe_dcp import SafeLoadPlanner, SafeReader, read_dcp_metadata

        read_dcp_metadata(path / ".metadata")  # a refused payload fails here, before DCP logs it
        model_sd, optim_sd = get_state_dict(self.model, optimizer)
        state = {"optimizer": optim_sd}
        if self.options.get("sharded_state", True):
            state["model"] = model_sd  # exact sharded weights (model.safetensors was loaded already)
        # DCP's own reader unpickles .metadata and torch.load(weights_only=False)s its byte items
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
        except CheckpointException as e:
            causes = "; ".join(f"rank {r}: {type(x).__name__}: {str(x)[:200]}" for r, x in e.failures.items())
            raise CheckpointError(
                f"The FSDP state in {str(path)!r} could not be loaded ({causes}); nothing in it was "
                "unpickled. Resume from another checkpoint."
            ) from None
        set_state_dict(
            self.model,
            optimizer,
            model_state_dict=state.get("model", model_sd),
            optim_state_dict=state["optimizer"],
        )

    def end(self) -> None:
        pass  # the process group belongs to the launcher; torchrun tears it down
