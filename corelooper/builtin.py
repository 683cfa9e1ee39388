"""The default providers and the HF flow logic, registered as an ordinary plugin ("builtin").

Every provider here is ``trylast``: any other plugin's implementation answers first.
"""

from __future__ import annotations

import math

import torch

from .hookspecs import hookimpl
from .losses import default_loss


@hookimpl(trylast=True)
def create_backend(loop):
    from .backend import AccelerateBackend

    return AccelerateBackend(loop.args.mixed_precision, loop.args.use_cpu)


# -- optimizer ------------------------------------------------------------------------------

_NORM_TYPES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase)


def no_decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """Biases and normalisation weights: weight decay would pull them to 0 for no benefit."""
    names = set()
    for mod_name, module in model.named_modules():
        is_norm = isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if is_norm or p_name == "bias":
                names.add(full)
    return names


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    skip = no_decay_parameter_names(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name in skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


@hookimpl(trylast=True)
def create_optimizer(loop, model):
    a = loop.args
    return torch.optim.AdamW(
        parameter_groups(model, a.weight_decay),
        lr=a.learning_rate,
        betas=(a.adam_beta1, a.adam_beta2),
        eps=a.adam_epsilon,
    )


# -- schedulers (same values as transformers.get_scheduler) ---------------------------------


def warmup_steps_for(warmup: float, num_training_steps: int) -> int:
    return math.ceil(warmup * num_training_steps) if 0 < warmup < 1 else int(warmup)


def lr_lambda(kind: str, warmup: int, total: int):
    def linear(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    def cosine(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def constant(step: int) -> float:
        return 1.0

    def constant_with_warmup(step: int) -> float:
        return step / max(1, warmup) if step < warmup else 1.0

    return {"linear": linear, "cosine": cosine, "constant": constant,
            "constant_with_warmup": constant_with_warmup}[kind]


@hookimpl(trylast=True)
def create_scheduler(loop, optimizer, num_training_steps):
    a = loop.args
    warmup = warmup_steps_for(a.warmup_steps, num_training_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(a.lr_scheduler_type, warmup, num_training_steps)
    )


# -- data -----------------------------------------------------------------------------------


@hookimpl(trylast=True)
def train_dataloader(loop, dataset):
    from .data import BatchLoader

    a = loop.args
    return BatchLoader(
        dataset,
        a.per_device_train_batch_size,
        collate_fn=loop.data_collator,
        shuffle=True,
        seed=a.data_seed if a.data_seed is not None else a.seed,
        drop_last=a.dataloader_drop_last,
        num_replicas=loop.backend.num_processes,
        rank=loop.backend.process_index,
        num_workers=a.dataloader_num_workers,
        pin_memory=loop.backend.device.type == "cuda",
    )


@hookimpl(trylast=True)
def eval_dataloader(loop, dataset):
    from .data import BatchLoader

    a = loop.args
    return BatchLoader(
        dataset,
        a.per_device_eval_batch_size,
        collate_fn=loop.data_collator,
        shuffle=False,
        num_replicas=loop.backend.num_processes,
        rank=loop.backend.process_index,
        num_workers=a.dataloader_num_workers,
        pin_memory=loop.backend.device.type == "cuda",
        contiguous=True,
    )


# -- loss and metrics -------------------------------------------------------------------------


@hookimpl(trylast=True)
def compute_loss(loop, model, batch, num_items_in_batch, return_outputs):
    return default_loss(loop, model, batch, num_items_in_batch, return_outputs)


@hookimpl(trylast=True)
def compute_metrics(loop, predictions, label_ids):
    if loop.compute_metrics_fn is not None:
        return loop.compute_metrics_fn(predictions, label_ids)
    return None


# -- flow: when to log, evaluate, save (HF's DefaultFlowCallback) ------------------------------


@hookimpl(tryfirst=True)
def on_step_end(loop, state, control):
    a = loop.args
    step = state.global_step
    if step % state.logging_steps == 0 or (step == 1 and a.logging_first_step):
        control.should_log = True
    if a.eval_strategy == "steps" and step % state.eval_steps == 0:
        control.should_evaluate = True
    if a.save_strategy == "steps" and step % state.save_steps == 0:
        control.should_save = True
    if step >= state.max_steps:
        control.should_training_stop = True
        control.should_log = True
        if a.save_strategy == "steps":
            control.should_save = True


@hookimpl(tryfirst=True)
def on_epoch_end(loop, state, control):
    a = loop.args
    if a.eval_strategy == "epoch":
        control.should_evaluate = True
    if a.save_strategy == "epoch":
        control.should_save = True
