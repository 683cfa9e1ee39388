"""Which SFT format a row is in, decided per row from its columns (TRL's names).

* ``messages`` (optional ``tools``): a conversation, rendered with the chat template;
* ``prompt`` + ``completion``: strings, or lists of messages (conversational);
* ``text`` (``[sft] dataset_text_field``): plain text for language modelling;
* ``input_ids`` (optional ``labels``/``completion_mask``/``assistant_masks``): already tokenized.
"""

from __future__ import annotations

from collections.abc import Mapping

from corelooper.errors import DataError

MESSAGES, PROMPT_COMPLETION, TEXT, TOKENIZED = "messages", "prompt_completion", "text", "tokenized"
CONSUMED = (
    "messages",
    "tools",
    "prompt",
    "completion",
    "input_ids",
    "labels",
    "completion_mask",
    "assistant_masks",
    "attention_mask",
    "chat_template_kwargs",
)


def detect(row: Mapping, text_field: str, where: str) -> str:
    if "input_ids" in row:
        return TOKENIZED
    if "messages" in row:
        return MESSAGES
    if "prompt" in row and "completion" in row:
        return PROMPT_COMPLETION
    if text_field in row:
        return TEXT
    found = ", ".join(sorted(row)) or "none"
    raise DataError(
        f"{where}: cannot tell the format from the columns found ({found}). corelooper-sft reads "
        f"'messages' (a chat, with optional 'tools'), 'prompt' + 'completion', '{text_field}' "
        "([sft] dataset_text_field), or 'input_ids' (already tokenized). Rename the column, or set "
        "[sft] dataset_text_field to the text column's name."
    )


def is_conversation(value) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)
    )


def check_messages(messages, where: str, key: str = "messages") -> None:
    if not is_conversation(messages):
        raise DataError(
            f'{where}: \'{key}\' must be a non-empty list of {{"role": ..., "content": ...}} messages, '
            f"got {str(messages)[:80]!r}."
        )


# corelooper-sft's own per-sample columns: a data column of the same name does not travel
RESERVED = ("length", "trained", "untruncated_length")


def extras(row: Mapping) -> dict[str, float]:
    """Numeric per-sample columns (``difficulty_score``) that travel to the batch."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in CONSUMED and k not in RESERVED and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
