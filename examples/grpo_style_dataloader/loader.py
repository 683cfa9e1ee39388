"""A ``train_dataloader`` that loads ``steps_per_generation`` batches at once (TRL's GRPO pattern).

GRPO generates completions for a large *generation batch* (one batched ``generate`` call is far
cheaper than many small ones), then trains on it for ``steps_per_generation`` optimizer steps.
``GenerationBatchLoader`` wraps a seeded, rank-sharded ``BatchLoader`` whose batches are
generation batches: each is fetched in one go, turned into training rows by ``generate`` (once),
and cut into ``steps_per_generation`` batches of ``rows_per_step`` rows, yielded one per step.

Resume: ``skip(n)`` skips whole generation batches by index and then ``n % steps_per_generation``
slices of the next one (which is generated again, with the restored model and RNG).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from corelooper.data.loader import BatchLoader


def _rows(batch: dict[str, torch.Tensor]) -> int:
    return next(iter(batch.values())).shape[0]


class GenerationBatchLoader:
    def __init__(
        self,
        inner: BatchLoader,
        steps_per_generation: int,
        generate: Callable[[list[Any]], dict[str, torch.Tensor]],
    ):
        self.inner = inner
        self.steps_per_generation = steps_per_generation
        self.generate = generate
        self._skip_slices = 0
        self.generations = 0  # generate() calls (a fact for logs and tests)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def skip(self, num_batches: int) -> None:
        self.inner.skip(num_batches // self.steps_per_generation)
        self._skip_slices = num_batches % self.steps_per_generation

    def __len__(self) -> int:
        return len(self.inner) * self.steps_per_generation

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        skip, self._skip_slices = self._skip_slices, 0
        k = self.steps_per_generation
        for samples in self.inner:
            rows = self.generate(samples)
            self.generations += 1
            n = _rows(rows)
            per = -(-n // k)
            for i in range(skip, k):
                if i * per >= n:
                    break
                yield {key: v[i * per : (i + 1) * per] for key, v in rows.items()}
            skip = 0
