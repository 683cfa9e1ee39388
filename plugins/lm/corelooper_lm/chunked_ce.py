"""Cross-entropy from hidden states and the output-embedding weight, in chunks of tokens.

A causal LM's loss usually materialises ``logits = hidden @ weight.T`` for every token, upcast to
float32 (``[tokens, vocab]``: 4 GiB for 8k tokens of a 128k vocabulary), then a softmax of the
same size in backward. Here the tokens go through in chunks: forward keeps only each token's
log-sum-exp, backward recomputes one chunk's logits at a time and turns them straight into the
gradients of ``hidden`` and ``weight``. Peak memory is one chunk's logits instead of all of them;
the result is the same sum as ``F.cross_entropy(logits.float(), labels, reduction="sum")``.

The loss is a **sum** over the counted tokens (``ignore_index`` skipped), so the caller divides by
the step's ``num_items_in_batch`` and gradient accumulation stays exact, as with the default loss.
Pure torch (the idea of Liger's fused linear cross-entropy, without its kernels).
"""

from __future__ import annotations

import contextlib

import torch

CHUNK_BYTES = 256 * 2**20  # one chunk's float32 logits: ~523 tokens of a 128k vocabulary


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # As the model's lm_head then the HF loss: matmul in the model's dtype, then upcast to float32.
    logits = h @ weight.t()
    if bias is not None:
        logits.add_(bias)
    return logits if logits.dtype == torch.float64 else logits.float()


def chunk_tokens_for(vocab: int) -> int:
    """Tokens per chunk: one chunk's float32 logits stay near ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (4 * vocab))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, ignore_index, smoothing, count_hits):
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for a float64 model
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            logits = _chunk_logits(hidden[sl], weight, bias)
            if count_hits is not None:  # before _chunk_forward turns the logits into its scratch
                count_hits(logits, labels[sl])
            lse[sl], loss = _chunk_forward(logits, labels[sl], ignore_index, smoothing)
            total += loss
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk, ctx.ignore_index, ctx.smoothing = chunk, ignore_index, smoothing
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = lse.dtype  # gradients of weight and bias are summed over chunks in float32 (or 64)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            h = hidden[sl]
            g = _chunk_grad_logits(
                _chunk_logits(h, weight, bias), lse[sl], labels[sl], ctx.ignore_index, ctx.smoothing
            ).mul_(grad_total)
            g = g.to(weight.dtype)  # the gradient of the upcast, as autograd would give it
            if need_h:
                grad_h[sl] = g @ weight
            if need_w:
                grad_w.addmm_(g.t().to(acc), h.to(acc))
            if need_b:
                grad_b += g.to(acc).sum(0)
            del g
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _chunk_forward(logits, labels, ignore_index: int, smoothing: float):
    """(log-sum-exp per token, summed loss) of one chunk; uses ``logits`` as its scratch buffer.

    Each token's loss is ``(1 - eps) * nll + eps * mean over the vocabulary of -log p``, as
    ``F.cross_entropy(..., label_smoothing=eps)``.
    """
    counted = labels != ignore_index
    target = labels.masked_fill(~counted, 0)
    picked = logits.gather(1, target[:, None]).squeeze(1)
    mean_logit = logits.mean(-1) if smoothing else None
    top = logits.amax(-1, keepdim=True)
    lse = logits.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(1))  # in place: no second buffer
    nll = lse - picked
    if smoothing:
        nll = (1.0 - smoothing) * nll + smoothing * (lse - mean_logit)
    return lse, nll.masked_fill(~counted, 0.0).sum()


def _chunk_grad_logits(logits, lse, labels, ignore_index: int, smoothing: float) -> torch.Tensor:
    """d(summed loss)/d(logits) of one chunk: ``softmax - target distribution``, 0 on ignored rows.

    Computed in place on ``logits``: one chunk-sized buffer for both.
    """
    counted = labels != ignore_index
    target = labels.masked_fill(~counted, 0)
    grad = logits.sub_(lse[:, None]).exp_()
    if smoothing:
        grad.sub_(smoothing / logits.shape[-1])
    grad.scatter_add_(1, target[:, None], torch.full_like(grad[:, :1], -(1.0 - smoothing)))
    return grad.mul_(counted[:, None])


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    chunk_tokens: int | None = None,
    count_hits=None,
) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T + bias).float(), labels, reduction="sum")``, chunked.

    ``hidden``: ``[..., hidden_size]``; ``weight``: ``[vocab, hidden_size]`` (the lm_head /
    output-embedding weight); ``labels``: ``hidden.shape[:-1]``, already aligned with ``hidden``
    (shift them first for a causal LM). ``chunk_tokens``: tokens per chunk (default: ~256 MiB of
    float32 logits per chunk). Returns a float32 scalar: the summed loss over the tokens whose
    label is not ``ignore_index``. ``count_hits(logits, labels)``, when given, sees each chunk's
    float32 logits and labels in forward (``token_accuracy`` counts their argmax there).
    """
    chunk_tokens = chunk_tokens_for(weight.shape[0]) if chunk_tokens is None else chunk_tokens
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device, torch.long)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape)}")
    return _ChunkedCrossEntropy.apply(
        h, weight, bias, y, chunk_tokens, ignore_index, float(label_smoothing), count_hits
    )


# Configurations whose logits are not ``hidden @ weight.T``: the chunked loss would train on
# something else, so it refuses them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")


def output_head(model) -> torch.nn.Linear:
    """The plain ``nn.Linear`` output layer of the HF causal LM inside ``model`` (DDP, PEFT unwrapped)."""
    from corelooper.errors import ConfigError

    inner = model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    name = type(inner).__name__
    if head is None:
        raise ConfigError(
            f"lm.loss = 'chunked' needs a Hugging Face causal LM (one with get_output_embeddings()); "
            f"{name} is not one. Use lm.loss = 'default', or compute the loss in a compute_loss "
            "plugin with corelooper_lm.chunked_ce.chunked_cross_entropy."
        )
    config = getattr(inner, "config", None)
    scaled = [k for k in _LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1, 1.0)]
    if type(head) is not torch.nn.Linear or scaled:
        why = f"its config sets {scaled[0]}" if scaled else f"its output layer is a {type(head).__name__}"
        raise ConfigError(
            f"lm.loss = 'chunked' computes logits as hidden @ lm_head.weight.T, but {name}'s "
            f"logits are not that ({why}; e.g. LoRA on lm_head, logit soft-capping). Use "
            "lm.loss = 'default' for this model."
        )
    return head


def chunked_causal_lm_loss(
    loop,
    model,
    batch,
    num_items_in_batch,
    label_smoothing: float = 0.0,
    trained_only: bool = False,
    accuracy=None,
):
    """The training loss of an HF causal LM with the chunked cross-entropy, GA-exact.

    The model runs through its own ``forward`` (so DDP and PEFT wrappers see the call), without
    labels. A pre-hook on its output layer takes the layer's input (the final hidden states,
    exactly what the logits would be computed from) and hands the layer an empty slice of it, so
    no logits are computed. Labels are shifted as HF's ``ForCausalLMLoss`` shifts them (or taken
    from ``shift_labels`` when the batch has them); the summed loss is divided by the step's
    ``num_items_in_batch``. ``trained_only``: only the hidden states of counted positions go
    through the chunks (``[lm] head = "trained"``), the others have no logits at all.
    ``accuracy`` (a ``TrainTokenAccuracy``) counts each chunk's argmax hits.
    """
    from corelooper.errors import ConfigError

    if loop.loss_type != "causal_lm":
        raise ConfigError(
            f"lm.loss = 'chunked' is a causal-LM loss, but this run's loss is "
            f"{loop.loss_type!r} (train.loss_type). Use lm.loss = 'default'."
        )
    from .trained_head import causal_targets
    from .trained_layer import trimmed_last_layer

    head = output_head(model)
    labels = causal_targets(batch)  # position t predicts token t + 1; the last predicts nothing
    keep = labels != -100
    captured: list[torch.Tensor] = []

    def take_hidden(_module, args):
        captured.append(args[0])
        return (args[0][..., :0, :],)

    with trimmed_last_layer(model, keep) if trained_only else contextlib.nullcontext([]) as trimmed:
        handle = head.register_forward_pre_hook(take_hidden)
        try:
            model(**{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}, use_cache=False)
        finally:
            handle.remove()
    if len(captured) != 1:
        raise ConfigError(
            f"lm.loss = 'chunked': the model called its output layer {len(captured)} times in one "
            "forward (expected once, with the final hidden states). Use lm.loss = 'default'."
        )
    hidden = captured[0]
    if trained_only:  # the kept rows only (the last layer may have computed nothing else)
        hidden, labels = (hidden[0] if trimmed else hidden[keep]), labels[keep]
    total = chunked_cross_entropy(
        hidden,
        head.weight,
        labels,
        bias=head.bias,
        label_smoothing=label_smoothing,
        count_hits=accuracy.add if accuracy is not None else None,
    )
    if num_items_in_batch is None:
        num_items_in_batch = (labels != -100).sum()
    return total / num_items_in_batch
