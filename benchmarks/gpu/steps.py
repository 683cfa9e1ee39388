"""The GPU benchmark's steps; each runs in its own process (bench.py) and returns a dict.

Sizes: ``full`` is a ~0.9B-parameter Llama from a config (hidden 2048, 16 layers, 16 heads / 8
KV heads, MLP 5632, vocab 32000, untied), batch 8 x 1024 tokens of synthetic chat (prompt 25%,
masked). ``smoke`` is a tiny one for validating the script on a CPU. No download anywhere.

Throughput is timed between optimizer steps (torch's global step hook, after ``warm`` steps, with
a device sync at both ends), so the start-up and the end-of-run save are not in it. MFU =
achieved FLOP/s / peak (H200 bf16 dense: 989 TFLOP/s); FLOPs per token = 6 N (full fine-tuning;
4 N for LoRA: no weight gradients for the frozen base) + 6 L d T for causal attention (N:
parameters without the input embedding, L layers, d hidden, T sequence length).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTIAL_ENV = "GPU_BENCH_PARTIAL"  # a file a long step keeps its results so far in (bench.py sets it)
sys.path.insert(0, str(ROOT / "benchmarks" / "sft"))

SIZES = {
    "full": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=5632,
        vocab_size=32000,
        seq=1024,
        batch=8,
        steps=12,
        warm=3,
    ),
    "smoke": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        seq=64,
        batch=2,
        steps=4,
        warm=1,
    ),
}
PEAK_FLOPS = {"bf16": 989e12, "fp16": 989e12, "fp32": 989e12 / 2}  # H200 SXM dense (tf32 ~half)


# This step process's folder for what its runs write (models, logs): removed when the process
# exits, so the benchmark leaves nothing behind in TMPDIR (a process killed by its budget excepted).
_SCRATCH: list[tempfile.TemporaryDirectory] = []


def run_dir(prefix: str) -> str:
    """A fresh output folder for one run of this step, inside the process's scratch folder."""
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="gpu-bench-"))
    return tempfile.mkdtemp(prefix=prefix, dir=_SCRATCH[0].name)


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak():
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib():
    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.max_memory_allocated() / 2**30, 2)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # CPU: peak RSS


def build_model(size: str, attn: str = "sdpa", dtype=None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SIZES[size]
    cfg = LlamaConfig(
        **{k: v for k, v in s.items() if k not in ("seq", "batch", "steps", "warm")},
        max_position_embeddings=max(s["seq"], 512),
        tie_word_embeddings=False,
        attn_implementation=attn,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(device()):
        model = LlamaForCausalLM(cfg)
    if dtype is not None:
        model = model.to(dtype)
    return model


def flops_per_token(model, size: str, lora: bool = False) -> float:
    s = SIZES[size]
    n = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "embed_tokens" not in name and "lora_" not in name
    )
    return (4 if lora else 6) * n + 6 * s["num_hidden_layers"] * s["hidden_size"] * s["seq"]


def chat_data(size: str, n: int):
    """Fixed-length synthetic chat rows: random ids, the first quarter (the prompt) masked."""
    import torch

    s = SIZES[size]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, s["vocab_size"], (n, s["seq"]), generator=g)
    labels = ids.clone()
    labels[:, : s["seq"] // 4] = -100
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


class StepClock:
    """Optimizer-step timestamps (device-synced), for throughput between steps ``warm`` and the last."""

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.t: list[float] = []
        self.handle = register_optimizer_step_post_hook(self._hook)

    def _hook(self, *_):
        sync()
        self.t.append(time.perf_counter())

    def rate(self, warm: int, tokens_per_step: int) -> dict:
        self.handle.remove()
        if len(self.t) <= warm:
            return {"error": f"only {len(self.t)} optimizer steps ran"}
        dt = (self.t[-1] - self.t[warm - 1]) / (len(self.t) - warm)
        return {
            "step_s": round(dt, 4),
            "tokens_per_s": round(tokens_per_step / dt, 1),
            "steps_timed": len(self.t) - warm,
        }


def with_mfu(out: dict, fpt: float, precision: str) -> dict:
    if "tokens_per_s" in out:
        out["mfu"] = round(out["tokens_per_s"] * fpt / PEAK_FLOPS[precision], 4)
        out["flops_per_token"] = fpt
    out["peak_mem_gib"] = max(peak_gib(), out.get("peak_mem_gib", 0.0))  # cl_train's, from the doctor's log
    return out


def doctor_peak_gib(log_history: list[dict]) -> float:
    """The device peak corelooper-doctor logged (its ``memory_max_allocated_gb``; its GB is 2**30).
    The doctor resets torch's peak counter at every log (each log gives that window's peak), so
    ``torch.cuda.max_memory_allocated()`` after a run reads the last window's peak only: the
    2026-12-04 H200 run read 9.97 GiB for corelooper's rows against the 28.09 the doctor logged."""
    peaks = [
        e["doctor/memory_max_allocated_gb"] for e in log_history if "doctor/memory_max_allocated_gb" in e
    ]
    return round(max(peaks), 2) if peaks else 0.0


# -- hand-written loops ------------------------------------------------------------------------


def raw_loop(size: str, precision: str = "bf16", lora: bool = False, compile_: bool = False) -> dict:
    import torch

    s = SIZES[size]
    reset_peak()
    model = build_model(size)
    if lora:
        model = lora_wrap(model)
    if compile_:
        model = torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)  # the kernel corelooper's default builds
    scaler = torch.amp.GradScaler(device().type) if precision == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    data = chat_data(size, s["batch"] * s["steps"])
    clock = StepClock()
    model.train()
    for step in range(s["steps"]):
        rows = data[step * s["batch"] : (step + 1) * s["batch"]]
        batch = {k: torch.stack([r[k] for r in rows]).to(device(), non_blocking=True) for k in rows[0]}
        with torch.autocast(device().type, dtype=dtype):
            loss = model(**batch).loss
        if scaler:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        opt.zero_grad(set_to_none=True)
    out = clock.rate(s["warm"], s["batch"] * s["seq"])
    out["final_loss"] = round(float(loss), 4)
    return with_mfu(out, flops_per_token(model, size, lora), precision)


def lora_wrap(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model,
        LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
    )


# -- corelooper --------------------------------------------------------------------------------


def missing_plugin(module: str, where: str) -> dict | None:
    """A true skip message when ``module`` cannot be imported in this venv, else None."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return {
            "skipped": f"{module} is not installed in this venv: pip install -e {where}"
            if where.startswith("plugins/")
            else f"{module} is not installed in this venv: {where}"
        }
    return None


def cl_train(
    model,
    dataset,
    size: str,
    precision: str = "bf16",
    sections: dict | None = None,
    collator=None,
    batch: int | None = None,
    **train,
) -> tuple[dict, object]:
    from corelooper import Loop
    from corelooper.config import Config

    s = SIZES[size]
    out_dir = run_dir("train-")
    cfg = {
        "train": {
            **dict(
                output_dir=out_dir,
                max_steps=s["steps"],
                per_device_train_batch_size=batch or s["batch"],
                learning_rate=1e-5,
                logging_steps=s["steps"],
                save_strategy="no",
                eval_strategy="no",
                disable_tqdm=True,
                mixed_precision=precision,
                dataloader_num_workers=0,
                use_cpu=device().type == "cpu",
            ),
            **train,
        }
    }  # a step may change a default
    cfg.update(sections or {})
    clock = StepClock()
    loop = Loop(model, Config.from_dict(cfg), train_dataset=dataset, data_collator=collator)
    loop.train()
    out = clock.rate(s["warm"], (batch or s["batch"]) * s["seq"])
    loss = [e["loss"] for e in loop.state.log_history if "loss" in e]
    out["final_loss"] = round(float(loss[-1]), 4) if loss else None
    out["peak_mem_gib"] = doctor_peak_gib(loop.state.log_history)
    return out, loop


def cl_full(size: str, precision: str = "bf16", sections: dict | None = None, **train) -> dict:
    s = SIZES[size]
    reset_peak()
    model = build_model(size)
    out, _ = cl_train(
        model, chat_data(size, s["batch"] * s["steps"]), size, precision, sections=sections, **train
    )
    return with_mfu(out, flops_per_token(model, size), precision)


def cl_liger(size: str) -> dict:
    """bf16 full fine-tuning with corelooper-liger (the model type's default kernels: RoPE, RMSNorm,
    SwiGLU, fused linear cross-entropy), against cl_bf16_full: tokens/s and peak memory."""
    import importlib.util

    import torch

    if importlib.util.find_spec("corelooper_liger") is None:
        return {"skipped": "corelooper-liger (plugins/liger) is not installed in this venv"}
    if importlib.util.find_spec("liger_kernel") is None:
        return {"skipped": "liger-kernel did not install (pip install liger-kernel): no Liger step"}
    if not torch.cuda.is_available():
        return {"skipped": "Liger's Triton kernels need a CUDA GPU"}
    s = SIZES[size]
    reset_peak()
    model = build_model(size)
    out, loop = cl_train(
        model, chat_data(size, s["batch"] * s["steps"]), size, "bf16", sections={"liger": {}}
    )
    run = loop.plugins.get("liger.run")
    if run is None or run.applied is None:
        return {"error": f"the liger plugin did not patch the model: {loop.plugins.inactive.get('liger')}"}
    out["liger_kernels"] = run.applied or "the model type's defaults"
    return with_mfu(out, flops_per_token(model, size), "bf16")


def cl_lora(size: str) -> dict:
    s = SIZES[size]
    reset_peak()
    model = build_model(size)
    peft = {
        "peft": {
            "method": "lora",
            "config": {
                "r": 16,
                "lora_alpha": 32,
                "lora_dropout": 0.0,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            },
        }
    }
    out, loop = cl_train(model, chat_data(size, s["batch"] * s["steps"]), size, "bf16", sections=peft)
    return with_mfu(out, flops_per_token(loop.model, size, lora=True), "bf16")


def cl_sharded(size: str, which: str) -> dict:
    """Single-GPU FSDP2 (corelooper-fsdp) or ZeRO-2 (corelooper-deepspeed), one process."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    section = (
        {"fsdp": {"wrap": ["LlamaDecoderLayer"]}} if which == "fsdp2" else {"deepspeed": {"zero_stage": 2}}
    )
    missing = missing_plugin(
        "corelooper_fsdp" if which == "fsdp2" else "corelooper_deepspeed",
        "plugins/fsdp" if which == "fsdp2" else "plugins/deepspeed",
    )
    if which == "zero2" and not missing:
        missing = missing_plugin("deepspeed", "deepspeed (pip install deepspeed)")
    if missing:
        return missing
    if which == "zero2" and device().type == "cpu":
        import importlib

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # platform notes
    s = SIZES[size]
    reset_peak()
    model = build_model(size)
    out, _ = cl_train(model, chat_data(size, s["batch"] * s["steps"]), size, "bf16", sections=section)
    return with_mfu(out, flops_per_token(model, size), "bf16")


# -- packing: leak-free with flash-attention varlen vs sdpa -----------------------------------------


def cl_packing(size: str, attn: str) -> dict:
    """Long-tailed chat samples (benchmarks/sft/common.py), packed leak-free by corelooper_lm.packing
    into rows of ``seq`` tokens: sdpa gets the 4-D (boolean) block mask, flash_attention_2 varlen
    batches, ``segments`` corelooper's segment-wise sdpa (one sdpa call per sample, no mask)."""
    import common as sft  # benchmarks/sft/common.py

    try:
        from corelooper_lm.packing import Segment, SegmentCollator, plan_packing
    except ImportError:
        return {
            "skipped": "corelooper-lm (plugins/lm) is not installed in this venv: pip install -e plugins/lm"
        }
    if attn == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return {
                "skipped": "flash-attn is not installed (the pip install failed or was skipped): sdpa only"
            }
    import torch

    s = SIZES[size]
    samples = [
        x for x in sft.make_samples(s["batch"] * s["steps"] * 12, "train") if len(x.input_ids) <= s["seq"]
    ]
    vocab = s["vocab_size"]
    plan = plan_packing([len(x.input_ids) for x in samples], s["seq"], "bfd")
    rows = [
        [
            Segment(
                [t % vocab for t in samples[i].input_ids[a:b]],
                [t % vocab if t != -100 else t for t in samples[i].labels[a:b]],
                {},
            )
            for i, a, b in row
        ]
        for row in plan
    ]
    reset_peak()
    model = build_model(size, attn="sdpa" if attn == "segments" else attn)
    dtype = torch.bfloat16
    if attn == "segments":
        try:
            from corelooper_lm.segment_attention import use_segment_attention
        except ImportError:
            return {
                "skipped": "corelooper-lm (plugins/lm) is not installed in this venv: pip install -e plugins/lm"
            }
        attn = use_segment_attention(model)
    if attn == "flash_attention_2":
        model = model.to(dtype)  # flash kernels need half-precision weights
    collator = SegmentCollator(pad_token_id=0, attn_implementation=attn, mask_dtype=dtype)
    trained = sum(
        sum(1 for t in seg.labels[1:] if t != -100) for row in rows[: s["batch"] * s["steps"]] for seg in row
    )
    out, _ = cl_train(model, rows, size, "bf16", collator=collator)
    out["trained_tokens_per_step"] = round(trained / s["steps"])
    out["rows"] = len(rows)
    return with_mfu(out, flops_per_token(model, size), "bf16")


# -- the LM head over trained positions; evaluation ------------------------------------------------


def cl_trained_head(size: str) -> dict:
    """cl_bf16_full with ``[lm] head = "trained"`` (the default of [sft] runs): logits only for the
    trained 75% of the tokens (the prompt quarter is masked), the same loss as the full head."""
    missing = missing_plugin("corelooper_lm", "plugins/lm")
    if missing:
        return missing
    return cl_full(size, "bf16", sections={"lm": {"head": "trained"}})


def eval_compare(size: str) -> dict:
    """``Loop.evaluate()`` (loss only, and with a streaming token accuracy) against
    ``Trainer.evaluate`` (without and with ``compute_metrics``, which makes HF keep every batch's
    logits) on the same model and eval set: eval tokens/s, peak memory (GPU; peak RSS on a CPU) and
    eval loss of each, in this order, in one process."""
    import torch
    from transformers import Trainer, TrainingArguments

    s = SIZES[size]
    n = s["batch"] * (4 if size == "full" else 2)
    data = chat_data(size, n)
    model = build_model(size, dtype=torch.bfloat16 if device().type == "cuda" else None)
    tokens = n * s["seq"]
    out: dict = {"eval_samples": n}
    # CUDA's and cuBLAS's first-call costs, paid here rather than by whichever timed row comes first
    with torch.no_grad():
        model(input_ids=torch.stack([r["input_ids"] for r in data[: s["batch"]]]).to(device()))
    sync()

    def timed(name, fn):
        reset_peak()
        sync()
        t = time.perf_counter()
        loss = fn()
        sync()
        dt = time.perf_counter() - t
        out[name] = {
            "tokens_per_s": round(tokens / dt, 1),
            "peak_mem_gib": peak_gib(),
            "eval_loss": round(loss, 4),
        }

    def corelooper_eval(metric=None):
        from corelooper import Loop
        from corelooper.config import Config

        cfg = Config.from_dict(
            {
                "train": dict(
                    output_dir=run_dir("eval-"),
                    save_strategy="no",
                    per_device_eval_batch_size=s["batch"],
                    disable_tqdm=True,
                    use_cpu=device().type == "cpu",
                    report_to=[],
                ),
                # what an [sft] run's "auto" picks: the output layer over the trained
                # positions, a slice at a time with a metric (corelooper_lm.sliced_head)
                "lm": {"head": "trained"},
            }
        )
        return Loop(model, cfg, eval_dataset=data, compute_metrics=metric).evaluate()["eval_loss"]

    def corelooper_streaming():  # token accuracy per batch (corelooper_lm.metrics): no logits kept
        from corelooper_lm.metrics import TokenAccuracy

        return corelooper_eval(TokenAccuracy())

    def hf_eval(metrics: bool):
        args = TrainingArguments(
            output_dir=run_dir("eval-hf-"),
            per_device_eval_batch_size=s["batch"],
            report_to="none",
            disable_tqdm=True,
            use_cpu=device().type == "cpu",
        )

        def accuracy(p):  # needs every batch's logits: what users of compute_metrics write
            import numpy as np

            logits, labels = p.predictions, p.label_ids
            mask = labels[:, 1:] != -100
            return {"accuracy": float((np.argmax(logits[:, :-1], -1) == labels[:, 1:])[mask].mean())}

        trainer = Trainer(
            model=model, args=args, eval_dataset=data, compute_metrics=accuracy if metrics else None
        )
        return trainer.evaluate()["eval_loss"]

    timed("corelooper", corelooper_eval)
    timed("corelooper_streaming_metric", corelooper_streaming)
    timed("hf_trainer", lambda: hf_eval(False))
    timed("hf_trainer_compute_metrics", lambda: hf_eval(True))
    out["tokens_per_s"] = out["corelooper"]["tokens_per_s"]
    out["peak_mem_gib"] = out["corelooper"]["peak_mem_gib"]
    out["speedup_over_hf"] = round(out["corelooper"]["tokens_per_s"] / out["hf_trainer"]["tokens_per_s"], 3)
    return out


# -- the chat-SFT comparison of benchmarks/sft on the GPU ------------------------------------------------

SFT_METHODS = [
    "hf_grouped",
    "hf_flattening",
    "trl_grouped",
    "trl_padding_free",
    "raw_padding_free",
    "cl_padding_free",
    "cl_grouped",
]
SFT_ARGS = {
    "full": [
        "--samples",
        "4096",
        "--eval-samples",
        "128",
        "--batch",
        "32",
        "--hidden",
        "1024",
        "--layers",
        "8",
        "--heads",
        "8",
        "--lr",
        "1e-3",
    ],
    "smoke": ["--samples", "64", "--eval-samples", "8", "--batch", "8"],
}
# On a GPU corelooper's padding-free rows (and the hand-written one over the same layout) take the
# 4-D block mask, what [sft] picks there: one sdpa call per sample trained packed rows 26x slower on
# the H200 (cl_packing_segment_sdpa, 2026-12-04), and made this step outlast its time.
SFT_CUDA_ARGS = ["--cl-attention", "mask"]
SFT_SECONDS = {"full": 150, "smoke": 120}
# The smoke proves the step's path, not its figures: one repetition (the test suite runs it), and
# a row is cut only when it runs away (a loaded machine must not cut a healthy row at 30 s).
SFT_REPS_MAX = {"full": None, "smoke": 1}
SFT_ROW_MIN_S = {"full": 30.0, "smoke": 600.0}


def sft_chat_peers(size: str) -> dict:
    """benchmarks/sft's rows on the GPU in bf16 (the HF Trainer and TRL with their length-grouped
    and padding-free settings, the hand-written loop over corelooper's padding-free layout,
    corelooper padding-free and grouped): a ~100M Llama (hidden 1024, 8 layers, vocab 2048) on
    4,096 long-tailed chat samples, 32 per step; repetitions interleaved until ``SFT_SECONDS``.
    Trained tokens/s to the last optimizer step (CUDA events), eval loss; the ratios and verdicts
    of run_bench.py (judged only from 3 repetitions on)."""
    import importlib.util

    import run_bench  # benchmarks/sft/run_bench.py
    import torch

    if not torch.cuda.is_available() and size == "full":
        return {"skipped": "the GPU rows need CUDA; on a CPU run benchmarks/sft/run_bench.py"}
    if importlib.util.find_spec("trl") is None:
        return {
            "skipped": "TRL is not installed (pip install trl; benchmarks/gpu/wheelhouse.sh carries it): "
            "its rows are half of this comparison"
        }
    cuda = torch.cuda.is_available()
    extra = [
        *SFT_ARGS[size],
        *(SFT_CUDA_ARGS if cuda else []),
        "--cl-packing",
        "auto",
        "--device",
        "cuda" if cuda else "cpu",
    ]
    deadline = time.perf_counter() + SFT_SECONDS[size]
    runs: dict[str, list[dict]] = {m: [] for m in SFT_METHODS}
    rep, rep_s, out = 0, 0.0, {}
    # another repetition only if it fits (and the size wants more than one)
    while rep == 0 or (rep != SFT_REPS_MAX[size] and time.perf_counter() + rep_s < deadline):
        t, k = time.perf_counter(), rep % len(SFT_METHODS)
        for m in SFT_METHODS[k:] + SFT_METHODS[:k]:
            # each row may take the step's time left (at least SFT_ROW_MIN_S): a row that runs away is
            # cut (recorded as failed), and the rows done are written after each one (a timeout keeps them)
            left = max(SFT_ROW_MIN_S[size], deadline - time.perf_counter())
            runs[m].append(run_bench.run(m, rep, extra, timeout=left))
            out = sft_summary(runs, extra, rep + 1)
            write_partial(out)
        rep, rep_s = rep + 1, time.perf_counter() - t
    return out


def sft_summary(runs: dict[str, list[dict]], extra: list[str], reps: int) -> dict:
    import run_bench  # benchmarks/sft/run_bench.py

    done = {m: r for m, r in runs.items() if r}
    table = run_bench.summarize(done)
    goals = run_bench.compare(table, done)
    failed = {
        m: (r[0].get("failed") or "")[-600:] for m, r in done.items() if "trained_tok_per_s" not in r[0]
    }
    best = max(
        (r for r in table if "trained_tok_per_s" in r), key=lambda r: r["trained_tok_per_s"], default=None
    )
    out = {"args": extra, "reps": reps, "table": table, "goals": goals, "failed_rows": failed}
    if best:
        out["fastest_row"] = best["method"]
        out["tokens_per_s"] = next(
            (
                r["trained_tok_per_s"]
                for r in table
                if r["method"] == "cl_padding_free" and "trained_tok_per_s" in r
            ),
            None,
        )
    return out


# -- Qwen2.5-0.5B's shape (issue 49): the large vocabulary on the GPU ------------------------------

QWEN_ROWS = ["cl_padded", "hf_padded", "trl_padded"]  # fixed-length samples: padded = no padding
QWEN_ARGS = {
    "full": ["--model", "qwen2.5-0.5b", "--sample-len", "1024", "--batch", "8", "--samples", "96"],
    "smoke": ["--model", "qwen2", "--sample-len", "64", "--batch", "2", "--samples", "6"],
}
QWEN_SECONDS = {"full": 180, "smoke": 600}  # a row still running then is cut (recorded as failed)


def qwen_flops_per_token(size: str, lora: bool) -> float:
    """Model FLOPs per position of the Qwen2.5-0.5B shape (common.QWEN25_05B): 6 per weight of the
    layers and the head (4 with LoRA: no weight gradients for the frozen base; the adapters' own
    are left out), plus causal attention, 6 L d T."""
    import common as sft  # benchmarks/sft/common.py

    m = sft.QWEN25_05B if size == "full" else sft.QWEN2_LARGE_VOCAB
    h, heads, kv = m["hidden_size"], m["num_attention_heads"], m["num_key_value_heads"]
    dim = h // heads
    layer = 2 * h * heads * dim + 2 * h * kv * dim + 3 * h * m["intermediate_size"]
    seq = int(QWEN_ARGS[size][QWEN_ARGS[size].index("--sample-len") + 1])
    weights = m["num_hidden_layers"] * layer + h * m["vocab_size"]
    return (4 if lora else 6) * weights + 6 * m["num_hidden_layers"] * h * seq


def qwen05b_peers(size: str) -> dict:
    """Qwen2.5-0.5B's shape from a config (vocab 151,936, hidden 896, 24 layers, GQA 14/2, tied
    embeddings) on fixed-length chat samples of 1,024 tokens, 8 per step, 12 steps, bf16 autocast:
    the HF Trainer, TRL's SFTTrainer and corelooper (its [sft] default head over the trained
    positions), full fine-tuning and LoRA, each row a ``benchmarks/sft/run_one.py`` process.
    Steady-state tokens/s (every position, CUDA events), MFU, the device's peak memory."""
    import importlib.util

    import run_bench  # benchmarks/sft/run_bench.py
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and size == "full":
        return {"skipped": "the Qwen2.5-0.5B rows need CUDA; on a CPU run benchmarks/large_vocab/run.py"}
    for module, why in (("trl", "TRL's rows"), ("peft", "the LoRA rows")):
        if importlib.util.find_spec(module) is None:
            return {"skipped": f"{module} is not installed (benchmarks/gpu/wheelhouse.sh carries it): {why}"}
    deadline, out = time.perf_counter() + QWEN_SECONDS[size], {}
    for lora in (False, True):
        for m in QWEN_ROWS:
            extra = [*QWEN_ARGS[size], "--eval-samples", "4", "--device", "cuda" if cuda else "cpu"]
            rec = run_bench.run(
                m, 0, extra + (["--lora"] if lora else []), timeout=max(30.0, deadline - time.perf_counter())
            )
            out[f"{m}_{'lora' if lora else 'full'}"] = qwen_row(rec, size, lora)
            write_partial(out)
    for kind in ("full", "lora"):
        cl, hf, trl = (out.get(f"{m}_{kind}", {}).get("tokens_per_s") for m in QWEN_ROWS)
        out[f"cl_over_hf_{kind}"] = round(cl / hf, 3) if cl and hf else None
        out[f"cl_over_trl_{kind}"] = round(cl / trl, 3) if cl and trl else None
    out["tokens_per_s"] = out.get("cl_padded_full", {}).get("tokens_per_s")
    return out


def qwen_row(rec: dict, size: str, lora: bool) -> dict:
    """tokens/s over every position in the steady state (the median step), MFU, peak memory."""
    if "median_step_s" not in rec or not rec.get("median_step_s"):
        return {"failed": (rec.get("failed") or rec.get("skipped") or "")[-600:]}
    positions = rec["positions_computed"] / rec["optimizer_steps"]
    tps = positions / rec["median_step_s"]
    fpt = qwen_flops_per_token(size, lora)
    return dict(
        tokens_per_s=round(tps, 1),
        mfu=round(tps * fpt / PEAK_FLOPS["bf16"], 4),
        flops_per_token=fpt,
        peak_mem_gib=rec.get("peak_mem_gib") or round(rec.get("peak_rss_self_mib", 0) / 1024, 2),
        eval_loss=rec.get("eval_loss"),
        trained_tok_per_s_steady=rec.get("trained_tok_per_s_steady"),
    )


def write_partial(result: dict) -> None:
    """What a long step has so far, where bench.py reads it if the step times out."""
    path = os.environ.get(PARTIAL_ENV)
    if path:
        Path(path).write_text(json.dumps(result))


# -- auto batch size, doctor -------------------------------------------------------------------------


def auto_batch_size(size: str) -> dict:
    import subprocess

    import torch

    if not torch.cuda.is_available():
        return {"skipped": "needs a CUDA device (a real out-of-memory); not run on CPU"}
    script = ROOT / "plugins" / "auto_batch_size" / "scripts" / "real_cuda_oom.py"
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
    import json

    return json.loads(line) if line else {"error": f"rc {p.returncode}: {p.stderr[-1500:]}"}


class _Tee:
    """Writes to a stream and keeps a copy (the doctor prints its lines to stderr)."""

    def __init__(self, stream) -> None:
        import io

        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def doctor_memory(size: str) -> dict:
    """corelooper-doctor (on by default once installed) on the bf16 full fine-tuning run: the
    memory figures it logs, the breakdown it prints after the first step, and the host-device
    syncs per step it counts on CUDA (torch's sync debug mode; the core's non-finite check and
    the logging read are syncs), recorded as given."""
    try:
        import corelooper_doctor  # noqa: F401
    except ImportError:
        return {
            "skipped": "corelooper-doctor (plugins/doctor) is not installed in this venv: pip install -e plugins/doctor"
        }
    import contextlib

    tee = _Tee(sys.stderr)
    s = SIZES[size]
    reset_peak()
    model = build_model(size)
    with contextlib.redirect_stderr(tee):
        out, loop = cl_train(model, chat_data(size, s["batch"] * s["steps"]), size, "bf16", logging_steps=1)
    logs = [e for e in loop.state.log_history if "loss" in e]
    out["doctor_memory_logs"] = [{k: v for k, v in e.items() if "mem" in k} for e in logs][:3]
    # per window (one step each here); absent on the CPU, where there is no device sync to count
    out["doctor_host_syncs_per_step"] = [e.get("doctor/host_syncs_per_step") for e in logs]
    out["doctor_time_split_last"] = {k: v for k, v in logs[-1].items() if "time_share" in k} if logs else {}
    out["doctor_output"] = [x for x in tee.copy.getvalue().splitlines() if x.startswith("doctor:")][:40]
    return with_mfu(out, flops_per_token(model, size), "bf16")


STEPS = {
    "raw_bf16_full": lambda z: raw_loop(z, "bf16"),
    "cl_bf16_full": lambda z: cl_full(z, "bf16"),
    "cl_bf16_trained_head": cl_trained_head,
    "raw_bf16_lora": lambda z: raw_loop(z, "bf16", lora=True),
    "cl_bf16_lora": cl_lora,
    "raw_fp16_scaler": lambda z: raw_loop(z, "fp16"),
    "cl_fp16_scaler": lambda z: cl_full(z, "fp16"),
    "raw_bf16_compile": lambda z: raw_loop(z, "bf16", compile_=True),
    "cl_bf16_compile": lambda z: cl_full(z, "bf16", torch_compile=True),
    "cl_bf16_liger": cl_liger,
    "cl_packing_sdpa": lambda z: cl_packing(z, "sdpa"),
    "cl_packing_flash_varlen": lambda z: cl_packing(z, "flash_attention_2"),
    "cl_packing_segment_sdpa": lambda z: cl_packing(z, "segments"),
    "cl_fsdp2_1gpu": lambda z: cl_sharded(z, "fsdp2"),
    "cl_zero2_1gpu": lambda z: cl_sharded(z, "zero2"),
    "auto_batch_size_real_oom": auto_batch_size,
    "doctor_memory_report": doctor_memory,
    "eval_cl_vs_hf": eval_compare,
    "sft_chat_peers_bf16": sft_chat_peers,
    "qwen05b_peers_bf16": qwen05b_peers,
}
