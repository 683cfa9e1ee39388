"""The LM head and the loss only over the positions that train (``[lm] head = "trained"``).

In chat SFT about half of the tokens are prompt (``labels == -100``): the HF loss still computes
their logits (``[tokens, vocab]``, the largest matmul of a small model) and throws them away. Here a
forward pre-hook on the model's output layer takes the final hidden states and hands the layer
only the rows whose (shifted) label is counted, as one ``[1, n, hidden]`` row, so no logits exist
for the rest. The model's own forward still runs the layer and whatever it does to the logits
afterwards (Gemma 2's soft-capping, Cohere's ``logit_scale``, a LoRA-wrapped ``lm_head``): all of it
acts on each position alone, so the kept logits are the ones the full head computes.

The loss is HF's ``ForCausalLMLoss`` over those logits: labels shifted (or ``shift_labels``),
``logits.float()``, cross-entropy summed over the counted tokens and divided by the step's
``num_items_in_batch`` (GA- and DDP-exact as the default loss). What it cannot reproduce it does not
take: a model whose ``loss_function`` is not HF's causal-LM loss, an MoE model that adds its router
loss (``output_router_logits``), a model without an output layer (``get_output_embeddings``) or
one that calls it other than once per forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

MODES = ("auto", "trained", "all")


def unwrapped(model):
    """The HF model inside DDP / DeepSpeed (``.module``) and PEFT (``get_base_model``) wrappers."""
    inner = model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


@contextmanager
def swapped_forward(module: torch.nn.Module, forward):
    """``module.forward`` is ``forward`` within the block; then what it was: the class's (and
    ``deepcopy`` never sees the closure), or an instance's own (accelerate's device-map hooks)."""
    own = vars(module).get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def why_not_exact(model) -> str | None:
    """None when the trained-positions head gives this model's own loss; else the reason."""
    inner = unwrapped(model)
    name = type(inner).__name__
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        return f"{name} has no output layer (get_output_embeddings()): not a Hugging Face causal LM"
    config = getattr(inner, "config", None)
    if getattr(config, "output_router_logits", False):
        return f"{name} adds its router (MoE) loss to the cross-entropy (config.output_router_logits)"
    loss_function = getattr(type(inner), "loss_function", None)
    if loss_function is not None:  # HF models: a property that picks the loss from LOSS_MAPPING
        try:
            from transformers.loss.loss_utils import ForCausalLMLoss
        except ImportError:  # older transformers: no loss mapping, the loss is the plain one
            return None
        picked = getattr(inner, "loss_function", None)
        if picked is not ForCausalLMLoss:
            return f"{name}'s loss_function is {getattr(picked, '__name__', picked)!r}, not ForCausalLMLoss"
    return None


def causal_targets(batch) -> torch.Tensor:
    """Each position's target: ``shift_labels`` when given, else ``labels`` shifted left by one
    (the last position predicts nothing), exactly as HF's ``ForCausalLMLoss`` shifts them."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return F.pad(batch["labels"][..., 1:], (0, 1), value=-100)


class HeadCallError(RuntimeError):
    """The model did not call its output layer exactly once with ``[..., positions, hidden]``."""


def trained_positions_loss(
    model, batch, num_items_in_batch, label_smoothing: float = 0.0, accuracy=None
) -> torch.Tensor:
    """The causal-LM loss of ``model`` on ``batch``, with logits only where a label is counted.

    Equals the model's own loss (``model(**batch, num_items_in_batch=n).loss``) to float rounding,
    gradients too; ``label_smoothing`` as ``F.cross_entropy(..., label_smoothing=eps)`` (HF's
    ``LabelSmoother`` on the logits); ``accuracy`` (a ``TrainTokenAccuracy``) counts the logits'
    argmax hits. Raises ``HeadCallError`` when the model's forward does not call its output layer
    once with hidden states shaped like the labels.
    """
    from .trained_layer import trimmed_last_layer

    targets = causal_targets(batch)
    keep = targets != -100
    head = unwrapped(model).get_output_embeddings()
    calls: list[tuple] = []
    with trimmed_last_layer(model, keep) as trimmed:

        def gather(_module, args):
            calls.append(tuple(args[0].shape))
            if trimmed or len(calls) > 1 or args[0].shape[:-1] != keep.shape:
                return None  # the kept rows already, or not the one call we understand (raised below)
            return (args[0][keep].unsqueeze(0), *args[1:])

        handle = head.register_forward_pre_hook(gather)
        try:
            outputs = model(
                **{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}, use_cache=False
            )
        finally:
            handle.remove()
    kept = int(keep.sum()) if keep.device.type == "cpu" else None
    expected = (1, kept) if trimmed else tuple(keep.shape)
    if len(calls) != 1 or (calls[0][:-1] != expected and not (trimmed and kept is None)):
        raise HeadCallError(
            f"the output layer was called {len(calls)} time(s) with input shapes {calls}, "
            f"expected once with {expected} + (hidden,)"
        )
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
    if logits.dim() != 3 or (kept is not None and logits.shape[1] != kept):
        raise HeadCallError(
            f"the model returned logits of shape {tuple(logits.shape)} from {kept} kept positions"
        )
    kept_targets = targets[keep].long()
    # a view of the one row: select's backward (``logits[0]``) would zero and copy a logits-sized array
    logits = logits.reshape(-1, logits.shape[-1])
    if accuracy is not None:
        accuracy.add(logits, kept_targets)
    total = F.cross_entropy(
        logits.float(), kept_targets, ignore_index=-100, reduction="sum", label_smoothing=label_smoothing
    )
    if num_items_in_batch is None:
        num_items_in_batch = keep.sum()
    return total / num_items_in_batch


EVAL_CHUNK_BYTES = 4 * 2**20  # one chunk's float32 log-softmax in an evaluation with a metric


def slice_rows(vocab: int) -> int:
    """Rows per slice of an evaluation's logits: ``EVAL_CHUNK_BYTES`` of float32, at least 64."""
    return max(64, EVAL_CHUNK_BYTES // (4 * vocab))


def loss_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None, label_smoothing: float = 0.0
) -> torch.Tensor:
    """HF's causal-LM loss from a forward's ``logits`` (``[..., positions, vocab]``) and
    ``causal_targets``, over slices of rows (views: no copy of float32 logits): the log-softmax of
    one slice at a time, never a second array as large as the logits, which an evaluation with a
    metric keeps."""
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long()
    rows = slice_rows(logits.shape[-1])
    total = torch.zeros((), device=logits.device, dtype=torch.float32)
    for start in range(0, flat.shape[0], rows):
        total = total + F.cross_entropy(
            flat[start : start + rows].float(),
            flat_targets[start : start + rows],
            ignore_index=-100,
            reduction="sum",
            label_smoothing=label_smoothing,
        )
    return total / ((flat_targets != -100).sum() if num_items_in_batch is None else num_items_in_batch)
