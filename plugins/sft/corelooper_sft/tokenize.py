"""One row -> ``input_ids`` and ``labels`` (-100 where not trained), as TRL's SFTTrainer does.

Chat rows are rendered by the tokenizer's chat template (or ``[sft] chat_template_path``).
``assistant_only_loss`` trains the assistant turns: by the template's ``{% generation %}``
markers where it has them (``return_assistant_tokens_mask``), otherwise by rendering the
conversation prefix by prefix: the characters an assistant turn adds (without trailing white
space) are trained, and each token is trained when it starts inside them. The stock Llama-3,
Qwen and Gemma templates have no markers; this gives them correct masks instead of all-zero
ones. ``completion_only_loss`` (default: on for prompt/completion rows) trains the completion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from corelooper.errors import DataError

from . import formats

IGNORE = -100
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class RowTokenizer:
    """Callable for ``datasets.map(with_indices=True)``; ``where`` names the data set in errors."""

    def __init__(self, tokenizer, cfg: Mapping[str, Any], where: str, chat_template: str | None = None):
        self.tok = tokenizer
        self.text_field = cfg["dataset_text_field"]
        self.assistant_only = bool(cfg["assistant_only_loss"])
        self.completion_only = cfg["completion_only_loss"]
        self.where = where
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        self.markers = bool(self.template and _GENERATION.search(self.template))
        # [sft] append_eos: BatchTokenizer appends it to each sample's ids and labels (eos.append)
        self.append_eos = tokenizer.eos_token_id if cfg.get("append_eos") else None

    def __call__(self, row: dict, index: int) -> dict:
        where = f"{self.where}, sample {index}"
        kind = formats.detect(row, self.text_field, where)
        if kind == formats.TOKENIZED:
            ids, labels = self._tokenized(row, where)
        elif kind == formats.MESSAGES:
            formats.check_messages(row["messages"], where)
            ids, trained = self._chat(row["messages"], row, where)
            labels = _apply(ids, trained)
        elif kind == formats.PROMPT_COMPLETION:
            ids, labels = self._prompt_completion(row, where)
        else:
            ids = self._text(row[self.text_field], where)
            labels = list(ids)
        if not any(x != IGNORE for x in labels[1:]):
            raise DataError(
                f"{where}: no token is trained (every label is -100 after the causal shift), so it "
                "would give a silent zero-loss step. Check the row's assistant/completion part"
                f"{', and that the chat template marks assistant turns' if self.assistant_only else ''}; "
                "or remove the row."
            )
        return {"input_ids": ids, "labels": labels, "length": len(ids), **formats.extras(row)}

    # -- formats ----------------------------------------------------------------------------------
    def _text(self, text, where: str) -> list[int]:
        if not isinstance(text, str):
            raise DataError(
                f"{where}: column {self.text_field!r} must be a string, got {type(text).__name__}."
            )
        eos = self.tok.eos_token
        if eos and not text.endswith(eos):
            text = text + eos  # as TRL: the model learns to stop
        return self.tok(text=text)["input_ids"]

    def _tokenized(self, row, where: str) -> tuple[list[int], list[int]]:
        ids = list(row["input_ids"])
        labels = list(row["labels"]) if row.get("labels") is not None else list(ids)
        for key in ("assistant_masks", "completion_mask"):
            if row.get(key) is not None and (key == "assistant_masks" or self.completion_only is not False):
                labels = [lab if m else IGNORE for lab, m in zip(labels, row[key], strict=False)]
        if len(labels) != len(ids):
            raise DataError(f"{where}: 'labels' has {len(labels)} tokens, 'input_ids' {len(ids)}.")
        return ids, labels

    def _prompt_completion(self, row, where: str) -> tuple[list[int], list[int]]:
        prompt, completion = row["prompt"], row["completion"]
        completion_only = self.completion_only is not False  # TRL: None means on here
        if formats.is_conversation(prompt):
            formats.check_messages(completion, where, "completion")
            prompt_ids = self._render(prompt, row, where, add_generation_prompt=True)["input_ids"]
            ids, trained = self._chat(prompt + completion, row, where)
        elif isinstance(prompt, str) and isinstance(completion, str):
            eos = self.tok.eos_token
            if eos and not completion.endswith(eos):
                completion = completion + eos
            prompt_ids = self.tok(text=prompt)["input_ids"]
            ids = self.tok(text=prompt + completion)["input_ids"]
            trained = [1] * len(ids)
        else:
            raise DataError(
                f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages."
            )
        n = common_prefix_length(prompt_ids, ids)
        if completion_only:
            trained = [0] * n + trained[n:]
        return ids, _apply(ids, trained)

    # -- chat -------------------------------------------------------------------------------------
    def _render(self, messages, row, where: str, **kwargs):
        if not self.template:
            raise DataError(
                f"{where}: a chat row, but the tokenizer has no chat template. Set [sft] chat_template_path "
                "to a Jinja file, or use a tokenizer whose tokenizer_config.json has one."
            )
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        try:
            return self.tok.apply_chat_template(
                messages,
                tools=tools or None,
                chat_template=self.template,
                tokenize=kwargs.pop("tokenize", True),
                return_dict=kwargs.pop("return_dict", True),
                **kwargs,
            )
        except Exception as e:  # jinja2 errors: the template or the row is at fault, name both
            raise DataError(
                f"{where}: the chat template failed on this row: {type(e).__name__}: {e}."
            ) from None

    def _chat(self, messages, row, where: str) -> tuple[list[int], list[int]]:
        """Token ids and the trained mask (all ones unless ``assistant_only_loss``)."""
        if not self.assistant_only:
            ids = self._render(messages, row, where)["input_ids"]
            return ids, [1] * len(ids)
        if self.markers:
            out = self._render(messages, row, where, return_assistant_tokens_mask=True)
            return out["input_ids"], list(out["assistant_masks"])
        return self._chat_by_prefix(messages, row, where)

    def _chat_by_prefix(self, messages, row, where: str) -> tuple[list[int], list[int]]:
        text = self._render(messages, row, where, tokenize=False, return_dict=False)
        spans = []
        for k, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = (
                self._render(
                    messages[:k], row, where, tokenize=False, return_dict=False, add_generation_prompt=True
                )
                if k
                else ""
            )
            through = self._render(messages[: k + 1], row, where, tokenize=False, return_dict=False)
            if not (text.startswith(before) and text.startswith(through) and through.startswith(before)):
                raise DataError(
                    f"{where}: the chat template renders the conversation up to turn {k} differently from the "
                    "start of the whole conversation, so assistant turns cannot be found by prefix. Use a "
                    "template with {% generation %} markers ([sft] chat_template_path)."
                )
            spans.append((len(before), len(through.rstrip())))
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        trained = [int(any(a <= s < b for a, b in spans) and e > s) for s, e in enc["offset_mapping"]]
        return enc["input_ids"], trained


def _apply(ids: list[int], trained: list[int]) -> list[int]:
    return [t if m else IGNORE for t, m in zip(ids, trained, strict=True)]
