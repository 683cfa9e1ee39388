"""The default providers, registered as an ordinary plugin ("builtin"); the flow logic (when to
log, evaluate, save) is the builtin policy "flow" (``builtin/flow.py``).

Every provider here is ``trylast``: any other plugin's implementation answers first.
"""

from __future__ import annotations

import weakref

# What every train() uses is imported with the module, not inside the timed loop.
from ..data.loader import BatchLoader, sample_lengths
from ..errors import DataError
from ..hf import optimizers, schedules
from ..hookspecs import hookimpl
from ..losses import default_loss
from ..step import default_training_step


@hookimpl(trylast=True)
def create_model(config):
    from ..build import model_from_factory

    return model_from_factory(config)


@hookimpl(trylast=True)
def create_dataset(config, split):
    from ..build import dataset_from_factory

    return dataset_from_factory(config, split)


@hookimpl(trylast=True)
def create_backend(loop):
    from ..backends.base import AccelerateBackend
    from ..backends.local import LocalBackend, local_device

    a = loop.args
    device = local_device(a.use_cpu) if a.mixed_precision == "no" else None
    if device is not None:  # one process, one device, full precision: no accelerate import
        return LocalBackend(device)
    ddp = {
        "find_unused_parameters": a.ddp_find_unused_parameters,
        "bucket_cap_mb": a.ddp_bucket_cap_mb,
        "broadcast_buffers": a.ddp_broadcast_buffers,
        "static_graph": a.ddp_static_graph,
    }
    return AccelerateBackend(
        a.mixed_precision, a.use_cpu, a.ddp_timeout, {k: v for k, v in ddp.items() if v is not None}
    )


# -- optimizer and scheduler (by name: corelooper/hf/optimizers.py, corelooper/hf/schedules.py) --------


@hookimpl(trylast=True)
def create_optimizer(loop, model):
    return optimizers.create_optimizer(loop, model)


@hookimpl(trylast=True)
def create_scheduler(loop, optimizer, num_training_steps):
    return schedules.create_scheduler(loop.args, optimizer, num_training_steps)


# -- data -----------------------------------------------------------------------------------


def _loader(loop, dataset, hook: str, batch_size: int, **options) -> BatchLoader:
    a, backend = loop.args, loop.backend
    _refuse_stream(dataset, hook)
    return BatchLoader(
        dataset,
        batch_size,
        collate_fn=loop.data_collator,
        num_replicas=backend.num_processes,
        rank=backend.process_index,
        num_workers=a.dataloader_num_workers,
        pin_memory=a.dataloader_pin_memory and backend.device.type == "cuda",
        **options,
    )


@hookimpl(trylast=True)
def train_dataloader(loop, dataset):
    a = loop.args
    lengths = sample_lengths(dataset, a.length_column_name) if a.group_by_length else None
    return _loader(
        loop,
        dataset,
        "train_dataloader",
        a.per_device_train_batch_size,
        shuffle=a.train_sampling_strategy != "sequential",
        drop_last=a.dataloader_drop_last,
        seed=a.data_seed if a.data_seed is not None else a.seed,
        lengths=lengths,
    )


@hookimpl(trylast=True)
def eval_dataloader(loop, dataset):
    return _loader(
        loop, dataset, "eval_dataloader", loop.args.per_device_eval_batch_size, shuffle=False, contiguous=True
    )


def _refuse_stream(dataset, hook: str) -> None:
    """An ``IterableDataset`` reaches the builtin only when no plugin loads streams."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        raise DataError(
            f"The dataset is a torch IterableDataset ({type(dataset).__name__}, a stream without "
            f"__len__/__getitem__), and no loaded plugin answers {hook!r} for it: the builtin loader "
            "needs a map-style dataset. Install or enable a plugin that loads an IterableDataset "
            "(`corelooper plugins` lists them), or give a map-style dataset."
        )


# -- loss and metrics -------------------------------------------------------------------------


@hookimpl(trylast=True)
def compute_loss(loop, model, batch, num_items_in_batch, return_outputs):
    return default_loss(loop, model, batch, num_items_in_batch, return_outputs)


@hookimpl(trylast=True)
def training_step(loop, micro_batches):
    return default_training_step(loop, micro_batches)


@hookimpl(trylast=True)
def evaluation_loop(loop, dataset, metric_key_prefix, keep_outputs):
    from ..evaluation import run_evaluation

    return run_evaluation(loop, dataset, metric_key_prefix, keep_outputs)


@hookimpl(trylast=True)
def eval_metric(loop):
    fn = loop.compute_metrics_fn
    if callable(getattr(fn, "update", None)) and callable(getattr(fn, "compute", None)):
        return fn  # Loop(compute_metrics=a per-batch metric object)
    if fn is not None and loop.args.batch_eval_metrics:
        from ..hf.batch_metrics import HFBatchMetrics

        return HFBatchMetrics(fn)
    return None


@hookimpl(trylast=True)
def compute_metrics(loop, predictions, label_ids):
    if loop.compute_metrics_fn is not None:
        return loop.compute_metrics_fn(predictions, label_ids)
    return None


@hookimpl
def on_init_end(loop):
    # A script that never calls Loop.close(): the plugins are unconfigured when the Loop is
    # collected or the interpreter exits (the finalizer holds the registry, not the Loop).
    weakref.finalize(loop, loop.plugins.unconfigure)
