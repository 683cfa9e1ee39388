"""The out-of-memory report: what was being done, the breakdown, three settings that would
make it fit, ranked by the memory they save (torchtitan dumps a snapshot; this also says why)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .units import fmt

# What chunking keeps of a micro-batch's logits: one chunk (corelooper_lm.chunked_ce.CHUNK_BYTES)
CHUNK_BYTES = 256 * 2**20


def _head_option(b: dict[str, Any], vocab: int | None) -> list[tuple[float, str]]:
    """A language model's float32 logits and their gradient are ``2 x tokens x vocab x 4`` bytes of
    the micro-batch's activations (5 GB at 8 x 1024 tokens of a 151,936-token vocabulary): the
    chunked loss keeps one chunk of them (benchmarks/large_vocab measures it)."""
    act, per_token = b.get("activations") or 0, b.get("activations_per_token")
    if not (vocab and act and per_token):
        return []
    logits = 2 * (act / per_token) * vocab * 4
    saved = min(act, logits) - CHUNK_BYTES
    if saved <= 0:
        return []
    return [
        (
            saved,
            '[lm] loss = "chunked" (the LM head\'s logits a chunk of rows at a time, never all '
            f'{vocab:,} columns for every token; [sft] runs also keep [lm] head = "auto": the trained '
            "positions only)",
        )
    ]


def _options(
    b: dict[str, Any], args, world: int, layers: int, vocab: int | None = None
) -> list[tuple[float, str]]:
    """(bytes saved, advice) for each applicable setting."""
    act, out = b.get("activations") or 0, _head_option(b, vocab)
    mb, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if mb > 1 and act:
        new_mb = max(1, mb // 4)
        out.append(
            (
                act * (1 - new_mb / mb),
                f"gradient accumulation: per_device_train_batch_size = {new_mb}, "
                f"gradient_accumulation_steps = {ga * mb // new_mb} (same effective batch; or "
                "train.auto_find_batch_size = true)",
            )
        )
    if not args.gradient_checkpointing and act:
        keep = 2 / layers if layers > 2 else 0.25  # one input per layer + one layer recomputed
        out.append(
            (
                act * (1 - keep),
                "train.gradient_checkpointing = true (recomputes activations in backward, ~30% slower)",
            )
        )
    static = b["gradients"] + b["optimizer_states"]
    if world > 1:
        out.append(
            (
                (b["parameters"] + static) * (1 - 1 / world),
                f"shard the model over the {world} processes: [fsdp] (FSDP2) or [deepspeed] zero_stage = 3",
            )
        )
    else:
        out.append(
            (
                b["optimizer_states"],
                '[deepspeed] zero_stage = 2 with offload_optimizer = "cpu" (optimizer states in CPU memory)',
            )
        )
    out.append(
        (static * 0.99, "LoRA: a [peft] section (gradients and optimizer states for ~1% of the weights)")
    )
    if b.get("activations_per_token") and act:
        out.append(
            (
                act / 2,
                "halve the sequence length (max_length of the tokenizer/collator, or pack shorter rows)",
            )
        )
    return out


def report(
    phase: str,
    step: int,
    b: dict[str, Any] | None,
    args,
    world: int,
    layers: int,
    exc: BaseException,
    vocab: int | None = None,
) -> str:
    """The paragraph; ``vocab``: the output layer's rows of a language model (None otherwise)."""
    what = f"doctor: out of memory at step {step + 1} during {phase}"
    what += f" (per_device_train_batch_size {args.per_device_train_batch_size}, "
    what += f"gradient_accumulation_steps {args.gradient_accumulation_steps}): {str(exc).splitlines()[0][:200].rstrip('.')}."
    if not b:
        return what + (
            " It happened before the first step finished, so no breakdown was measured; "
            "start with a smaller per_device_train_batch_size (or "
            "train.auto_find_batch_size = true) to see one."
        )
    parts = [
        what,
        f"Memory per process: parameters {fmt(b['parameters'])}, gradients "
        f"{fmt(b['gradients'])}, optimizer states {fmt(b['optimizer_states'])}, activations "
        f"~{fmt(b.get('activations'))} per micro-batch of {b.get('micro_batch')}, of "
        f"{fmt(b.get('capacity'))}.",
    ]
    ranked = sorted(_options(b, args, world, layers, vocab), key=lambda o: o[0], reverse=True)[:3]
    parts.append(
        "What would make it fit, most memory saved first: "
        + "; ".join(f"({i}) {text} — saves ~{fmt(saved)}" for i, (saved, text) in enumerate(ranked, 1))
        + "."
    )
    return " ".join(parts)


def output_rows(model) -> int | None:
    """The vocabulary of a language model (its output layer's rows; an HF model's
    ``get_output_embeddings``), None for another model."""
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    weight = getattr(layer, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None


def dump_cuda_snapshot(output_dir: str, rank: int) -> str | None:
    """torch's allocator snapshot (open it at https://pytorch.org/memory_viz); CUDA only."""
    import torch

    if not torch.cuda.is_available():
        return None
    path = Path(output_dir) / "doctor" / f"oom-snapshot-rank{rank}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return str(path)
