"""Train tiny Loops described by a JSON spec, in every rank of a torchrun job (or in one process).

``python -m torch.distributed.run --nproc_per_node 2 tests/distributed_worker.py SPEC.json``
runs each entry of ``spec["runs"]`` in turn (one process group for all: one start-up) and each
rank writes ``<result>.rank<R>.json`` (per-step losses, eval metrics, a fingerprint of its
parameters) so the test can compare ranks with each other and with a one-process run.
``run_one(spec)`` is the same run in the calling process (world size 1, the reference).
Used by tests/test_distributed*.py and by the FSDP / DeepSpeed plugin tests.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

VOCAB, SEQ_LEN = 32, 12


class Block(nn.Module):
    """A residual MLP block: the unit FSDP wraps (``wrap = ["Block"]``)."""

    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, h):
        return h + self.drop(torch.tanh(self.fc(h)))


class Classifier(nn.Module):
    def __init__(self, dim: int = 16, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList([Block(dim, dropout) for _ in range(2)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class TinyLM(nn.Module):
    """Causal: position t sees the running mean of positions <= t; returns logits only."""

    def __init__(self, dim: int = 16, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([Block(dim, dropout) for _ in range(2)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        h = h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[None, :, None]
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def classification(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 2
    y = torch.randint(0, 4, (n,), generator=g)
    x = centers[y] + torch.randn(n, 8, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def lm_samples(n: int, seed: int) -> list[dict]:
    """Variable-length sequences right-padded to SEQ_LEN; padding labels are -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, SEQ_LEN + 1, (1,), generator=g))
        ids = torch.zeros(SEQ_LEN, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        labels = torch.full((SEQ_LEN,), -100, dtype=torch.long)
        labels[:length] = ids[:length]
        out.append({"input_ids": ids, "labels": labels})
    return out


def tiny_llama():
    """A 1-layer ``LlamaForCausalLM`` from a config (an HF model computing its own loss)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="eager",
        )
    )


class MetricsProbe:
    """compute_metrics that records how many predictions it saw (no duplicated padding)."""

    name = "metrics_probe"

    def compute_metrics(self, predictions, label_ids):
        if predictions.dim() == 3:  # LM: token accuracy over loss-bearing positions
            mask = label_ids[:, 1:] != -100
            right = (predictions[:, :-1].argmax(-1) == label_ids[:, 1:]) & mask
            acc = right.sum() / mask.sum()
        else:
            acc = (predictions.argmax(-1) == label_ids).float().mean()
        return {"accuracy": acc.item(), "num_predictions": predictions.shape[0]}


def run_one(spec: dict) -> dict:
    """Train (and evaluate) as ``spec`` says; returns losses, metrics and parameter facts."""
    from corelooper.config import Config
    from corelooper.loop import Loop

    torch.manual_seed(0)
    task = spec.get("task", "classify")
    lm = task in ("lm", "llama")
    dropout = spec.get("dropout", 0.0)
    model = (
        tiny_llama() if task == "llama" else TinyLM(dropout=dropout) if lm else Classifier(dropout=dropout)
    )
    n_train, n_eval = spec.get("n_train", 48), spec.get("n_eval", 13)
    make = lm_samples if lm else classification
    train = {
        "disable_tqdm": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "learning_rate": 1e-2,
        "max_grad_norm": 0.0,
        **spec["train"],
    }
    cfg = Config.from_dict({"train": train, **spec.get("sections", {})})
    loop = Loop(
        model, cfg, train_dataset=make(n_train, 1), eval_dataset=make(n_eval, 2), plugins=[MetricsProbe()]
    )
    if spec.get("evaluate_first"):  # HF habit: evaluate the untrained model, then train
        loop.evaluate()
    if not spec.get("eval_only"):
        loop.train(resume_from_checkpoint=spec.get("resume"))
    metrics = loop.evaluate() if spec.get("evaluate", True) else {}
    local = loop.backend.unwrap_model(loop.model)
    for m in local.modules():  # FSDP2 may keep units unsharded after a forward
        if hasattr(m, "reshard"):
            m.reshard()
    # FSDP2: this rank's shard of each parameter (copied: a later gather may free its storage)
    # (DeepSpeed ZeRO-3: the partition in ds_tensor)
    flat = [
        (p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p))
        .detach()
        .float()
        .reshape(-1)
        .clone()
        for p in local.parameters()
    ]
    full = loop.backend.model_state_dict(loop.model)  # collective: gathered to the main rank
    result = {
        "full_params": torch.cat([full[k].float().reshape(-1) for k in sorted(full)]).tolist()
        if loop.backend.is_main_process
        else None,
        "losses": {str(h["step"]): h["loss"] for h in loop.state.log_history if "loss" in h},
        "grad_norms": {str(h["step"]): h["grad_norm"] for h in loop.state.log_history if "grad_norm" in h},
        "metrics": metrics,
        "world_size": loop.backend.num_processes,
        "rank": loop.backend.process_index,
        "backend": type(loop.backend).__name__,
        "wrapped": type(loop.model).__name__,
        "local_params": torch.cat(flat).tolist() if flat else [],
        "global_step": loop.state.global_step,
    }
    return result


def torchrun(runs: list[dict], tmp_path: Path, nproc: int = 2, timeout: float = 180) -> list[dict]:
    """Run ``runs`` in one ``torchrun --nproc_per_node nproc`` job; ``[{rank: result}]`` per run."""
    import subprocess

    for i, run in enumerate(runs):
        run.setdefault("result", str(tmp_path / f"result{i}"))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        __file__,
        str(spec),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return [
        {r: json.loads(Path(f"{run['result']}.rank{r}.json").read_text()) for r in range(nproc)}
        for run in runs
    ]


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", 0))
    for run in spec["runs"]:
        if run.get("expect_error"):  # a run that must refuse to start: record its message
            from corelooper.errors import CorelooperError

            try:
                run_one(run)
                result = {"error": None}
            except CorelooperError as e:
                result = {"error": f"{type(e).__name__}: {e}"}
        else:
            result = run_one(run)
        Path(f"{run['result']}.rank{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
