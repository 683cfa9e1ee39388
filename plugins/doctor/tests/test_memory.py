"""Memory: per-log figures, the first-step breakdown, and the out-of-memory report."""

from __future__ import annotations

import json
import math
import resource

import pytest
import torch
from doctor_fixtures import _only_named_plugins  # noqa: F401  (autouse)
from doctor_toys import Classifier, OomAt, make_loop, samples

from corelooper.errors import TrainingError


def _mem_total_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def _breakdown(tmp_path, batch: int):
    loop = make_loop(
        tmp_path / f"b{batch}",
        Classifier(torch.nn.ReLU()),
        samples(n=128),
        per_device_train_batch_size=batch,
        max_steps=2,
    )
    loop.train()
    return loop, json.loads((tmp_path / f"b{batch}" / "run" / "doctor" / "memory.json").read_text())


def test_breakdown_is_measured_from_the_tensors(tmp_path):
    loop, b = _breakdown(tmp_path, 8)
    n_params = sum(p.numel() for p in loop.model.parameters())
    assert b["parameters"] == b["gradients"] == 4 * n_params
    opt = sum(
        v.numel() * v.element_size()
        for st in loop.optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )
    assert b["optimizer_states"] == opt >= 2 * 4 * n_params  # AdamW: exp_avg, exp_avg_sq (+ step)
    assert b["capacity"] == _mem_total_bytes()  # the kernel's figure for this machine's RAM
    free = 0.9 * b["capacity"] - (b["parameters"] + b["gradients"] + b["optimizer_states"])
    assert b["largest_micro_batch"] == math.floor(free / (b["activations"] / b["micro_batch"]))
    # saved for backward per sample, by hand: Linear(8,16) input x (8 floats), ReLU output
    # (16, also Linear(16,3)'s input), cross-entropy's log-softmax (3) and label (one int64)
    assert b["activations_per_sample"] == pytest.approx(4 * (8 + 16 + 3) + 8, rel=0.25)


def test_activations_grow_with_the_micro_batch(tmp_path):
    _, small = _breakdown(tmp_path, 8)
    _, big = _breakdown(tmp_path, 32)
    assert big["activations"] / small["activations"] == pytest.approx(4.0, rel=0.05)


def test_peak_rss_is_logged_on_cpu(tmp_path):
    loop = make_loop(tmp_path, Classifier(torch.nn.ReLU()), samples())
    loop.train()
    logs = [h for h in loop.state.log_history if "loss" in h]
    assert len(logs) == 4
    now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # kB -> GB
    assert all(0 < h["doctor/memory_peak_rss_gb"] <= now + 1e-3 for h in logs)


def test_oom_report_names_the_phase_the_breakdown_and_ranked_fixes(tmp_path):
    # A CUDA OOM cannot happen on this CPU machine: the model raises torch.OutOfMemoryError
    # (the exception CUDA raises) in its 3rd training forward.
    loop = make_loop(tmp_path, OomAt(at_call=3), samples())
    with pytest.raises(TrainingError, match="out of memory"):
        loop.train()
    text = (tmp_path / "run" / "doctor" / "oom-rank0.txt").read_text()
    assert text.startswith(
        "doctor: out of memory at step 3 during forward (per_device_train_batch_size 8, "
        "gradient_accumulation_steps 1): CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert "Memory per process: parameters 780 B, gradients 780 B" in text
    # ranked by bytes saved; on this toy the weights' state outweighs 940 B of activations
    assert "(1) LoRA: a [peft] section" in text
    assert '(2) [deepspeed] zero_stage = 2 with offload_optimizer = "cpu"' in text
    assert (
        "(3) gradient accumulation: per_device_train_batch_size = 2, gradient_accumulation_steps = 4" in text
    )
    assert "(4) " not in text


def test_oom_before_the_first_step_says_no_breakdown(tmp_path):
    loop = make_loop(tmp_path, OomAt(at_call=1), samples())
    with pytest.raises(TrainingError):
        loop.train()
    text = (tmp_path / "run" / "doctor" / "oom-rank0.txt").read_text()
    assert "at step 1 during forward" in text and "no breakdown was measured" in text


def test_the_start_up_line_speaks_in_per_device_train_batch_size(tmp_path, capfd, monkeypatch):
    """Not "the largest micro-batch that should fit in 23.54 GB: 1489690": the knob, the share
    of the device, and advice that holds at either end (the raw estimate stays in memory.json)."""
    from corelooper_doctor.memory import breakdown_line, worth_saying

    monkeypatch.setenv("CORELOOPER_VERBOSE", "1")  # memory is not the limit here: said when verbose only
    loop, b = _breakdown(tmp_path, 8)
    line = next(x for x in capfd.readouterr().err.splitlines() if x.startswith("doctor: memory per process"))
    assert line == breakdown_line(b)
    assert "at per_device_train_batch_size = 8:" in line and str(b["largest_micro_batch"]) not in line
    assert "memory is not the limit: per_device_train_batch_size could grow 16x and more" in line
    used = b["parameters"] + b["gradients"] + b["optimizer_states"] + b["activations"]
    assert f"({used / b['capacity']:.0%})" in line
    tight = {**b, "capacity": 4 * used, "largest_micro_batch": 20}
    assert breakdown_line(tight).endswith("; per_device_train_batch_size up to 20 should fit.")
    over = {**b, "largest_micro_batch": 3}
    assert "per_device_train_batch_size = 8 may not fit: use 3 or less, with gradient_accumulation_steps" in (
        breakdown_line(over)
    )
    assert worth_saying(tight) and worth_saying(over) and not worth_saying(b)


def test_a_breakdown_with_room_to_spare_is_not_said_unless_verbose(tmp_path, capfd, monkeypatch):
    """A run whose batch could grow 16x gets no memory line (quiet output); memory.json has it."""
    monkeypatch.delenv("CORELOOPER_VERBOSE", raising=False)
    loop, b = _breakdown(tmp_path, 8)
    assert b["largest_micro_batch"] >= 16 * 8
    assert "doctor: memory per process" not in capfd.readouterr().err


def test_an_oom_of_a_large_vocabulary_ranks_the_chunked_loss_first():
    """A language model whose float32 logits fill the activations (8 x 1024 tokens of Qwen2.5's
    151,936-token vocabulary: 2 x 8192 x 151936 x 4 B = 9.3 GiB of logits and their gradient, of
    12 GiB) is told to chunk its loss first; without a vocabulary the advice is as before."""
    from types import SimpleNamespace

    from corelooper_doctor import oom

    gib = 2**30
    b = dict(
        parameters=gib,
        gradients=gib,
        optimizer_states=2 * gib,
        activations=12 * gib,
        activations_per_token=12 * gib / 8192,
        micro_batch=8,
        capacity=16 * gib,
    )
    args = SimpleNamespace(
        per_device_train_batch_size=8, gradient_accumulation_steps=1, gradient_checkpointing=False
    )
    error = RuntimeError("DefaultCPUAllocator: can't allocate memory")
    text = oom.report("forward", 0, b, args, 1, 2, error, vocab=151_936)
    assert '(1) [lm] loss = "chunked" (the LM head\'s logits a chunk of rows at a time' in text
    saved = 2 * 8192 * 151_936 * 4 - oom.CHUNK_BYTES
    assert f"saves ~{oom.fmt(saved)}" in text
    assert "[lm] loss" not in oom.report("forward", 0, b, args, 1, 2, error)
    lm = torch.nn.Linear(4, 151_936, bias=False)
    model = SimpleNamespace(get_output_embeddings=lambda: lm)
    assert oom.output_rows(model) == 151_936 and oom.output_rows(torch.nn.Linear(2, 2)) is None
