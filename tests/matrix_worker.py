"""Every phase of one backend for a full and a LoRA model, in one process group.

``python -m torch.distributed.run --nproc_per_node 2 tests/matrix_worker.py SPEC.json`` (or plain
``python``: the one-process reference) runs, for each model kind in ``spec["models"]``:

1. train 6 steps (evaluating at step 3, saving every 2 steps), then ``evaluate()`` and
   ``predict()``; the final model is exported (LoRA: also merged, ``merge_on_export``);
2. a fresh Loop resumed from ``checkpoint-4`` of run 1, trained to step 6.

Each rank writes ``<out>/<model>.rank<R>.json``: per-step losses, eval loss, predictions, the
final full weights of both runs, and the ``model.training`` / grad-mode pairs the loss saw.

The model is a tiny Llama with **dropout on** and a loss that **depends on model.training**
(a z-loss term in training only). The dropout mask is a fixed function of (token, position,
feature) rather than an RNG draw: 2 ranks x half the batch then drop exactly what 1 process x
the whole batch drops, so the runs can be compared to 1e-5 (an RNG mask depends on how the
batch is split across processes, and nothing could be compared).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB, SEQ, DROP = 64, 12, 0.2
STEPS, SAVE_STEPS, EVAL_STEPS, RESUME_AT = 6, 2, 3, 4
BACKENDS = {
    "ddp": {},
    "fsdp": {"fsdp": {}},
    "zero1": {"deepspeed": {"zero_stage": 1}},
    "zero2": {"deepspeed": {"zero_stage": 2}},
    "zero3": {"deepspeed": {"zero_stage": 3}},
}
LORA = {
    "method": "lora",
    "merge_on_export": True,
    "config": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
}


def hashed_dropout(module, inputs, output):
    """Dropout with a mask fixed by (token, position, feature); identity in eval mode."""
    if not module.training:
        return output
    ids = inputs[0]
    feat = torch.arange(output.shape[-1])
    key = ids[..., None] * 7919 + torch.arange(ids.shape[1])[None, :, None] * 104729 + feat * 1299709
    keep = (key % 1000) >= DROP * 1000
    return output * keep / (1 - DROP)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    model.get_input_embeddings().register_forward_hook(hashed_dropout)
    return model


def samples(n: int, seed: int) -> list[dict]:
    """Sequences right-padded to SEQ; the padding and the first 2 tokens (a "prompt") carry
    no loss, so ranks hold different numbers of loss tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, SEQ + 1, (1,), generator=g))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        labels = torch.full((SEQ,), -100, dtype=torch.long)
        labels[2:length] = ids[2:length]
        out.append({"input_ids": ids, "labels": labels})
    return out


def token_losses(logits, labels, training: bool):
    """Per-token loss of the shifted sequence; training adds a z-loss (PaLM) term."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="none")
    if training:
        ce = ce + 0.1 * torch.logsumexp(logits, -1).reshape(-1) ** 2 * (labels.reshape(-1) != -100)
    return ce


class TrainingAwareLoss:
    """compute_loss whose value depends on ``model.training``; records the modes it saw."""

    name = "training_aware_loss"

    def __init__(self):
        self.seen: list[tuple[bool, bool]] = []  # (model.training, grad enabled)

    def compute_loss(self, model, batch, num_items_in_batch, return_outputs):
        self.seen.append((bool(model.training), torch.is_grad_enabled()))
        out = model(input_ids=batch["input_ids"])
        loss = token_losses(out.logits, batch["labels"], model.training).sum() / num_items_in_batch
        return (loss, out) if return_outputs else loss


def make_loop(spec: dict, kind: str, output_dir: Path, world: int):
    from corelooper import Loop

    train = {
        "output_dir": str(output_dir),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4 // world,
        "per_device_eval_batch_size": 3,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-2,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "eval_strategy": "steps",
        "eval_steps": EVAL_STEPS,
        "save_strategy": "steps",
        "save_steps": SAVE_STEPS,
        "disable_tqdm": True,
        "seed": 3,
    }
    sections = dict(BACKENDS[spec["backend"]])
    if kind == "lora":
        sections["peft"] = LORA
    loss = TrainingAwareLoss()
    loop = Loop(
        tiny_llama(),
        {"train": train, **sections},
        train_dataset=samples(24, 1),
        eval_dataset=samples(10, 2),
        plugins=[loss],
    )
    return loop, loss


def full_weights(loop) -> dict[str, list]:
    state = loop.backend.model_state_dict(loop.model)  # a collective: every rank calls it
    return {k: v.float().reshape(-1).tolist() for k, v in sorted(state.items())}


def run_kind(spec: dict, kind: str, world: int) -> dict:
    out = Path(spec["out"]) / kind
    loop, loss = make_loop(spec, kind, out / "run", world)
    loop.train()
    modes = {"train": sorted(set(loss.seen))}
    loss.seen.clear()
    metrics = loop.evaluate()
    preds, labels, _ = loop.predict(samples(10, 2))
    modes["eval"] = sorted(set(loss.seen))
    modes["after_eval"] = bool(loop.model.training)
    result = {
        "losses": {str(h["step"]): h["loss"] for h in loop.state.log_history if "loss" in h},
        "evals": {str(h["step"]): h["eval_loss"] for h in loop.state.log_history if "eval_loss" in h},
        "eval_loss": metrics["eval_loss"],
        "modes": modes,
        "predictions": preds.tolist(),
        "label_ids": labels.tolist(),
        "weights": full_weights(loop),
        "backend": type(loop.backend).__name__,
        "wrapped": type(loop.model).__name__,
    }
    resumed, _ = make_loop(spec, kind, out / "resumed", world)
    resumed.train(resume_from_checkpoint=str(out / "run" / f"checkpoint-{RESUME_AT}"))
    result["resumed_losses"] = {
        str(h["step"]): h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > RESUME_AT
    }
    result["resumed_weights"] = full_weights(resumed)
    return result


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    for kind in spec["models"]:
        result = run_kind(spec, kind, world)
        Path(spec["out"], f"{kind}.rank{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
