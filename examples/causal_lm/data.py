"""Real text that exists on every machine: Python's own standard-library sources.

The ``.py`` files of a few stdlib packages (``json`` and ``email`` by default) are split by file
into train and eval (every ``eval_every``-th file is held out, so no eval text is seen in
training), tokenized with a byte-level BPE trained here on the training files only (no
download), and packed into fixed-length blocks with ``corelooper_lm.collators.PackedDataset``.
Each block carries a ``difficulty_score``: its zlib compression ratio (less compressible text is
harder to predict), scaled to mean 1 over the training set, used by ``weighted_loss.py``.
"""

from __future__ import annotations

import functools
import sysconfig
import zlib
from pathlib import Path

import torch
from corelooper_lm.collators import PackedDataset

from corelooper.errors import DataError

SPECIALS = ("<|endoftext|>", "<pad>")
EOS_ID, PAD_ID = 0, 1


def stdlib_files(packages: tuple[str, ...]) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for pkg in packages:
        folder = root / pkg
        if not folder.is_dir():
            raise DataError(f"data.args.packages: {pkg!r} is not a package folder under {root}.")
        files.extend(sorted(p for p in folder.rglob("*.py") if "test" not in p.parts))
    if not files:
        raise DataError(f"No .py files found for data.args.packages = {list(packages)} under {root}.")
    return files


def split_files(packages: tuple[str, ...], eval_every: int) -> tuple[list[str], list[str]]:
    files = stdlib_files(packages)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    train = [t for i, t in enumerate(texts) if i % eval_every != eval_every // 2]
    held = [t for i, t in enumerate(texts) if i % eval_every == eval_every // 2]
    return train, held


@functools.lru_cache(maxsize=4)
def tokenizer(packages: tuple[str, ...] = ("json", "email"), vocab_size: int = 1024, eval_every: int = 8):
    """A byte-level BPE (``tokenizers``) trained on the training files; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train, _ = split_files(packages, eval_every)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(train, trainer=trainer)
    assert tok.token_to_id(SPECIALS[0]) == EOS_ID and tok.token_to_id(SPECIALS[1]) == PAD_ID
    return tok


def _dataset(split: str, packages, vocab_size: int, seq_len: int, eval_every: int, strategy: str):
    packages = tuple(packages)
    tok = tokenizer(packages, vocab_size, eval_every)
    train, held = split_files(packages, eval_every)
    texts = train if split == "train" else held
    ids = [e.ids for e in tok.encode_batch(texts)]
    ds = PackedDataset(
        ids, seq_len, pad_token_id=PAD_ID, strategy=strategy, eos_token_id=EOS_ID, drop_incomplete=True
    )
    ds.difficulty = _difficulty(tok, ds)
    return ds


def _difficulty(tok, ds: PackedDataset) -> torch.Tensor:
    ratios = []
    for row, mask in zip(ds.input_ids, ds.attention_mask, strict=True):
        raw = tok.decode(row[mask.bool()].tolist(), skip_special_tokens=False).encode()
        ratios.append(len(zlib.compress(raw, 9)) / max(len(raw), 1))
    r = torch.tensor(ratios, dtype=torch.float32)
    return r / r.mean()


class CorpusBlocks(torch.utils.data.Dataset):
    """``{"input_ids", "labels", "attention_mask", "position_ids", "difficulty_score"}`` blocks."""

    def __init__(self, packed: PackedDataset, limit: int = 0):
        self.packed = packed
        self.n = min(limit, len(packed)) if limit > 0 else len(packed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**self.packed[i], "difficulty_score": self.packed.difficulty[i]}

    @property
    def lengths(self) -> list[int]:
        return self.packed.lengths[: self.n]


def train_set(
    packages=("json", "email"),
    vocab_size: int = 1024,
    seq_len: int = 128,
    eval_every: int = 8,
    packing: str = "wrap",
    **_,
) -> CorpusBlocks:
    return CorpusBlocks(_dataset("train", packages, vocab_size, seq_len, eval_every, packing))


def eval_set(
    packages=("json", "email"),
    vocab_size: int = 1024,
    seq_len: int = 128,
    eval_every: int = 8,
    packing: str = "wrap",
    max_eval_blocks: int = 0,
    **_,
) -> CorpusBlocks:
    """The held-out files' blocks (the first ``max_eval_blocks`` of them when > 0)."""
    return CorpusBlocks(_dataset("eval", packages, vocab_size, seq_len, eval_every, packing), max_eval_blocks)
