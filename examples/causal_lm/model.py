"""A small Llama-style causal LM built from a ``transformers`` config (random init, no download)."""

from __future__ import annotations


def build(
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    from .data import EOS_ID, PAD_ID

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=False,
    )
    return LlamaForCausalLM(config)
