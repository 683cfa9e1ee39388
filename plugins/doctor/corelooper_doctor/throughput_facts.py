"""Small facts about the model and the data seen, from public loop attributes."""

from __future__ import annotations


def tokens_per_sample(state) -> float:
    if state.total_samples_seen and state.num_input_tokens_seen:
        return state.num_input_tokens_seen / state.total_samples_seen
    return 0.0


def layers(loop) -> int:
    """Transformer layers of the model, from an HF config (0 when unknown)."""
    cfg = getattr(loop.backend.unwrap_model(loop.model), "config", None)
    return int(getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or 0)
