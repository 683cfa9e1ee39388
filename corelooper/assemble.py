"""How ``Loop.__init__`` and ``Loop.train`` settle what a run is before it runs: the resume
checkpoint and its batch geometry (before any plugin is configured: the config is final), the
training plan (steps, epochs, intervals) from the loader's length."""

from __future__ import annotations

import logging
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .config import Config, resolve_interval
from .data.loader import batch_rows, count_input_tokens
from .errors import ConfigError, CorelooperError, DataError, explain_failure


def world_size_now() -> int:
    """The number of processes, before the backend exists: a process group already started
    (Ray, a test), else the launcher's ``WORLD_SIZE`` (torchrun, ``corelooper run --nproc``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class Resume:
    """``train.resume_from_checkpoint``, resolved while the plugins load: ``settle`` is
    ``load_plugins``' hook between validating the config and configuring the plugins."""

    def __init__(self, train_dataset: Any) -> None:
        self.given = train_dataset
        self.built: Any = None  # the training data, when settling needed it before the Loop
        self.directory: Path | None = None
        self.world_size: int | None = None  # when the geometry was changed for it
        self.plugins = None  # the registry (create_dataset), from settle

    def settle(self, config: Config, plugins) -> Config:
        from .checkpoints import checkpoint

        self.plugins = plugins
        resume = config.train.resume_from_checkpoint
        if not resume:
            return config
        try:
            self.directory = checkpoint.resolve(resume, Path(config.train.output_dir))
        except CorelooperError:  # train() resolves it again and says what is wrong, as before
            return config
        if self.directory is None:  # "auto" with no checkpoint yet
            return config
        world = world_size_now()
        with blamed(plugins, " while the Loop was built"):
            settled, _ = plugins.call_provider(
                "resume_config",
                config=config,
                plugins=plugins,
                directory=self.directory,
                world_size=world,
                dataset=lambda: self.dataset(config),
                announce=int(os.environ.get("RANK", "0")) == 0,
            )
        if settled is None or settled is config:
            return config
        self.world_size = world
        return settled

    def dataset(self, config: Config) -> Any:
        """The training data: given, else built from the config (once)."""
        from .build import build_dataset

        if self.given is None and self.built is None:
            self.built = build_dataset(self.plugins, config, "train")
        return self.given if self.given is not None else self.built

    def check_world_size(self, backend) -> None:
        if self.world_size is not None and backend.num_processes != self.world_size:
            raise ConfigError(
                f"Resuming {self.directory}: its batch geometry was settled for {self.world_size} "
                f"processes (WORLD_SIZE), but the backend runs {backend.num_processes}. Start the "
                "run with a launcher that sets WORLD_SIZE to the number of processes."
            )


def plan_steps(args, state, loader) -> int:
    """Steps per epoch, total steps and epochs into ``state``, from the loader's length and
    ``[train]``; returns the micro-batches of an epoch (the logged epoch counts them, as HF)."""
    a, s = args, state
    try:
        batches_per_epoch = len(loader)
    except TypeError:
        batches_per_epoch = 0
    if batches_per_epoch == 0 and a.max_steps <= 0:
        raise DataError(
            "The training data has no length (or is empty): set train.max_steps, or give a "
            "dataset with samples."
        )
    s.steps_per_epoch = math.ceil(batches_per_epoch / a.gradient_accumulation_steps)
    s.max_steps = a.max_steps if a.max_steps > 0 else math.ceil(a.num_train_epochs * s.steps_per_epoch)
    s.num_train_epochs = math.ceil(s.max_steps / s.steps_per_epoch) if s.steps_per_epoch else 1
    s.logging_steps = resolve_interval(a.logging_steps, s.max_steps)  # a float < 1: a ratio (HF)
    s.save_steps = resolve_interval(a.save_steps, s.max_steps)
    s.eval_steps = resolve_interval(a.eval_steps or a.logging_steps, s.max_steps)
    s.train_batch_size = a.per_device_train_batch_size
    s.gradient_accumulation_steps = a.gradient_accumulation_steps
    return batches_per_epoch


def batch_error(exc: Exception, global_step: int, config: Config, collator=None) -> DataError:
    """The error of a training batch that could not be loaded, naming the collator's line when
    the collator raised it (a ``Loop(data_collator=fn)`` or a config's ``data.collator``)."""
    from .errors import user_frame

    data, raised = config.data.train or "train_dataset", user_frame(exc, {"collator": collator})
    name = config.data.collator or getattr(collator, "__qualname__", type(collator).__name__)
    fix = (
        f"the collator {name} ({raised[1]}) raised {type(exc).__name__}: {exc}. Check it against the "
        f"dataset's rows ({data})"
        if raised
        else f"{type(exc).__name__}: {exc}. Check the dataset ({data}) "
        f"and the collator ({config.data.collator or 'default'})"
    )
    return DataError(f"Loading a training batch failed at global_step {global_step}: {fix}.")


def resume_directory(loop, asked, settled: Path | None) -> Path | None:
    """The checkpoint ``train()`` resumes: ``asked`` (its argument; refused when it needs another
    batch geometry than the final config's), else the config's (settled by ``Resume``)."""
    from .checkpoints import checkpoint

    output_dir, configured = Path(loop.args.output_dir), loop.args.resume_from_checkpoint
    if not asked:
        return (
            settled if settled is not None or not configured else checkpoint.resolve(configured, output_dir)
        )
    directory = checkpoint.resolve(asked, output_dir)
    if directory is not None:
        _check_settled(loop, directory)
    return directory


def _check_settled(loop, directory: Path) -> None:
    """``train(resume_from_checkpoint=...)``: refuse a checkpoint that needs another batch
    geometry than the config the plugins were configured with (it is never replaced)."""
    need, _ = loop.plugins.call_provider(
        "resume_config",
        config=loop.config,
        plugins=loop.plugins,
        directory=directory,
        world_size=loop.state.world_size,
        dataset=lambda: loop.train_dataset,
        announce=False,
    )
    a, b = loop.args, need.train if need is not None else loop.args
    if (b.per_device_train_batch_size, b.gradient_accumulation_steps) == (
        a.per_device_train_batch_size,
        a.gradient_accumulation_steps,
    ):
        return
    raise ConfigError(
        f"Cannot resume {directory} from Loop.train(resume_from_checkpoint=...): on "
        f"{loop.state.world_size} processes keeping its global batch needs per_device_train_batch_size = "
        f"{b.per_device_train_batch_size} and gradient_accumulation_steps = {b.gradient_accumulation_steps}, "
        "but the run's config is final once plugins are configured. Name the checkpoint in the "
        "config instead: train.resume_from_checkpoint (TrainArgs(resume_from_checkpoint=...), or "
        "--resume-from-checkpoint on the command line), and the Loop settles the geometry before it "
        "configures the plugins."
    )


def count_step(loop, epoch: int, micro_batches: list, step_loss, batches_per_epoch: int) -> None:
    """After an optimizer step: the position, samples and tokens into ``loop.state`` and the
    logging window."""
    s = loop.state
    s.global_step += 1
    s.step_in_epoch += 1
    s.micro_batches_in_epoch += len(micro_batches)
    # As HF: micro-batches done / micro-batches per epoch (5 an epoch, GA 2: 0.4, 0.8, 1.0)
    s.epoch = epoch + (s.micro_batches_in_epoch / batches_per_epoch if s.steps_per_epoch else 0)
    samples = sum(batch_rows(b) for b in micro_batches) * s.world_size
    tokens = sum(count_input_tokens(b) for b in micro_batches) * s.world_size
    s.total_samples_seen += samples
    loop.log_window.add(step_loss, samples, tokens, loop.guard.skipped_total)
    loop.tokens_seen.add(micro_batches)


def failure(loop, exc: BaseException, action: str = "Training") -> BaseException:
    """``on_exception`` of each plugin on its own (one that raises is named, the others still
    run), then the error naming its plugin and hook (or the model)."""
    kwargs = {"loop": loop, "state": loop.state, "control": loop.control, "exception": exc}
    for impl in reversed(loop.plugins.hook.on_exception.get_hookimpls()):  # pluggy's call order
        try:
            loop.plugins.call("on_exception", [impl], kwargs)
        except Exception as e:
            logging.getLogger("corelooper").warning(
                "Plugin %r raised in hook 'on_exception' (%s: %s); the error it was reporting follows.",
                impl.plugin_name,
                type(e).__name__,
                e,
            )
    return explain_failure(
        exc,
        loop.plugins,
        loop.state.global_step,
        loop.args.output_dir,
        action,
        user_code={"compute_metrics": loop.compute_metrics_fn},
    )


def create_backend(loop):
    """The ``create_backend`` answer; a second plugin's answer (each asked once, the builtin's
    default aside) is refused: a run has one backend, and backend plugins need not know each other."""
    plugins = loop.plugins
    backend, first = plugins.call_provider("create_backend", loop=loop)
    for impl in plugins.after("create_backend", first.plugin):
        if impl.plugin_name != "builtin" and plugins.call("create_backend", [impl], {"loop": loop}, True):
            a, b = first.plugin_name, impl.plugin_name
            asks = [f"[{s}]" for n in (a, b) for s in plugins.info[n].sections if s in loop.config.sections]
            raise ConfigError(
                f"Two plugins answer create_backend for this config: {a!r} and {b!r}; a run has one "
                f"backend. Choose one: disable the other (`-p no:{b}` or `-p no:{a}`, or [plugins] "
                f"disable), or remove the config section that asks for it ({' or '.join(asks) or '?'})."
            )
    return backend


@contextmanager
def blamed(plugins, when: str):
    """Outside ``train()``/``evaluate()`` (building the Loop, settling a resume): an exception
    from a plugin's code names the plugin and the hook (``Plugins.blame``)."""
    try:
        yield
    except Exception as exc:
        found = None if isinstance(exc, CorelooperError) else plugins.blame(exc)
        if found is None:
            raise
        raise plugins.raised(*found, exc, when) from exc


@contextmanager
def reported(loop, action: str):
    """``evaluate()``/``predict()`` called alone report an error as ``train()`` does."""
    try:
        yield
    except BaseException as exc:
        if loop.is_training:  # train() reports it
            raise
        raise failure(loop, exc, action) from exc
