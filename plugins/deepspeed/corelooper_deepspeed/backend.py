"""``DeepSpeedBackend``: the loop's Backend protocol on a ``deepspeed.initialize`` engine.

Driven directly (not through accelerate): no ``transformers`` needed, gloo on CPU works, and
the loop keeps its own optimizer, scheduler and accumulation. DeepSpeed runs with
``managed_gradient_accumulation = false``: ``backward`` accumulates, the loop's single
``optimizer_step`` reduces, clips and updates.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
from pathlib import Path

import torch
import torch.distributed as dist

from corelooper.backends.base import TorchDistributedCollectives, prepare_process_group
from corelooper.errors import CheckpointError, ConfigError

from . import ds_config

STATE_DIR = "deepspeed"  # DeepSpeed's own checkpoint folder inside a corelooper checkpoint
TAG = "state"


def _teardown() -> None:
    """At exit: free engines, then leave the group in step (ZeRO-3 on CPU aborts otherwise)."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # a rank already gone: nothing left to synchronise with
            pass


def report_mode(engine) -> None:
    """Make ``engine.training`` follow ``engine.train()`` / ``engine.eval()``.

    DeepSpeedEngine.train(mode) only sets its inner module's mode, so the engine itself kept
    reporting ``training=True`` during evaluation: a loss that reads ``model.training`` took
    its training branch. Per instance, on the engine corelooper created.
    """
    deepspeed_train = engine.train

    def train(mode: bool = True):
        deepspeed_train(mode)
        engine.training = mode  # nn.Module.train's contract: the wrapper reports its mode
        return engine

    engine.train = train
    engine.eval = lambda: train(False)


class DeepSpeedBackend(TorchDistributedCollectives):
    """ZeRO 0-3 data parallelism (with optional CPU offload) through a DeepSpeed engine."""

    # DeepSpeed fixes train_batch_size (micro x accumulation x world) at initialize().

    def __init__(self, args, section: dict, base: Path | None = None):
        on_cuda = torch.cuda.is_available() and not args.use_cpu
        if args.mixed_precision == "fp16" and not on_cuda:
            raise ConfigError(
                'train.mixed_precision = "fp16" needs a CUDA device; on CPU use "bf16" or "no".'
            )
        if not section.get("cpu_shm_comm", False):
            # Skip the g++ build of DeepSpeed's shared-memory CPU collectives: gloo is used.
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        import deepspeed

        prepare_process_group()  # without a launcher's environment DeepSpeed looks for MPI
        deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo", verbose=False)
        self._set_rank_attributes(on_cuda)
        self.mixed_precision = args.mixed_precision
        # The run's [train] is final (an elastic resume's geometry is settled before plugins are
        # configured): train_batch_size and accumulation are built into the config once.
        self.args = args
        self.config = ds_config.build(args, section, self.num_processes, on_cuda, base)
        self.zero_stage = self.config["zero_optimization"]["stage"]
        self.shards_parameters = self.zero_stage == 3
        self.fixed_accumulation = True  # the engine's gradient_accumulation_steps, set when built
        self.engine = None
        self._grad_norm = None
        atexit.register(_teardown)

    @classmethod
    def from_loop(cls, loop) -> DeepSpeedBackend:
        if getattr(loop.args, "torch_compile", False):
            raise ConfigError(
                "train.torch_compile = true with [deepspeed]: DeepSpeed wraps the module itself; "
                "set torch_compile = false (or use the builtin or FSDP backend)."
            )
        base = loop.config.source.parent if loop.config.source else None
        return cls(loop.args, loop.config.section("deepspeed"), base)

    # -- model ---------------------------------------------------------------------------
    def prepare(self, model, optimizer):
        import deepspeed

        model.to(self.device)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.config, dist_init_required=False
        )
        self.engine = engine
        report_mode(engine)
        # The loop's scheduler keeps stepping the optimizer it was built on: ZeRO wraps that one
        # and shares its param_groups, so learning rates match every other backend. The loop
        # gets the wrapper: its zero_grad keeps the buffers ZeRO-Offload reuses.
        return engine, engine.optimizer

    def prepare_model(self, model):
        """evaluate()/predict() before train(): the plain module on its device. (A DeepSpeed
        engine cannot be initialised twice on one module, and train() needs the real one.)"""
        return self.unwrap_model(model).to(self.device)

    def no_sync(self, model):
        return contextlib.nullcontext()  # unmanaged accumulation: backward never reduces early

    def backward(self, loss):
        self.engine.backward(loss, scale_wrt_gas=False)  # the loop already normalised the loss

    def clip_grad_norm(self, model, max_norm: float):
        # DeepSpeed clips inside step() (gradient_clipping = max_grad_norm); the norm it
        # measured is filled in after the step, before anything reads it.
        self._grad_norm = torch.zeros((), device=self.device)
        return self._grad_norm

    def optimizer_step(self, optimizer) -> None:
        self.engine.step()
        if self._grad_norm is not None:
            norm = self.engine.get_global_grad_norm()
            if norm is not None:
                self._grad_norm.fill_(float(norm))
            self._grad_norm = None

    def unwrap_model(self, model):
        return getattr(model, "module", model)

    # -- state -----------------------------------------------------------------------------
    def model_state_dict(self, model):
        """The full model on the main rank (ZeRO-3 gathers it layer by layer); {} elsewhere."""
        if self.zero_stage == 3 and self.engine is not None:
            state = self.engine._zero3_consolidated_16bit_state_dict()
            return dict(state) if state is not None else {}
        if not self.is_main_process:
            return {}
        return {k: v.detach().cpu() for k, v in self.unwrap_model(model).state_dict().items()}

    def load_model_state_dict(self, model, state_dict, strict: bool = True) -> None:
        """Copy full tensors into the model. ZeRO-3: each partitioned parameter is gathered,
        rank 0 copies, and its values are partitioned again to every rank. ``strict=False``:
        ``state_dict`` may hold a subset (an adapter)."""
        module = self.unwrap_model(model)
        if self.zero_stage != 3 or self.engine is None:
            module.load_state_dict(state_dict, strict=strict)
            return
        import deepspeed

        params = dict(module.named_parameters())
        if strict:
            missing = sorted(set(params) - set(state_dict))
            if missing:
                raise KeyError(f"missing from the state dict: {missing[:5]}")
        for name, value in state_dict.items():
            param = params.get(name)
            if param is None:  # a buffer: ZeRO-3 does not partition those
                module.load_state_dict({name: value}, strict=False)
                continue
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.is_main_process:
                    param.data.copy_(value)

    def save_training_state(self, optimizer, directory) -> None:
        """DeepSpeed's own checkpoint (module + each rank's optimizer partition)."""
        self.engine.save_checkpoint(str(Path(directory) / STATE_DIR), tag=TAG, save_latest=False)

    def full_parameter_shapes(self, model) -> dict[str, tuple[int, ...]]:
        """ZeRO-3 keeps 0-size placeholders in the module: the real shapes, for checkpoint checks."""
        return {
            n: tuple(p.ds_shape)
            for n, p in self.unwrap_model(model).named_parameters()
            if hasattr(p, "ds_shape")
        }

    def load_training_state(self, optimizer, directory) -> None:
        """DeepSpeed's own load when the checkpoint was saved with this world size and stage;
        otherwise (elastic resume) its partitions are merged and cut for this run (reshard.py)."""
        path = Path(directory) / STATE_DIR
        if not (path / TAG).is_dir():
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} has no DeepSpeed state ({STATE_DIR}/{TAG}/): it was "
                "saved by another backend. Resume it without [deepspeed], or start a new run from "
                "its model.safetensors."
            )
        from . import reshard
        from .safe_load import SafeCheckpointEngine, check_state_files

        check_state_files(path / TAG)
        stage, world = reshard.saved_partitioning(path / TAG)
        if stage != 0 and (stage, world) != (self.zero_stage, self.num_processes):
            self._check_reshardable(stage, directory)
            work = Path(self.args.output_dir) / f".tmp-elastic-{Path(directory).name}"
            reshard.reshard(self.engine, path / TAG, work, self.is_main_process)
            return
        # DeepSpeed's own engine torch.load(weights_only=False)s every file: nothing is unpickled here
        self.engine.checkpoint_engine = SafeCheckpointEngine()
        loaded, _ = self.engine.load_checkpoint(
            str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise CheckpointError(
                f"DeepSpeed found no checkpoint to load in {str(path / TAG)!r} (an incomplete copy?). "
                "Resume from another checkpoint."
            )

    def _check_reshardable(self, saved_stage: int, directory) -> None:
        offload = self.config["zero_optimization"].get("offload_optimizer", {}).get("device", "none")
        if self.zero_stage == 0 or offload == "nvme":
            raise CheckpointError(
                f"Checkpoint {str(directory)!r} holds ZeRO-{saved_stage} optimizer partitions of "
                f"another world size; this run (ZeRO-{self.zero_stage}, optimizer offload "
                f"{offload!r}) cannot re-cut them. Resume with deepspeed.zero_stage 1, 2 or 3 and "
                "no NVMe offload, or on the world size it was saved with."
            )

    def end(self) -> None:
        """Drop the engine (the process group is left to the launcher and the exit handler)."""
        self.engine = None
        gc.collect()
