"""Per-sample loss weights from a dataset column, as a ``compute_loss`` implementation.

The loss of a micro-batch is ``sum_i(w_i * ce_i) / num_items_in_batch``: item-normalised over the
whole optimizer step, so gradient accumulation stays exact (the micro-batch losses of a step add
up to the step's weighted mean). Batches without the column (the evaluation set here) return
``None``, and the next provider (the builtin, unweighted loss) answers.
"""

from __future__ import annotations

import torch.nn.functional as F

from corelooper import hookimpl


@hookimpl
def corelooper_config_sections():
    return {"weighted_loss": {"column": "difficulty_score", "power": 1.0}}


def weights_of(batch, column: str, power: float):
    return batch[column].float() ** power


@hookimpl
def compute_loss(loop, model, batch, num_items_in_batch, return_outputs):
    cfg = loop.config.section("weighted_loss")
    if not isinstance(batch, dict) or cfg["column"] not in batch:
        return None
    weights = weights_of(batch, cfg["column"], cfg["power"])
    inputs = {k: v for k, v in batch.items() if k not in ("labels", cfg["column"])}
    logits = model(**inputs)
    per_item = F.cross_entropy(logits.float(), batch["labels"], reduction="none", ignore_index=-100)
    loss = (weights * per_item).sum() / num_items_in_batch
    return (loss, logits) if return_outputs else loss
