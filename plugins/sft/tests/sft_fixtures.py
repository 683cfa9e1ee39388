"""A tiny tokenizer with a ChatML template and a tiny Llama, made here (no download); fixtures.

Not a conftest.py: the core suite has one, and both would be the module `conftest` in one run.
"""

from __future__ import annotations

import pytest

SPECIALS = ["<|endoftext|>", "<pad>", "<|im_start|>", "<|im_end|>"]
ROW = "{{ '<|im_start|>' + m['role'] + '\\n' }}"
WITH_MARKERS = (
    "{%- for m in messages -%}"
    + ROW
    + "{%- if m['role'] == 'assistant' -%}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}{%- else -%}{{ m['content'] + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
NO_MARKERS = (
    "{%- for m in messages -%}" + ROW + "{{ m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
TEXTS = [
    "What is the capital of France? The capital of France is Paris.",
    "Explain gradient accumulation. It sums gradients over micro-batches before a step.",
    "你好，请介绍一下你自己。我是一个小型语言模型。",
    "Translate to Chinese: good morning. 早上好。",
    "def add(a, b): return a + b",
    "Packing puts short samples into one row without leaking attention.",
] * 4


def make_tokenizer(template: str = WITH_MARKERS, vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        bos_token="<|endoftext|>",
        chat_template=template,
    )


def make_model_folder(folder, attn: str = "sdpa", template: str = WITH_MARKERS):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer(template)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        attn_implementation=attn,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


CHATS = [
    {
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ],
        "difficulty_score": 1.0,
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "你好"},
            {"role": "assistant", "content": "你好！"},
            {"role": "user", "content": "Explain packing."},
            {"role": "assistant", "content": "Short samples share one row."},
        ],
        "difficulty_score": 2.5,
    },
    {
        "messages": [
            {"role": "user", "content": "def add(a, b)?"},
            {"role": "assistant", "content": "return a + b"},
        ],
        "difficulty_score": 0.5,
    },
]
