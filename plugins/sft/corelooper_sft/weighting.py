"""``[sft] weight_column``: the training loss weighted per sample by a numeric data column.

Each trained token's cross-entropy is multiplied by its sample's value in the column and the sum
divided by ``num_items_in_batch`` (the trained tokens of the whole optimizer step, over
micro-batches and processes), as the example's ``examples/sft_chat/weighting.py`` does: exact under
gradient accumulation and across processes, and every weight 1 is the unweighted loss. Padded
batches carry the column per sample (``[B]``), packed and padding-free ones per token (``[B, T]``,
0 on padding). Evaluation keeps the plain token mean (``eval_loss`` comparable across runs): the
provider answers ``None`` under ``torch.no_grad()`` and the next loss answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from corelooper import hookimpl
from corelooper.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

NAME = "sft.weighted_loss"


def check_column(value) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise ConfigError(
        f'sft.weight_column = {value!r}: name a numeric column of the data (e.g. "difficulty"), '
        "whose value multiplies that sample's token losses; leave it unset for the plain loss."
    )


def check_weights(ds, column: str, where: str) -> None:
    """Every sample of the tokenized rows (a ``datasets.Dataset``) has a finite weight >= 0."""
    import numpy as np

    if column not in ds.column_names:
        raise DataError(
            f"{where}: [sft] weight_column = {column!r}, but the data has no numeric column of that "
            f"name (columns that travel to the batch: {_extras(ds) or 'none'}). Add the column to "
            "every row, or fix the name."
        )
    values = ds.data.column(column)
    missing = values.null_count
    array = values.to_numpy(zero_copy_only=False).astype(np.float64)
    bad = int(np.count_nonzero(~np.isfinite(array) | (array < 0))) - missing
    if missing or bad:
        raise DataError(
            f"{where}: [sft] weight_column = {column!r}: {missing} sample(s) lack a value and {bad} "
            "have a negative or non-finite one. Every sample needs a weight >= 0 (0: not trained)."
        )


def _extras(ds) -> str:
    skip = ("input_ids", "labels", "length", "trained", "untruncated_length")
    return ", ".join(repr(c) for c in ds.column_names if c not in skip)


class SampleWeightedLoss:
    """The ``compute_loss`` provider of a run with ``[sft] weight_column`` (registered as
    ``sft.weighted_loss``: corelooper-lm's loss gives way to it, and its logits are counted for
    ``token_accuracy``)."""

    def __init__(self, column: str):
        self.column = column

    @hookimpl
    def compute_loss(self, loop, model, batch, num_items_in_batch, return_outputs):
        import torch

        if not torch.is_grad_enabled() or not isinstance(batch, Mapping) or self.column not in batch:
            return None  # evaluation: the plain token mean (a DeepSpeed engine stays in train mode)
        from corelooper.data.columns import call_model, model_inputs
        from corelooper.losses import logits_of

        weight = batch[self.column]
        inputs = {k: v for k, v in model_inputs(loop, batch).items() if k not in ("labels", self.column)}
        outputs = call_model(loop, model, (), inputs)
        loss = weighted_token_loss(logits_of(outputs), batch["labels"], weight, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


def weighted_token_loss(logits, labels, weight, num_items_in_batch) -> torch.Tensor:
    """``sum over trained tokens of weight * cross-entropy / num_items_in_batch`` with the causal
    shift (position t predicts label t + 1); ``weight`` per sample ``[B]`` or per token ``[B, T]``
    (the label's token). Without ``num_items_in_batch``: over this batch's trained tokens."""
    import torch.nn.functional as F

    logits, labels = logits[:, :-1], labels[:, 1:]
    per_token = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
    weight = weight[:, None] if weight.dim() == 1 else weight[:, 1:]
    total = (per_token * weight.to(per_token.dtype)).sum()
    count = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
    return total / count
