"""The benchmark's long-tailed data (common.make_samples) as a chat JSONL, and a local tokenizer
folder with a chat template that reads it: what ``preprocess.py`` tokenizes, masks and packs.

Every token id ``i`` of a sample is the word ``t<i>``; a sample's prompt becomes the user turn and
its completion the assistant turn (one sample in three is split into two rounds, so multi-turn
masking is exercised). The tokenizer is common.make_tokenizer's word-level vocabulary split on
white space, plus two role words, with a ChatML-like template that marks the assistant turns with
``{% generation %}`` (what TRL's ``assistant_only_loss`` needs). No download.
"""

from __future__ import annotations

import json
from pathlib import Path

import common as C

USER, ASSISTANT = "<|user|>", "<|assistant|>"
USER_ID, ASSISTANT_ID = C.VOCAB - 2, C.VOCAB - 1  # never drawn by make_samples (topic pool < 300)
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{ '<|assistant|> ' }}{% generation %}{{ m['content'] + ' </s>' }}{% endgeneration %}{{ ' ' }}"
    "{%- else -%}{{ '<|user|> ' + m['content'] + ' ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|> ' }}{%- endif -%}"
)


def _words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def conversation(sample: C.Sample, k: int) -> list[dict]:
    ids, p = sample.input_ids[:-1], sample.prompt_length  # the template writes the EOS
    prompt, answer = ids[:p], ids[p:] or ids[-1:]
    if k % 3 == 2 and len(prompt) >= 4 and len(answer) >= 4:
        a, b = len(prompt) // 2, len(answer) // 2
        turns = [prompt[:a], answer[:b], prompt[a:], answer[b:]]
    else:
        turns = [prompt, answer]
    roles = ["user", "assistant"] * 2
    return [{"role": r, "content": _words(t)} for r, t in zip(roles, turns, strict=False)]


def write_jsonl(path: Path, n: int, split: str = "train") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for k, s in enumerate(C.make_samples(n, split)):
            fh.write(json.dumps({"messages": conversation(s, k)}) + "\n")
    return path


def make_tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(C.VOCAB)}
    for i in (C.PAD, C.EOS, USER_ID, ASSISTANT_ID):
        del vocab[f"t{i}"]
    vocab.update({"<pad>": C.PAD, "</s>": C.EOS, USER: USER_ID, ASSISTANT: ASSISTANT_ID})
    tok = Tokenizer(WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", chat_template=TEMPLATE
    )


def write_tokenizer(folder: Path) -> Path:
    make_tokenizer().save_pretrained(folder)
    return folder


def make_model(seed: int = 0):
    """The benchmark's tiny Llama (common.MODEL), a ``model.factory`` for corelooper's config."""
    return C.make_model(seed)
