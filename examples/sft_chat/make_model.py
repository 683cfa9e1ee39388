"""Make the example's base model: a byte-level BPE tokenizer trained on the shipped chat data, with a
ChatML chat template (no {% generation %} markers, like the stock Qwen template: corelooper-sft
finds the assistant turns by rendering prefixes), and a tiny random-init Llama. No download.

    python examples/sft_chat/make_model.py [--out examples/sft_chat/tiny-llama]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

HERE = Path(__file__).parent
SPECIALS = ["<|endoftext|>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def texts(data: Path) -> list[str]:
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [m["content"] for r in rows for m in r["messages"]]


def make_tokenizer(data: Path, vocab_size: int = 512):
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
    tok.train_from_iterator(texts(data), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        chat_template=CHATML,
    )


def make_model(tok, hidden: int = 64, layers: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "tiny-llama")
    ap.add_argument("--data", type=Path, default=HERE / "data" / "chat.jsonl")
    args = ap.parse_args()
    # A script's output is its result: no "Writing model shards" bar, and not DeepSpeed's
    # "Setting accelerator to CPU" (transformers imports DeepSpeed where it is installed).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    tok = make_tokenizer(args.data)
    make_model(tok).save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"wrote {args.out}/ (tokenizer: {len(tok)} tokens, chat template: ChatML)")


if __name__ == "__main__":
    main()
