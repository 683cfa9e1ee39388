"""Model FLOPs per token and MFU, logged with the throughput facts of each logging window.

Estimate (Kaplan et al. 2020; PaLM appendix B): a training token costs ``6 * N`` FLOPs for the
matmuls with the N non-embedding parameters (forward 2N, backward 4N), plus ``12 * L * d * T``
for attention scores and values over a context of T tokens (L layers of width d). Recomputation
(gradient checkpointing) is not counted: these are *model* FLOPs, as MFU is defined.
MFU = achieved model FLOP/s / (``train.peak_flops`` per device x processes).

An installed plugin of its own (entry point ``throughput``): on in every run, ``-p no:throughput``
switches it off.
"""

from __future__ import annotations

from corelooper.hookspecs import hookimpl  # torch is imported when counting: `corelooper --help` loads this


def non_embedding_parameters(model) -> int:
    """Parameters that take part in matmuls: all but input embedding tables (counted once)."""
    import torch

    embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    # A tied output head shares the embedding table but *is* a matmul: count it.
    out = getattr(model, "get_output_embeddings", lambda: None)()
    tied = {id(out.weight)} if isinstance(out, torch.nn.Linear) else set()
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen or (id(p) in embedding and id(p) not in tied):
            continue
        seen.add(id(p))
        n += p.numel()
    return n


def layers_and_width(model) -> tuple[int, int]:
    """(layers, hidden size) of a transformer, from an HF config; (0, 0) when unknown."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return 0, 0
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or 0
    width = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or 0
    return int(layers), int(width)


def flops_per_token(model, seq_len: float) -> float:
    """Training FLOPs per token: 6N + 12 * layers * width * seq_len."""
    n = non_embedding_parameters(model)
    layers, width = layers_and_width(model)
    return 6.0 * n + 12.0 * layers * width * seq_len


class ThroughputMeter:
    """Adds ``model_flops_per_token``, ``model_tflops_per_second`` and
    ``mfu`` (with ``train.peak_flops``) to a window's logs. Parameters are counted once."""

    def __init__(self, model, peak_flops: float | None, world_size: int):
        self.n = non_embedding_parameters(model)
        self.layers, self.width = layers_and_width(model)
        self.peak = peak_flops if peak_flops and peak_flops > 0 else None
        self.world_size = max(1, world_size)

    def logs(self, tokens_per_second: float, samples_per_second: float, tokens_seen: int) -> dict:
        seq_len = tokens_per_second / max(samples_per_second, 1e-9)  # mean (padded) sequence length
        per_token = 6.0 * self.n + 12.0 * self.layers * self.width * seq_len
        flops_per_second = per_token * tokens_per_second
        out = {
            "model_flops_per_token": round(per_token),
            "model_tflops_per_second": round(flops_per_second / 1e12, 6),
        }
        if self.peak:
            out["mfu"] = round(flops_per_second / (self.peak * self.world_size), 6)
        return out


def corelooper_configure(config, plugins) -> None:
    """A fresh meter for every run (it counts the run's model once)."""
    plugins.register(Throughput(), "throughput.run")


class Throughput:
    """The plugin ``throughput`` (corelooper-lm): FLOPs and MFU in every log that has tokens/s
    (``-p no:throughput`` leaves only samples/s and tokens/s)."""

    def __init__(self) -> None:
        self.meter: ThroughputMeter | None = None

    @hookimpl(tryfirst=True)  # before the loggers, which then write these keys too
    def on_log(self, loop, state, logs) -> None:
        if "tokens_per_second" not in logs or "samples_per_second" not in logs:
            return
        if self.meter is None:
            self.meter = ThroughputMeter(
                loop.backend.unwrap_model(loop.model), loop.args.peak_flops, state.world_size
            )
        logs.update(
            self.meter.logs(
                logs["tokens_per_second"], logs["samples_per_second"], state.num_input_tokens_seen
            )
        )
