"""The user's only code: the training loss weighted by each sample's ``difficulty_score``.

Token losses are summed with their sample's weight and divided by ``num_items_in_batch`` (the
trained tokens of the whole optimizer step, over micro-batches and processes), so the weighted
loss stays exact under gradient accumulation and across ranks. Padded batches carry the score
per sample (``[B]``), packed ones per token (``[B, T]``). Evaluation batches (evaluation runs
under ``torch.no_grad()``; ``model.training`` is not reliable there: a DeepSpeed engine keeps it
True) return ``None``: the builtin, unweighted loss answers, so ``eval_loss`` stays a plain
token mean comparable across runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_loss(model, batch, num_items_in_batch, return_outputs):
    if not torch.is_grad_enabled() or "difficulty_score" not in batch:
        return None
    weight = batch["difficulty_score"]
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "difficulty_score")}
    outputs = model(**inputs)
    logits, labels = outputs.logits[:, :-1], batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
    weight = weight[:, None] if weight.dim() == 1 else weight[:, 1:]
    loss = (per_token * weight).sum() / num_items_in_batch
    return (loss, outputs) if return_outputs else loss
