"""One record per sample for a causal LM (``corelooper predict``), instead of one blob of logits.

Each sample of the data set (tokenized: ``input_ids`` and ``labels``, -100 where not trained, as
corelooper-sft prepares them; a packed data set is read sample by sample through its ``rows``)
gives a JSON line::

    {"index": 0, "loss": 2.31, "tokens": 7, "accuracy": 0.43,
     "predicted_ids": [...], "label_ids": [...], "target": "...",
     "prompt": "...", "generated": "..."}

``loss`` is the mean cross-entropy over the sample's trained tokens (position t predicts label
t + 1), ``predicted_ids`` the argmax at those positions, ``label_ids`` their targets. With
``max_new_tokens`` the sample's prompt (its tokens before the first trained one: for a chat row
with assistant-only loss, the conversation rendered by the chat template up to the assistant's
turn, generation prompt included) is continued by ``model.generate`` (greedy, stopping at the
tokenizer's EOS), and ``generated`` is the new text.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

IGNORE = -100


def samples(dataset):
    """The data set sample by sample: a packed one (items are lists of pieces) through its rows."""
    rows = getattr(dataset, "rows", None)
    if rows is not None and len(dataset) and isinstance(dataset[0], list):
        return rows
    return dataset


def records(
    model, dataset, batch_size: int, pad_token_id: int, tokenizer=None, max_new_tokens: int = 0, on_batch=None
) -> Iterator[dict]:
    """The per-sample records of ``model`` on ``dataset``, in dataset order; ``on_batch(items)``
    after each batch is scored (the run's ``on_prediction_step``: a progress bar)."""
    data = samples(dataset)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(data), batch_size):
            items = [data[i] for i in range(start, min(start + batch_size, len(data)))]
            with torch.no_grad():
                scored = score(model, items, pad_token_id, device)
            if on_batch is not None:
                on_batch(items)
            for k, record in enumerate(scored):
                record = {"index": start + k, **record}
                if tokenizer is not None:
                    record["target"] = tokenizer.decode(record["label_ids"])
                if max_new_tokens > 0:
                    record.update(generate(model, items[k], tokenizer, max_new_tokens, device))
                yield record
    finally:
        model.train(was_training)


def _pad(items: Sequence[Mapping], pad_token_id: int, device) -> tuple[torch.Tensor, ...]:
    width = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for r, it in enumerate(items):
        n = len(it["input_ids"])
        ids[r, :n] = torch.as_tensor(it["input_ids"])
        labels[r, :n] = torch.as_tensor(it.get("labels") or it["input_ids"])
        mask[r, :n] = 1
    return ids.to(device), labels.to(device), mask.to(device)


def score(model, items: Sequence[Mapping], pad_token_id: int, device) -> list[dict]:
    """Loss, trained-token count, accuracy, predicted and target ids of each item (right-padded)."""
    ids, labels, mask = _pad(items, pad_token_id, device)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    targets = labels[:, 1:]
    losses = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
    predicted = logits.argmax(-1)
    out = []
    for r in range(len(items)):
        trained = targets[r] != IGNORE
        n = int(trained.sum())
        hits = int((predicted[r][trained] == targets[r][trained]).sum())
        out.append(
            {
                "loss": round(float(losses[r][trained].sum()) / n, 6) if n else None,
                "tokens": n,
                "accuracy": round(hits / n, 6) if n else None,
                "predicted_ids": predicted[r][trained].tolist(),
                "label_ids": targets[r][trained].tolist(),
            }
        )
    return out


def prompt_length(item: Mapping) -> int:
    """The tokens before the first trained one (at least one token to continue from)."""
    labels = item.get("labels") or []
    first = next((t for t, x in enumerate(labels) if x != IGNORE), len(labels))
    return max(first, 1)


def generate(model, item: Mapping, tokenizer, max_new_tokens: int, device) -> dict:
    """``model.generate`` (greedy) continuing the item's prompt: ``{"prompt", "generated"}``."""
    prompt = list(item["input_ids"][: prompt_length(item)])
    ids = torch.tensor([prompt], device=device)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id if tokenizer is not None else eos,
        )
    new = out[0, len(prompt) :].tolist()
    if tokenizer is None:
        return {"prompt_ids": prompt, "generated_ids": new}
    return {
        "prompt": tokenizer.decode(prompt),
        "generated": tokenizer.decode(new, skip_special_tokens=True),
        "generated_ids": new,
    }


def is_causal_lm(model, dataset) -> bool:
    """A model that generates (not an encoder-decoder) on tokenized samples (``input_ids``)."""
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):
        return False
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        data = samples(dataset)
        first = data[0] if len(data) else None
    except (TypeError, IndexError, KeyError):  # a stream, or another kind of data set
        return False
    return isinstance(first, Mapping) and "input_ids" in first
