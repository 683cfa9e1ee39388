"""Evaluation batches on several processes as accelerate deals them to HF's Trainer (``even_batches``).

Round ``k`` holds the samples ``[k * B * W, (k + 1) * B * W)`` of the dataset in order (``B`` the
per-device batch size, ``W`` the processes), cut into ``W`` batches of ``B``: process ``r`` takes
the ``r``-th. Indices past the end wrap to the start, so every process runs the same number of
full batches (the collectives of each batch line up), and gathering a round's batches in rank
order gives the samples in dataset order; the last round keeps only its real samples
(``kept(i)``, accelerate's ``gather_for_metrics`` remainder).
"""

from __future__ import annotations

import math


class EvenBatches:
    """This process's evaluation batches, accelerate's way; ``kept(i)``: how many gathered rows of
    batch ``i``'s round are real samples (``None``: all)."""

    def __init__(self, dataset, batch_size: int, collate_fn, rank: int, world: int) -> None:
        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.rank, self.world = rank, world
        self.rounds = math.ceil(len(dataset) / (batch_size * world)) if len(dataset) else 0

    def __len__(self) -> int:
        return self.rounds

    def kept(self, i: int) -> int | None:
        remainder = len(self.dataset) % (self.batch_size * self.world)
        return remainder if i == self.rounds - 1 and remainder else None

    def __iter__(self):
        n, size = len(self.dataset), self.batch_size
        for k in range(self.rounds):
            start = (k * self.world + self.rank) * size
            yield self.collate_fn([self.dataset[i % n] for i in range(start, start + size)])
