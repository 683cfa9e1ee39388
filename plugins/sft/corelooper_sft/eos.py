"""The end of a turn: a model that is never trained on one never learns to stop.

TRL's ``SFTTrainer`` appends the EOS to text and prompt/completion rows, and relies on the chat
template for conversations; axolotl warns when the EOS is not in the chat template. Here:

* ``check``: after a data set is tokenized, its first ``SAMPLED`` samples are checked for an
  end-of-turn token (the tokenizer's EOS, or a known end-of-turn token of its vocabulary, such as
  ChatML's ``<|im_end|>`` or Llama-3's ``<|eot_id|>``) among their trained tokens; when some have
  none, one warning names how many, the template and tokenizer, and the two fixes;
* ``[sft] append_eos = true`` (``append``): the EOS appended, trained, to every sample that does
  not end with it, as TRL does for text rows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("corelooper.sft")

SAMPLED = 1000  # samples checked: enough to see a template's habit, cheap on any data set
# end-of-turn tokens of the common chat templates (ChatML, Llama-3, Gemma, Phi-3, GPT-2 style, Llama-2)
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")


def end_ids(tok) -> list[int]:
    vocab = tok.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN if t in vocab}
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return sorted(ids)


def unended(ds, ids: list[int]) -> tuple[int, int]:
    """``(samples with no trained end-of-turn token, samples checked)`` among the first ``SAMPLED``
    that ``max_length`` left whole (a truncated sample loses its end by design, as in TRL)."""
    import numpy as np

    n = min(len(ds), SAMPLED)
    whole = np.ones(n, dtype=bool)
    if "untruncated_length" in ds.column_names:
        head = ds.select_columns(["length", "untruncated_length"])[:n]
        whole = np.asarray(head["length"]) == np.asarray(head["untruncated_length"])
    if getattr(ds, "_indices", None) is None:
        labels = ds.data.table.slice(0, n).column("labels").combine_chunks()
        offsets = labels.offsets.to_numpy().astype(np.int64)
        flat = labels.values.to_numpy()[offsets[0] : offsets[-1]]
        offsets -= offsets[0]
    else:  # a filtered data set: its rows gathered
        rows = ds[:n]["labels"]
        offsets = np.cumsum([0, *map(len, rows)])
        flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]) if rows else np.zeros(0)
    hit = np.isin(flat, ids)
    hit[offsets[:-1][offsets[:-1] < len(hit)]] = False  # a first token is never trained (causal shift)
    counts = np.add.reduceat(hit.astype(np.int64), offsets[:-1]) if len(hit) else np.zeros(n)
    empty = offsets[1:] == offsets[:-1]
    return int(np.count_nonzero(((counts == 0) | empty) & whole)), int(np.count_nonzero(whole))


def check(ds, tok, cfg: Mapping[str, Any], where: str) -> str | None:
    """The warning's sentence when samples train no end-of-turn token (logged once per data set)."""
    ids = end_ids(tok)
    if not ids:
        return None
    missing, checked = unended(ds, ids)
    if not missing:
        return None
    names = ", ".join(repr(tok.convert_ids_to_tokens(i)) for i in ids)
    template = (
        f"the chat template sft.chat_template_path = {cfg['chat_template_path']!r}"
        if cfg.get("chat_template_path")
        else f"the chat template of the tokenizer {getattr(tok, 'name_or_path', '') or type(tok).__name__!r}"
    )
    sentence = (
        f"sft: {where}: {missing} of the {checked} whole samples checked train no end-of-turn token ({names}), "
        f"so the model never learns to stop: {template} (or the rows) end the assistant's turn with none. "
        "Add the EOS after each assistant turn in the template (sft.chat_template_path), set "
        "sft.eos_token to the token the template ends turns with, or set sft.append_eos = true "
        "(the EOS appended, trained, to every sample, as TRL does for text)."
    )
    logger.warning(sentence)
    return sentence


def append(table, eos_id: int):
    """A tokenized Arrow batch (``pipeline._as_table``'s schema) with ``eos_id`` appended to the
    ``input_ids`` and ``labels`` of every row that does not end with it, counted as trained."""
    import numpy as np
    import pyarrow as pa

    ids = table.column("input_ids").combine_chunks()
    offsets = ids.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    flat_ids = ids.values.to_numpy()[offsets[0] : offsets[-1]]
    flat_labels = table.column("labels").combine_chunks().flatten().to_numpy()
    offsets -= offsets[0]
    last = np.where(lengths > 0, flat_ids[np.maximum(offsets[1:] - 1, 0)], -1)
    add = (last != eos_id).astype(np.int64)
    if not add.any():
        return table
    new_offsets = np.concatenate([[0], np.cumsum(lengths + add)])
    at = new_offsets[1:][add > 0] - 1  # where each appended EOS goes
    keep = np.ones(new_offsets[-1], dtype=bool)
    keep[at] = False
    cols = {name: table.column(name) for name in table.column_names}
    for name, flat in (("input_ids", flat_ids), ("labels", flat_labels)):
        out = np.empty(new_offsets[-1], dtype=np.int32)
        out[keep], out[at] = flat, eos_id
        cols[name] = pa.ListArray.from_arrays(pa.array(new_offsets.astype(np.int32)), pa.array(out))
    cols["length"] = pa.array(lengths + add)
    cols["trained"] = pa.array(table.column("trained").to_numpy() + add * (lengths > 0))
    return pa.table(cols)
