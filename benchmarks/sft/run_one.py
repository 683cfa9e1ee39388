"""One SFT contender, one run, one JSON line on stdout (run_bench.py runs these interleaved).

usage: python run_one.py METHOD [--samples 512] [--eval-samples 128] [--seed 0] [--batch 8]
                         [--rows N] [--lr 3e-3] [--hidden 256] [--layers 2] [--heads 4] [--threads N]
                         [--device cpu|cuda] [--model llama|qwen2] [--sample-len N] [--memory]
                         [--cl-packing auto|collators|packing] [--cl-attention segments|mask]
                         [--cl-head trained|all] [--profile OUT.prof] [--count-flops]
METHOD: hf_padded hf_grouped hf_flattening hf_flattening_seg trl_padded trl_grouped
        trl_padding_free trl_padding_free_seg trl_packing_bfd raw_padding_free cl_padded cl_grouped
        cl_packed cl_padding_free cl_padding_free_all cl_padding_free_all_no_accuracy
        cl_padding_free_chunked (methods.py)

Times the framework call (trainer construction + train, i.e. including its own data
preparation) up to its last optimizer step (and the whole call, with the end-of-run save; and the
steady state: from the first optimizer step to the last), every framework's modules imported
before the clock starts (methods.import_framework), then measures the eval loss of the trained
model the same way for everyone
(common.eval_loss: padded batches, completion tokens only). ``--profile`` writes a cProfile of
the framework call.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

T0 = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import methods as M  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=sorted(M.METHODS))
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--eval-samples", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="model init and data order (data is fixed)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--rows",
        type=int,
        default=0,
        help="packed rows per step (default: batch * mean length / max length, >= 1)",
    )
    ap.add_argument("--max-len", type=int, default=C.MAX_LEN)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=C.MODEL["hidden_size"])
    ap.add_argument("--layers", type=int, default=C.MODEL["num_hidden_layers"])
    ap.add_argument("--heads", type=int, default=C.MODEL["num_attention_heads"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--model",
        default="llama",
        choices=["llama", "qwen2", "qwen2.5-0.5b"],
        help="llama: the tiny Llama (common.MODEL, --hidden/--layers/--heads apply); qwen2: the "
        "large-vocabulary Qwen2 (common.QWEN2_LARGE_VOCAB, vocab 151,936: benchmarks/large_vocab); "
        "qwen2.5-0.5b: Qwen2.5-0.5B's shape (common.QWEN25_05B: benchmarks/gpu)",
    )
    ap.add_argument(
        "--lora",
        action="store_true",
        help="every row trains a LoRA of the model (peft: r 16, alpha 32, q/k/v/o projections)",
    )
    ap.add_argument(
        "--sample-len",
        type=int,
        default=0,
        help="every sample this many tokens (a fixed micro-batch of --batch x N positions); 0: long-tailed",
    )
    ap.add_argument(
        "--memory",
        action="store_true",
        help="record the resident memory after every optimizer step and the peak (activation_mib)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: every row in bf16 autocast on the GPU (benchmarks/gpu runs it); cpu: fp32",
    )
    ap.add_argument("--cl-packing", default="auto", choices=["auto", "collators", "packing"])
    ap.add_argument(
        "--cl-attention",
        default="segments",
        choices=["segments", "mask"],
        help="corelooper's leak-free rows: segment-wise sdpa (default) or one 4-D block mask",
    )
    ap.add_argument(
        "--cl-head",
        default="trained",
        choices=["trained", "all"],
        help="corelooper's rows: [lm] head (trained positions only, the [sft] default; or all)",
    )
    ap.add_argument("--profile", default=None)
    ap.add_argument(
        "--torch-profile",
        default=None,
        help="write the framework call's op events (torch.profiler) as JSON (profile_split.py)",
    )
    ap.add_argument(
        "--count-flops",
        action="store_true",
        help="record the framework call's FLOPs (work.py; torch's FLOP counter: the times are no figures)",
    )
    return ap.parse_args(argv)


class TorchProfile:
    """torch.profiler with cProfile's enable/disable/dump_stats, for profile_split.py."""

    def __init__(self, path: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def enable(self) -> None:
        self.t = time.perf_counter()
        self.prof.__enter__()

    def disable(self) -> None:
        self.prof.__exit__(None, None, None)
        self.wall = time.perf_counter() - self.t

    def dump_stats(self, path: str) -> None:
        from profile_split import profile_events

        with open(path, "w") as f:
            json.dump({"wall_s": self.wall, "events": profile_events(self.prof)}, f)


def _status_kib(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process from /proc/self/status, in KiB (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            return next((int(ln.split()[1]) for ln in f if ln.startswith(field + ":")), 0)
    except OSError:
        return 0


class MemoryProbe:
    """Activation memory as the OS sees it, per optimizer step from the second on (the first
    creates AdamW's state): the step's peak resident set (``VmHWM``, reset at the step's first
    forward through /proc/self/clear_refs) less what the model, its gradients and the optimizer
    state hold (the resident set at that forward, plus the gradients not allocated yet when the
    framework set them to None). The largest over the steps (``--memory``)."""

    def __init__(self, model) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.base: tuple[int, int] | None = None  # (RSS, gradients not allocated yet) at the step's start
        self.steps: list[tuple[int, int, int]] = []  # (RSS, missing gradients, peak) in KiB, per step
        self.peak = 0
        model.register_forward_pre_hook(self._forward)
        register_optimizer_step_post_hook(self._step)

    def _forward(self, module, args) -> None:
        if not module.training or self.base is not None:
            return
        missing = sum(p.numel() * p.element_size() for p in self.params if p.grad is None) // 1024
        self.base = (_status_kib("VmRSS"), missing)
        self.peak = max(self.peak, _status_kib("VmHWM"))
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident set restarts from the current one
        except OSError:
            pass  # no reset here: the step's peak is the process's so far (an upper bound)

    def _step(self, *_) -> None:
        if self.base is not None:
            self.steps.append((*self.base, _status_kib("VmHWM")))
            self.base = None

    def summary(self) -> dict:
        self.peak = max(self.peak, _status_kib("VmHWM"))
        later = self.steps[1:]  # the first step creates the optimizer state inside it
        mib = lambda kib: round(kib / 1024, 1)  # noqa: E731
        out = dict(peak_rss_self_mib=mib(self.peak), static_rss_mib=None, activation_mib=None)
        if later:
            rss, missing, peak = max(later, key=lambda s: s[2] - s[0] - s[1])
            # step_growth_mib: all the step adds to the resident set, the gradients it allocates too
            # (activation_mib can read ~0 where a micro-batch's activations are under the gradients)
            out.update(
                static_rss_mib=mib(rss + missing),
                activation_mib=mib(max(0, peak - rss - missing)),
                step_growth_mib=mib(max(s[2] - s[0] for s in later)),
            )
        return out


class StepClock:
    """The time of every optimizer step. On a GPU a CUDA event per step, read after the run: the
    time its work ended on the device, with no host-device sync inside the run (a host clock
    would stop when the CPU queued the step, a sync would change what is measured)."""

    def __init__(self, cuda: bool) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.cuda, self.marks = cuda, []
        if cuda:
            self.start = torch.cuda.Event(enable_timing=True)
        register_optimizer_step_post_hook(lambda *_: self.marks.append(self._mark()))

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def started(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.start.record()
        return time.perf_counter()

    def times(self, t0: float) -> list[float]:
        """Host-clock seconds of each step (``t0``: what ``started`` returned)."""
        if not self.cuda:
            return list(self.marks)
        import torch

        torch.cuda.synchronize()
        return [t0 + self.start.elapsed_time(ev) / 1000 for ev in self.marks]


def setup(a):
    """The data, hyper-parameters and model of a run with ``parse``'s arguments ``a`` (lockstep.py
    sets up its rows with this too): ``(train, evals, stats, h, model)``."""
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    train = C.make_samples(a.samples, "train", length=a.sample_len)
    evals = C.make_samples(a.eval_samples, "eval")
    st = C.stats(train)
    rows = a.rows or max(1, round(a.batch * st["mean_len"] / a.max_len))
    cuda = a.device == "cuda"
    h = M.hparams(
        batch=a.batch,
        rows=rows,
        max_len=a.max_len,
        lr=a.lr,
        seed=a.seed,
        cpu=not cuda,
        bf16=cuda,
        cl_packing=a.cl_packing,
        cl_attention=a.cl_attention,
        cl_head=a.cl_head,
    )
    if a.model != "llama":  # the issue fixes these shapes: no size flags
        return train, evals, st, h, lora(C.make_model(a.seed, a.model), a.lora)
    model = C.make_model(
        a.seed,
        hidden_size=a.hidden,
        intermediate_size=int(a.hidden * 2.6875) // 8 * 8,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.heads,
    )
    return train, evals, st, h, lora(model, a.lora)


def lora(model, on: bool):
    """The model as a peft LoRA (the same adapters for every row), or as it is."""
    if not on:
        return model
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets)
    return get_peft_model(model, config)


class DevicePeak:
    """The device's peak allocated memory over the framework call, kept by the benchmark itself:
    torch's peak counter is reset by whoever calls ``reset_peak_memory_stats`` (corelooper-doctor
    does at every log), so it is disabled during the call."""

    def __init__(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()
        self.reset, torch.cuda.reset_peak_memory_stats = (
            torch.cuda.reset_peak_memory_stats,
            lambda *a, **k: None,
        )

    def gib(self) -> float:
        import torch

        torch.cuda.reset_peak_memory_stats = self.reset
        return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def main(argv=None) -> None:
    """One run (``argv``: this script's arguments; work.py's ``--one-process`` passes each row's)."""
    a = parse(argv)
    import torch

    train, evals, st, h, model = setup(a)
    cuda = a.device == "cuda"
    probe = C.Probe(model)
    clock = StepClock(cuda)
    memory = MemoryProbe(model) if a.memory else None
    M.import_framework(a.method)  # each framework's modules are imported before the timed call, for all alike
    rec = dict(
        method=a.method,
        seed=a.seed,
        samples=a.samples,
        batch=a.batch,
        packed_rows_per_step=h.rows,
        threads=torch.get_num_threads(),
        import_s=round(time.perf_counter() - T0, 3),
        layout=M.packing_layout(h) if a.method.startswith(("cl_pack", "cl_padding_free")) else None,
        cl_head=M.train_head(h) if a.method.startswith("cl_") else None,
    )
    fn = M.METHODS[a.method]
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
    elif a.torch_profile:
        prof = TorchProfile(a.torch_profile)
    elif a.count_flops:
        from work import FlopCount

        prof = FlopCount()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    device_peak = DevicePeak() if cuda else None
    t = clock.started()
    try:
        if prof:
            prof.enable()
        prep = fn(model, train, h)
    except M.Unavailable as e:
        rec.update(skipped=str(e))
        print(json.dumps(rec), flush=True)
        return
    finally:
        if prof:
            prof.disable()
            if a.profile or a.torch_profile:
                prof.dump_stats(a.profile or a.torch_profile)
    steps = clock.times(t)
    wall = time.perf_counter() - t
    if device_peak:
        rec.update(peak_mem_gib=device_peak.gib())
    # the training's own peak, before the eval loss below allocates its logits
    rec.update(memory.summary() if memory else dict(peak_rss_self_mib=round(_status_kib("VmHWM") / 1024, 1)))
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    faults, system_s = ru1.ru_minflt - ru0.ru_minflt, round(ru1.ru_stime - ru0.ru_stime, 3)
    last_step = [steps[-1]]
    fed = probe.summary()
    # Steady state: the tokens trained after the first optimizer step over the time from it to the
    # last (construction, data preparation and first-step warm-up left out; one forward per step).
    later = sum(probe.trained_per_forward[1:])
    steady = round(later / (steps[-1] - steps[0]), 1) if len(steps) > 1 and steps[-1] > steps[0] else None
    rec.update(fed)
    if a.count_flops:
        rec.update(flops=prof.split())
    rec.update(
        train_call_s=round(wall, 3),
        page_faults=faults,
        system_cpu_s=system_s,
        user_cpu_s=round(ru1.ru_utime - ru0.ru_utime, 3),
        to_last_step_s=round(last_step[0] - t, 3),
        data_prep_s=round(prep, 3) if prep else None,
        trained_tokens=st["trained_tokens"],
        real_tokens=st["tokens"],
        # From the framework call to its last optimizer step: construction and data preparation
        # (packing) count, the end-of-run save/teardown does not (frameworks differ there).
        trained_tok_per_s=round(st["trained_tokens"] / (last_step[0] - t), 1),
        trained_tok_per_s_whole_call=round(st["trained_tokens"] / wall, 1),
        trained_tok_per_s_steady=steady,
        optimizer_steps=len(steps),
        # the call's start to the first optimizer step, and the median step after it: their
        # difference is what construction and the first step's warm-up cost
        first_step_s=round(steps[0] - t, 4),
        median_step_s=round(statistics.median(b - a for a, b in zip(steps, steps[1:], strict=False)), 4)
        if len(steps) > 1
        else None,
        # steps 2..n one by one: rows over the same batches in the same order are compared step by
        # step (run_bench's per-step ratio), which a slow phase shorter than the run moves less
        step_times_s=[round(b - a, 5) for a, b in zip(steps, steps[1:], strict=False)],
        padding_share=round(1 - st["tokens"] / fed["positions_computed"], 4)
        if fed["positions_computed"]
        else None,
        same_trained_tokens=fed["trained_tokens_fed"] == st["trained_tokens"],
        eval_loss=round(C.eval_loss(model, evals), 4),
    )
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
