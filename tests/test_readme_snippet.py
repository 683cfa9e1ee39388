"""The README's compute_loss snippet works as written: weighted training batches, unweighted eval
batches (the builtin loss answers), and evaluation's return_outputs."""

from __future__ import annotations

import re
import types

import torch
from conftest import REPO

from corelooper import Loop


def readme_plugin() -> types.ModuleType:
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)
    (source,) = [b for b in blocks if "def compute_loss" in b]
    module = types.ModuleType("readme_plugin")
    module.torch = torch
    exec(compile(source, "README.md:compute_loss", "exec"), module.__dict__)
    return module


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, pixel_values):
        return self.lin(pixel_values)


def rows(n, weighted, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [
        {"pixel_values": x[i], "labels": y[i], **({"weight": torch.tensor(2.0)} if weighted else {})}
        for i in range(n)
    ]


def test_readme_compute_loss_trains_weighted_and_evaluates(tmp_path):
    plugin = readme_plugin()
    args = {
        "train": {
            "output_dir": str(tmp_path),
            "max_steps": 3,
            "save_strategy": "no",
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
        }
    }
    collated = torch.utils.data.default_collate(rows(4, True))
    net = Net()
    loss = plugin.compute_loss(net, collated, torch.tensor(4), False)
    plain = torch.nn.functional.cross_entropy(net(collated["pixel_values"]), collated["labels"])
    assert torch.allclose(loss, 2.0 * plain)  # the weight really applies
    loop = Loop(Net(), args, train_dataset=rows(32, True), eval_dataset=rows(8, False, 1), plugins=[plugin])
    loop.train()
    assert "eval_loss" in loop.evaluate()  # an eval batch with no weight: the builtin loss answered
    with_weights = Loop(Net(), args, eval_dataset=rows(8, True, 1), plugins=[plugin]).evaluate()
    without = Loop(Net(), args, eval_dataset=rows(8, False, 1)).evaluate()
    assert abs(with_weights["eval_loss"] - 2 * without["eval_loss"]) < 1e-5  # return_outputs path
