"""Language-model data utilities: padding collator, packing, length grouping, column filtering.

* ``DataCollatorForCausalLM`` pads samples of token ids to one length and masks padding (and,
  optionally, the prompt of prompt/completion samples) with -100 in ``labels``.
* ``pack_sequences`` / ``PackedDataset`` put short samples into fixed-length sequences, each
  sample attending only to itself (plugins/lm/corelooper_lm/packing.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from corelooper.errors import DataError

logger = logging.getLogger("corelooper.data.loader")

IGNORE_INDEX = -100
# Keys that describe a sample's parts, consumed by the collator (never passed to the model).
_PROMPT_KEYS = ("prompt_length",)


def _ids(value, key: str, i: int) -> list[int]:
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    raise DataError(
        f"Sample {i}: {key!r} must be a list or 1-D tensor of token ids, got {type(value).__name__}."
    )


class DataCollatorForCausalLM:
    """Pad a list of samples to a batch for causal-LM training.

    A sample is a dict with ``input_ids`` (optionally ``attention_mask``, ``labels``,
    ``prompt_length``), or a prompt/completion pair ``{"prompt_ids": [...], "completion_ids": [...]}``.
    ``labels`` default to ``input_ids``; padded positions get -100 (decided by the attention mask,
    so a pad id equal to EOS still trains on real EOS tokens). With ``mask_prompt`` (default on for
    prompt/completion samples and samples with ``prompt_length``) the prompt tokens get -100 too:
    the loss covers the completion only. Other keys with scalar values (e.g. a per-sample weight)
    are stacked into tensors.
    """

    def __init__(
        self,
        pad_token_id: int,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str = "right",
        mask_prompt: bool = True,
        return_position_ids: bool = False,
    ):
        if padding_side not in ("right", "left"):
            raise DataError(f"padding_side must be 'right' or 'left', got {padding_side!r}.")
        self.pad_token_id = pad_token_id
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padding_side = padding_side
        self.mask_prompt = mask_prompt
        self.return_position_ids = return_position_ids

    def _one(self, sample: Mapping, i: int) -> tuple[list[int], list[int], list[int]]:
        if "prompt_ids" in sample and "completion_ids" in sample:
            prompt = _ids(sample["prompt_ids"], "prompt_ids", i)
            ids = prompt + _ids(sample["completion_ids"], "completion_ids", i)
            n_prompt = len(prompt)
        elif "input_ids" in sample:
            ids = _ids(sample["input_ids"], "input_ids", i)
            n_prompt = int(sample.get("prompt_length", 0))
        else:
            raise DataError(
                f"Sample {i} has keys {sorted(sample)}; the causal-LM collator needs 'input_ids' "
                "(or 'prompt_ids' and 'completion_ids')."
            )
        labels = _ids(sample["labels"], "labels", i) if "labels" in sample else list(ids)
        if len(labels) != len(ids):
            raise DataError(f"Sample {i}: labels has {len(labels)} tokens, input_ids {len(ids)}.")
        if self.mask_prompt and n_prompt:
            labels[:n_prompt] = [IGNORE_INDEX] * min(n_prompt, len(labels))
        mask = (
            _ids(sample["attention_mask"], "attention_mask", i)
            if "attention_mask" in sample
            else [1] * len(ids)
        )
        if self.max_length is not None:
            ids, labels, mask = ids[: self.max_length], labels[: self.max_length], mask[: self.max_length]
        return ids, labels, mask

    def __call__(self, samples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        if not samples:
            raise DataError("The causal-LM collator got an empty list of samples.")
        rows = [self._one(s, i) for i, s in enumerate(samples)]
        length = max(len(r[0]) for r in rows)
        m = self.pad_to_multiple_of
        if m:
            length = -(-length // m) * m
        n = len(rows)
        input_ids = torch.full((n, length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((n, length), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((n, length), dtype=torch.long)
        for r, (ids, lab, mask) in enumerate(rows):
            k = len(ids)
            sl = slice(0, k) if self.padding_side == "right" else slice(length - k, length)
            input_ids[r, sl] = torch.tensor(ids, dtype=torch.long)
            mask_t = torch.tensor(mask, dtype=torch.long)
            attention[r, sl] = mask_t
            lab_t = torch.tensor(lab, dtype=torch.long)
            labels[r, sl] = torch.where(mask_t.bool(), lab_t, IGNORE_INDEX)
        batch = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
        if self.return_position_ids:
            batch["position_ids"] = (attention.cumsum(-1) - 1).clamp(min=0)
        skip = {"input_ids", "labels", "attention_mask", "prompt_ids", "completion_ids", *_PROMPT_KEYS}
        for key in samples[0]:
            if key in skip:
                continue
            values = [s[key] for s in samples]
            if all(
                isinstance(v, (int, float, bool)) or (torch.is_tensor(v) and v.dim() == 0) for v in values
            ):
                batch[key] = torch.stack([torch.as_tensor(v) for v in values])
        return batch


# -- packing ------------------------------------------------------------------------------------


def pack_sequences(
    sequences: Iterable[Sequence[int]],
    seq_len: int,
    strategy: str = "bfd",
    eos_token_id: int | None = None,
) -> list[list[list[int]]]:
    """Group token sequences into bins of at most ``seq_len`` tokens.

    ``strategy="bfd"`` (best-fit decreasing, as TRL, in ``O(n log n)``: plugins/lm/corelooper_lm/packing.py):
    whole samples go into the fullest bin they fit in; a sample longer than ``seq_len`` is first
    cut into ``seq_len`` pieces. Returns, per bin, the list of its pieces (so the caller can
    reset positions / mask the boundaries). ``strategy="wrap"``: concatenate everything (with
    ``eos_token_id`` after each sample, if given) and cut into ``seq_len`` blocks, like HF's
    ``group_texts``; each bin is one piece. Every token appears exactly once across the bins.
    """
    from .packing import plan_packing

    if strategy not in ("bfd", "wrap"):
        raise DataError(f"Packing strategy must be 'bfd' or 'wrap', got {strategy!r}.")
    seqs = [list(s) + ([eos_token_id] if eos_token_id is not None else []) for s in sequences]
    plan = plan_packing([len(s) for s in seqs], seq_len, "bfd_split" if strategy == "bfd" else "wrapped")
    bins = [[seqs[i][a:b] for i, a, b in row] for row in plan]
    if strategy == "wrap":
        bins = [[[t for piece in row for t in piece]] for row in bins]
    return bins


class PackedDataset(torch.utils.data.Dataset):
    """Short samples packed into fixed-length sequences of ``seq_len`` tokens.

    Each item: ``input_ids``, ``labels`` (-100 on padding and on the first token of every sample
    after the first in a row: it must not be predicted from the previous, unrelated sample) and
    ``position_ids`` (restarting at 0 for every packed sample). With ``strategy="bfd"`` the
    item's ``attention_mask`` is a ``[1, T, T]`` float block-diagonal causal mask (collated to
    the ``[B, 1, T, T]`` HF models take): with ``sdpa``/``eager`` attention, position ids alone
    do not keep packed samples apart. ``mask_dtype`` must be the model's dtype (bf16 models:
    ``torch.bfloat16``). With ``strategy="wrap"`` a row is one stream (``group_texts``), its
    ``attention_mask`` 1-D (0 on padding) and tokens attend across documents, as intended.
    ``corelooper-sft`` packs chat data (``[sft] packing``) with the same plans.
    """

    def __init__(
        self,
        sequences: Iterable[Sequence[int]],
        seq_len: int,
        pad_token_id: int,
        strategy: str = "bfd",
        eos_token_id: int | None = None,
        drop_incomplete: bool = False,
        mask_dtype: torch.dtype = torch.float32,
    ):
        self.seq_len = seq_len
        self.strategy = strategy
        self.mask_dtype = mask_dtype
        bins = pack_sequences(sequences, seq_len, strategy, eos_token_id)
        if drop_incomplete and bins and sum(map(len, bins[-1])) < seq_len and strategy == "wrap":
            bins = bins[:-1]
        n = len(bins)
        self.input_ids = torch.full((n, seq_len), pad_token_id, dtype=torch.long)
        self.labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
        self.attention_mask = torch.zeros((n, seq_len), dtype=torch.long)
        self.position_ids = torch.zeros((n, seq_len), dtype=torch.long)
        self.seq_lengths = [[len(p) for p in pieces] for pieces in bins]
        for r, pieces in enumerate(bins):
            pos = 0
            for j, piece in enumerate(pieces):
                k = len(piece)
                t = torch.tensor(piece, dtype=torch.long)
                self.input_ids[r, pos : pos + k] = t
                self.labels[r, pos : pos + k] = t
                if j > 0:
                    self.labels[r, pos] = IGNORE_INDEX
                self.attention_mask[r, pos : pos + k] = 1
                self.position_ids[r, pos : pos + k] = torch.arange(k)
                pos += k
            if strategy == "wrap":
                self.position_ids[r] = torch.arange(seq_len)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.strategy == "wrap":
            mask = self.attention_mask[i]
        else:  # built per item (T*T floats), not stored for the whole data set
            from .packing import block_causal_mask

            mask = block_causal_mask([self.seq_lengths[i]], self.seq_len, self.mask_dtype)[0]
        return {
            "input_ids": self.input_ids[i],
            "labels": self.labels[i],
            "attention_mask": mask,
            "position_ids": self.position_ids[i],
        }

    @property
    def lengths(self) -> list[int]:
        return self.attention_mask.sum(-1).tolist()


# -- length grouping ----------------------------------------------------------------------------
