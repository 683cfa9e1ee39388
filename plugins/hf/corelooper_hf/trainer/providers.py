"""The drop-in ``Trainer``'s corelooper providers: each one calls the ``Trainer`` method HF calls there.

So a subclass's override (``training_step``, ``compute_loss`` through it, ``create_optimizer``,
``create_scheduler``, ``get_train_dataloader``, ``get_eval_dataloader``, ``evaluation_loop``,
``prediction_step``) is what the run does, with HF's arguments, while the loop, checkpoints,
the non-finite guard and corelooper's other plugins stay corelooper's.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

from corelooper import hookimpl
from corelooper.step import finish_step


def overrides(trainer, name: str) -> bool:
    """Whether ``trainer``'s class overrides the drop-in's ``name`` (a subclass's own method)."""
    from .trainer import Trainer

    return getattr(type(trainer), name) is not getattr(Trainer, name)


class DropInProviders:
    """Per-``Trainer`` providers; they answer before the builtin ones (which answer last)."""

    name = "hf_trainer"

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    @hookimpl
    def training_step(self, loop, micro_batches):
        """HF's inner loop for one optimizer step: ``Trainer.training_step`` per micro-batch
        (gradients synchronised on the last), then corelooper's clip, guard, optimizer and
        scheduler step (``corelooper.step.finish_step``), as HF's loop does after them."""
        trainer = self.trainer
        num_items = trainer.get_num_items_in_batch(micro_batches)
        trainer.current_gradient_accumulation_steps = len(micro_batches)
        losses = []
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with nullcontext() if last else loop.backend.no_sync(loop.model):
                losses.append(trainer.training_step(loop.model, batch, num_items))
            trainer.current_flos += float(trainer.floating_point_ops(batch))
            if not last:
                loop.events.fire("on_substep_end")
        return finish_step(loop, micro_batches, losses)

    @hookimpl
    def corelooper_configure(self, config, plugins):
        plugins.register_for_checkpointing("hf_trainer_state", TrainerStateExtras(self.trainer))

    @hookimpl(tryfirst=True)  # before the callbacks' on_train_begin: they see the resumed state
    def on_train_begin(self, loop):
        if self.trainer.train_rng is not None:  # a fresh run draws on from where train() was called
            from corelooper.seeding import set_rng_state

            set_rng_state(self.trainer.train_rng)
            self.trainer.train_rng = None
        if self.trainer.hf_resume is not None:
            self.trainer.hf_resume.restore(loop, self.trainer)
            self.trainer.hf_resume = None

    @hookimpl
    def create_optimizer(self, loop, model):
        return self.trainer.create_optimizer(model)

    @hookimpl
    def create_scheduler(self, loop, optimizer, num_training_steps):
        return self.trainer.create_scheduler(num_training_steps=num_training_steps, optimizer=optimizer)

    @hookimpl
    def train_dataloader(self, loop, dataset):
        """``Trainer.get_train_dataloader()``: corelooper's loader unless a subclass returns its own
        (a torch ``DataLoader``: resumed by skipping batches, as HF's ``skip_first_batches``)."""
        loader = self.trainer.get_train_dataloader()
        return loader if hasattr(loader, "skip") else ResumableLoader(loader)

    @hookimpl
    def eval_dataloader(self, loop, dataset):
        if not overrides(self.trainer, "get_eval_dataloader"):
            return None
        return self.trainer.get_eval_dataloader(None if dataset is loop.eval_dataset else dataset)

    @hookimpl
    def evaluation_loop(self, loop, dataset, metric_key_prefix, keep_outputs):
        """HF's ``evaluate`` / ``predict`` body: its dataloader, ``evaluation_loop`` and speed metrics.
        ``keep_outputs`` is true for ``predict()``."""
        trainer = self.trainer
        started = time.time()
        if keep_outputs:
            loader, description, loss_only = trainer.get_test_dataloader(dataset), "Prediction", None
        else:
            loader = trainer.get_eval_dataloader(None if dataset is loop.eval_dataset else dataset)
            description, loss_only = "Evaluation", True if trainer.compute_metrics is None else None
        out = trainer.evaluation_loop(
            loader,
            description=description,
            prediction_loss_only=loss_only,
            ignore_keys=trainer.ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        metrics = dict(out.metrics)
        metrics.update(trainer.speed_metrics(metric_key_prefix, started, out.num_samples))
        return metrics, out.predictions, out.label_ids


class TrainerStateExtras:
    """HF's ``TrainerState`` fields a corelooper checkpoint's loop state does not hold: HF's own
    ``log_history`` (its entries as HF writes them) and ``total_flos``."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict:
        state = self.trainer.state
        return {"log_history": state.log_history, "total_flos": state.total_flos}

    def load_state_dict(self, saved: dict) -> None:
        self.trainer.state.log_history = list(saved.get("log_history", []))
        self.trainer.state.total_flos = saved.get("total_flos", 0.0)


class ResumableLoader:
    """A user's ``get_train_dataloader()`` (a torch ``DataLoader``) with what corelooper's loop
    resumes through: ``set_epoch`` (passed to its sampler, as HF does) and ``skip(n)`` (the first
    ``n`` batches of the next pass are consumed unseen, as HF's ``skip_first_batches``)."""

    def __init__(self, loader) -> None:
        self.loader, self._skip = loader, 0

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        for owner in (
            self.loader,
            getattr(self.loader, "sampler", None),
            getattr(self.loader, "batch_sampler", None),
        ):
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(epoch)

    def skip(self, n: int) -> None:
        self._skip = n

    def __iter__(self):
        batches = iter(self.loader)
        for _ in range(self._skip):
            next(batches, None)
        self._skip = 0
        yield from batches


def draw_as_torch_dataloader() -> None:
    """The one draw from the global torch generator that starting a pass over a torch
    ``DataLoader`` makes (its workers' base seed): the drop-in makes it too, so dropout and any
    other random op after it draws what it draws under HF's Trainer."""
    import torch

    torch.empty((), dtype=torch.int64).random_()


class DrawsAsTorchLoader:
    """corelooper's loader, drawing from the global generator at each pass as a torch
    ``DataLoader`` does (``draw_as_torch_dataloader``); everything else is the loader's own."""

    def __init__(self, loader) -> None:
        self.loader, self._resuming = loader, False

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def skip(self, n: int) -> None:
        """A resume mid-epoch: HF restores the checkpoint's RNG after this pass's draw, so the
        resumed pass draws nothing (the restored state is the one after it)."""
        self._resuming = n > 0
        self.loader.skip(n)

    def __iter__(self):
        if not self._resuming:
            draw_as_torch_dataloader()  # at the first fetch, after on_epoch_begin, as HF's
        self._resuming = False
        yield from self.loader
