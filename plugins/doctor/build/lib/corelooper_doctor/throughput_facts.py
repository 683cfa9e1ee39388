"""Small facts about the model and the data seen, from public loop attributes."""

from __future__ import annotations


def tokens_per_sample(state) -> float:
    if state.total_samples_seen and state.num_input_tokens_seen:
        return state.num_input_tokens_seen / state.total_samples_seen
    return 0.0


def layers(loop) -> int:
    from corelooper.builtin.throughput import layers_and_width

    return layers_and_width(loop.backend.unwrap_model(loop.model))[0]
