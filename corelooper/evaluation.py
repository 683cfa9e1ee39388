"""Evaluation and prediction: ``run_evaluation`` is the builtin ``evaluation_loop`` provider.

The loss is token-weighted over the whole set (each batch's loss times its loss-bearing items,
summed over batches and processes), so it does not depend on the batch size or the number of
processes. Outputs, when metrics or predictions need them, are gathered in dataset order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .data.columns import call_model, model_inputs
from .data.loader import count_loss_items
from .errors import ConfigError
from .losses import predictions_of, split_batch
from .metric import metric_key
from .outputs import LogitsWanted, OutputAccumulator, Preprocessed


@torch.no_grad()
def run_evaluation(
    loop,
    dataset,
    metric_key_prefix: str = "eval",
    keep_outputs: bool = False,
    batch_transform: Callable | None = None,
):
    """``(metrics, predictions, label_ids)`` over ``dataset``; ``batch_transform`` may cut each
    batch into pieces (a list of batches with the same samples in the same order)."""
    loop.prepare_for_evaluation()
    backend, model = loop.backend, loop.model
    metric = _batch_metric(loop)  # per batch: no outputs are kept for it
    want_outputs = (
        keep_outputs
        or metric is None
        and (loop.plugins.implemented_by_others("compute_metrics") or loop.compute_metrics_fn is not None)
    )
    # Without a use for the outputs, compute_loss is asked for the loss alone: an LM loss may then
    # skip the logits of positions that do not count (a language-model head over trained positions only).
    others_read = any("outputs" in impl.argnames for impl in loop.hook.on_prediction_step.get_hookimpls())
    need_outputs = want_outputs or metric is not None or others_read
    preprocess = getattr(metric, "preprocess_logits", None)
    if callable(preprocess) and not (want_outputs or others_read):  # only the metric reads them
        need_outputs = LogitsWanted(preprocess, bool(getattr(metric, "counted_only", False)))
    loader = loop.plugins.call_provider("eval_dataloader", loop=loop, dataset=dataset)[0]
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, device=backend.device, dtype=torch.float64)  # loss sum, items
    collected = OutputAccumulator(loop.args.eval_accumulation_steps)  # on device, to CPU in chunks
    answered = None
    try:
        for batch in loader:
            for piece in batch_transform(batch) if batch_transform else (batch,):
                piece = backend.to_device(piece)
                outputs, answered = _eval_batch(loop, piece, totals, need_outputs, answered)
                kept, for_metric = _predictions(outputs, preprocess)
                labels = split_batch(piece)[2]
                if metric is not None and for_metric is not None and labels is not None:
                    metric.update(for_metric, labels)
                if want_outputs and kept is not None:
                    collected.add(kept, labels)
                del outputs, kept, for_metric  # this batch's logits go before the next batch's are made
    finally:
        model.train(was_training)
    return _metrics(loop, totals, collected if want_outputs else None, metric_key_prefix, answered, metric)


def _predictions(outputs, preprocess):
    """``(kept, for the metric)``: the kept logits (the first kept tensor) through the metric's
    ``preprocess_logits``, as HF's ``preprocess_logits_for_metrics``; a ``Preprocessed`` answer as is."""
    if isinstance(outputs, Preprocessed):
        return None, outputs.predictions
    kept = predictions_of(outputs) if outputs is not None else None
    if kept is None or not callable(preprocess):
        return kept, kept
    return kept, preprocess(kept[0] if isinstance(kept, tuple) else kept)


def _batch_metric(loop):
    """The ``eval_metric`` provider's object (reset), or None; one that sums across processes."""
    metric = loop.plugins.call_provider("eval_metric", loop=loop)[0]
    if metric is not None and loop.backend.num_processes > 1 and not callable(getattr(metric, "sync", None)):
        raise ConfigError(
            f"The per-batch evaluation metric ({type(metric).__name__}) has no sync(reduce_sum) method, so its "
            f"states cannot be summed over the {loop.backend.num_processes} processes: give it one (replace each "
            "state tensor t by reduce_sum(t)). HF's compute_metrics(eval_pred, compute_result) "
            "(train.batch_eval_metrics) keeps its state in the function: it runs on one process only."
        )
    if metric is not None and callable(getattr(metric, "reset", None)):
        metric.reset()
    return metric


def _eval_batch(loop, batch, totals, need_outputs: bool, answered):
    """Loss (weighted by the batch's items) into ``totals``; the outputs when wanted."""
    loss_type = loop.resolve_loss_type(batch)
    has_labels = split_batch(batch)[2] is not None
    outputs = None
    if has_labels:
        n = count_loss_items(batch, loss_type)
        result, answered = loop.plugins.call_provider(
            "compute_loss",
            loop=loop,
            model=loop.model,
            batch=batch,
            num_items_in_batch=n,
            return_outputs=need_outputs,
        )
        # a provider may ignore return_outputs and give the loss alone
        loss, outputs = result if isinstance(result, tuple) else (result, None)
        totals[0] += loss.detach().double() * n
        totals[1] += n
    if outputs is None and (need_outputs or not has_labels):
        outputs = forward(loop, batch)
    loop.events.fire("on_prediction_step", batch=batch, outputs=outputs)
    return outputs, answered


def forward(loop, batch):
    """The model's outputs for ``batch``, with only the columns its ``forward`` accepts."""
    args, kwargs, _ = split_batch(batch)
    if kwargs:
        kwargs = model_inputs(loop, kwargs)
    return call_model(loop, loop.model, args, kwargs)


def _metrics(loop, totals, collected, prefix: str, answered, metric=None):
    totals = loop.backend.reduce_sum(totals)
    loss_sum, items = totals.tolist()
    metrics = {}
    if items > 0:
        metrics[f"{prefix}_loss"] = round(loss_sum / items, 6)
        # exp(loss) is a perplexity for a token-normalised causal-LM loss (a compute_loss that
        # takes num_items_in_batch), not for e.g. a per-pair DPO loss.
        if (
            loop.loss_type == "causal_lm"
            and answered is not None
            and "num_items_in_batch" in answered.argnames
        ):
            metrics[f"{prefix}_perplexity"] = round(math.exp(min(metrics[f"{prefix}_loss"], 700)), 4)
    # dataset order, padded with -100
    predictions, label_ids = collected.gather(loop.backend) if collected else (None, None)
    extra = None
    if metric is not None:
        if callable(getattr(metric, "sync", None)):
            metric.sync(loop.backend.reduce_sum)
        extra = metric.compute()
    elif label_ids is not None:  # as HF: metrics need labels
        extra, _ = loop.plugins.call_provider(
            "compute_metrics", loop=loop, predictions=predictions, label_ids=label_ids
        )
    for k, v in (extra or {}).items():
        metrics[metric_key(k, prefix)] = _scalar(v)
    return metrics, predictions, label_ids


def _scalar(v):
    if torch.is_tensor(v):
        return v.item()
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
