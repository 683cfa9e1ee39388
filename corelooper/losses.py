"""The default loss (the builtin ``compute_loss``): what one micro-batch adds to the step's loss.

* A model whose ``forward`` takes ``labels`` computes its own loss (HF models). When ``forward``
  also takes ``num_items_in_batch`` (or ``**kwargs``, as HF models do: ``accepts_loss_kwargs``),
  the step's count of loss items (over micro-batches and processes) is passed through, so the
  model returns its summed loss divided by it: the step loss is the mean over every item of the
  step, as one big batch (as HF).
* A model that takes ``labels`` but not the count returns the mean over its batch; in a step of
  several micro-batches or processes that mean is weighted by the batch's share of the step's
  items (``items in this batch / num_items_in_batch``), which is again the exact mean over the
  step's items. HF divides it by ``gradient_accumulation_steps`` instead, which weighs a short
  micro-batch as much as a full one (a deliberate difference: docs/hooks.md).
* With ``label_smoothing_factor`` (and for models that return logits only) the loss is computed
  here from the logits: the summed item losses (cross-entropy, causal-LM with the one-token
  shift, or MSE for float labels) divided by ``num_items_in_batch``, or by this batch's own
  item count when the step does not need it; with smoothing, as HF's ``LabelSmoother`` computes it.
* A ``compute_loss`` plugin that does not take ``num_items_in_batch`` returns a mean: the step
  divides it by the number of micro-batches (corelooper/step.py).

Evaluation uses the same loss per batch and averages it over items (tokens), not batches.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .data.columns import call_model, model_inputs, raise_for_batch
from .data.loader import count_loss_items
from .errors import DataError


def split_batch(batch):
    """(args, kwargs, labels) for calling a model that returns logits."""
    if isinstance(batch, Mapping):
        kwargs = {k: v for k, v in batch.items() if k != "labels"}
        return (), kwargs, batch.get("labels")
    if isinstance(batch, (list, tuple)):
        if len(batch) == 1:
            return tuple(batch), {}, None
        return tuple(batch[:-1]), {}, batch[-1]
    return (batch,), {}, None


def logits_of(outputs):
    if torch.is_tensor(outputs):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    if logits is None and isinstance(outputs, (tuple, list)):
        logits = outputs[0]
    return logits


def predictions_of(outputs):
    """What evaluation and ``predict`` keep of a model's outputs: HF's ``prediction_step`` rule.

    A tensor is kept; a dict or ``ModelOutput``: every value but ``loss`` (unset ones are absent
    from a ``ModelOutput``); a tuple or list: without its leading loss (a 0-dim tensor, as HF's
    ``outputs[1:]`` when the model computed one). One value left: that tensor; several: a tuple
    of them (``compute_metrics`` then receives a tuple, as in HF). None when nothing is left.
    """
    if outputs is None or torch.is_tensor(outputs):
        return outputs
    if isinstance(outputs, Mapping):  # ModelOutput is a Mapping (an OrderedDict)
        kept = [v for k, v in outputs.items() if k != "loss" and v is not None]
    elif isinstance(outputs, (tuple, list)):
        kept = list(outputs)
        if kept and torch.is_tensor(kept[0]) and kept[0].dim() == 0:
            kept = kept[1:]
    else:
        logits = getattr(outputs, "logits", None)
        kept = [logits] if logits is not None else []
    kept = [v for v in kept if torch.is_tensor(v) or isinstance(v, (tuple, list))]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else tuple(kept)


def summed_loss(logits: torch.Tensor, labels: torch.Tensor, loss_type: str) -> torch.Tensor:
    """Sum (not mean) of the item losses, so the caller can normalise over a whole step."""
    if loss_type == "mse":
        return F.mse_loss(logits.float().view_as(labels), labels.float(), reduction="sum")
    if loss_type == "causal_lm":
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    logits, labels = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).long()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, causal: bool, epsilon: float, num_items):
    """HF's ``LabelSmoother`` (label_smoothing_factor), term for term: ``(1 - eps) * nll + eps *
    mean over classes of -log p``, each of the two sums divided by ``num_items`` apart. The same
    value as ``F.cross_entropy(label_smoothing=eps)`` summed and divided, but that fused kernel
    rounds differently: after a few steps the weights were 2e-6 to 1e-5 from HF's; these
    operations in HF's order give its weights bit for bit (tests/test_hf_differences.py).
    The logits are upcast to float32 first (HF takes log_softmax in the model's dtype)."""
    if causal:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    log_probs, labels = -F.log_softmax(logits.float(), dim=-1), labels.long().unsqueeze(-1)
    padding = labels.eq(-100)
    nll = log_probs.gather(dim=-1, index=labels.clamp(min=0)).masked_fill_(padding, 0.0).sum()
    smoothed = log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32).masked_fill_(padding, 0.0).sum()
    return (1 - epsilon) * (nll / num_items) + epsilon * (smoothed / (num_items * log_probs.shape[-1]))


def reads_num_items(loop, batch, whole_step: bool) -> bool:
    """Whether ``default_loss`` uses ``num_items_in_batch`` for this training batch. It does not
    when the model computes its own mean loss, does not take the count, and the step is this
    one batch in one process (``whole_step``: no weighting): the step can then skip counting
    (two kernels and a read)."""
    sig = loop.forward_signature
    if sig is None or sig.accepts_loss_kwargs or not sig.accepts_labels or not whole_step:
        return True
    if loop.loss_type != "mse" and getattr(loop.args, "label_smoothing_factor", 0.0):
        return True
    return not (isinstance(batch, Mapping) and "labels" in batch)


def default_loss(loop, model, batch, num_items_in_batch, return_outputs: bool):
    sig = loop.forward_signature
    if isinstance(batch, Mapping):
        batch = model_inputs(loop, batch)  # drop columns forward() does not take (logged once)
    smoothing = getattr(loop.args, "label_smoothing_factor", 0.0) if loop.loss_type != "mse" else 0.0
    # With label smoothing the loss is computed here from the logits, as HF's LabelSmoother does.
    if sig.accepts_labels and isinstance(batch, Mapping) and "labels" in batch and not smoothing:
        kwargs = dict(batch)
        if sig.accepts_loss_kwargs and num_items_in_batch is not None:
            kwargs["num_items_in_batch"] = num_items_in_batch
        outputs = call_model(loop, model, (), kwargs)
        loss = outputs["loss"] if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if loss is None:
            loss = outputs[0]
        if not sig.accepts_loss_kwargs and num_items_in_batch is not None and loop.is_training:
            # The model can only give the mean over this batch's items: weigh it by their share
            # of the step's, which is sum / num_items_in_batch, exact under GA and across ranks
            # (exactly 1 for a whole step; evaluation counts per batch: always 1, skipped).
            loss = loss * (count_loss_items(batch, loop.loss_type) / num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    args, kwargs, labels = split_batch(batch)
    outputs = call_model(loop, model, args, kwargs)
    if labels is None:
        raise DataError(
            "The batch has no labels (a 'labels' key, or a last element of a tuple sample), "
            "and the model does not compute its own loss. Add labels to the dataset, or "
            "implement the compute_loss hook in a plugin."
        )
    logits = logits_of(outputs)
    if num_items_in_batch is None:
        counted = labels[..., 1:] if loop.loss_type == "causal_lm" else labels  # after the shift
        num_items_in_batch = (counted != -100).sum() if loop.loss_type != "mse" else labels.numel()
    try:
        loss = (
            smoothed_loss(logits, labels, loop.loss_type == "causal_lm", smoothing, num_items_in_batch)
            if smoothing
            else summed_loss(logits, labels, loop.loss_type) / num_items_in_batch
        )
    except Exception as e:  # labels that do not fit the logits: the column named (exit 4)
        raise_for_batch(loop, model, {"labels": labels}, e, logits.shape[-1] if logits.dim() else None)
        raise
    return (loss, outputs) if return_outputs else loss
