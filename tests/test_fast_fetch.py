"""The fast batch paths (one slice for a TensorDataset, one ``__getitems__`` call per batch)
give exactly the batches torch's DataLoader gives for the same index lists."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from corelooper.data.loader import BatchLoader


class Dicts(Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.single_calls = 0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.single_calls += 1
        return {"x": self.x[i], "labels": self.y[i]}


class DictsWithGetitems(Dicts):
    def __getitems__(self, indices):
        return [{"x": self.x[i], "labels": self.y[i]} for i in indices]


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and torch.equal(a, b)


def _reference(dataset, loader: BatchLoader):
    """torch's DataLoader, sample by sample, on the index lists the BatchLoader chose."""
    return list(DataLoader(dataset, batch_sampler=loader.batch_indices(), collate_fn=default_collate))


def test_tensor_dataset_slices_equal_the_dataloader_batches():
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(103, 7, generator=g), torch.randint(0, 10, (103,), generator=g))
    for epoch in (0, 3):
        loader = BatchLoader(ds, 8, seed=5)
        loader.set_epoch(epoch)
        ours = list(loader)
        assert len(ours) == 13
        assert all(_same(a, b) for a, b in zip(ours, _reference(ds, loader), strict=True))


def test_getitems_is_asked_once_per_batch_and_gives_the_same_batches():
    plain, batched = Dicts(50), DictsWithGetitems(50)
    a, b = BatchLoader(plain, 6, seed=2), BatchLoader(batched, 6, seed=2)
    got_plain, got_batched = list(a), list(b)
    assert plain.single_calls == 50 and batched.single_calls == 0
    assert all(_same(x, y) for x, y in zip(got_plain, got_batched, strict=True))
    assert all(_same(x, y) for x, y in zip(got_plain, _reference(Dicts(50), a), strict=True))


def test_sharded_ranks_cover_the_global_batch_of_one_process():
    ds = TensorDataset(torch.arange(40).float().unsqueeze(1), torch.arange(40))
    one = BatchLoader(ds, 8, seed=3).batch_indices()
    ranks = [BatchLoader(ds, 4, seed=3, num_replicas=2, rank=r).batch_indices() for r in (0, 1)]
    for step, global_batch in enumerate(one):
        assert ranks[0][step] + ranks[1][step] == global_batch
