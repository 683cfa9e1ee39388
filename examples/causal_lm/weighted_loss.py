"""Per-sample weighted causal-LM loss, as a ``compute_loss`` hook (the HF recipe subclasses
``Trainer.compute_loss``; here it is a plugin).

Each sample's ``difficulty_score`` w_i weights its tokens: loss = sum_i w_i * sum_t CE_it / N, with
N = ``num_items_in_batch`` (label tokens of the whole optimizer step), so the loss stays
token-normalised and gradient accumulation stays exact. Evaluation uses w = 1: the reported
``eval_loss``/``eval_perplexity`` stay comparable with an unweighted run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corelooper import hookimpl


def weighted_token_loss(logits, labels, weights, num_items):
    logits, labels = logits[:, :-1, :].float(), labels[:, 1:]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view_as(labels)
    return (ce * weights.to(ce.dtype)[:, None]).sum() / num_items


@hookimpl
def compute_loss(loop, model, batch, num_items_in_batch, return_outputs):
    weights = batch.get("difficulty_score")
    if weights is None:
        return None  # not a weighted dataset: let the default loss answer
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    outputs = model(**inputs)
    if not model.training:
        weights = torch.ones_like(weights)
    n = num_items_in_batch if num_items_in_batch is not None else (batch["labels"][:, 1:] != -100).sum()
    loss = weighted_token_loss(outputs.logits, batch["labels"], weights, n)
    return (loss, outputs) if return_outputs else loss
