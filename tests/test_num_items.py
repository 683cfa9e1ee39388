"""When a step counts ``num_items_in_batch``: always when someone reads it (an HF model, gradient
accumulation, a ``compute_loss`` plugin), and not for a one-batch step of a model that computes its
own mean loss (nothing reads it there; counting costs two kernels and a read per step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import toys
from torch import nn

from corelooper.loop import Loop
from corelooper.losses import default_loss
from corelooper.step import num_items_in_batch


class OwnMeanLoss(nn.Module):
    """forward(x, labels) -> {"loss": mean cross-entropy}: no num_items_in_batch, no **kwargs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def _loop(train_args, model, plugins=(), **args):
    loop = Loop(
        model,
        train_args(max_steps=2, per_device_train_batch_size=8, overwrite_output_dir=True, **args),
        train_dataset=toys.Blobs(32),
        plugins=plugins,
        blocked_plugins=["console"],
    )
    loop.train()
    return loop


def _batch(n=8):
    ds = toys.Blobs(n)
    return {"x": ds.x, "labels": ds.y}


def test_one_batch_step_of_an_own_loss_model_skips_the_count(train_args):
    loop = _loop(train_args, OwnMeanLoss())
    assert num_items_in_batch(loop, [_batch()]) is None  # one micro-batch in one process

    class CountingDefault:
        """Answers compute_loss with the builtin loss, so the step counts the items again."""

        name = "counting_default"

        def compute_loss(self, loop, model, batch, num_items_in_batch, return_outputs):
            assert torch.is_tensor(num_items_in_batch)
            return default_loss(loop, model, batch, num_items_in_batch, return_outputs)

    counted = _loop(train_args, OwnMeanLoss(), plugins=[CountingDefault()])
    # Same losses and weights, bit for bit: the count was not needed.
    assert [h.get("loss") for h in loop.state.log_history] == [
        h.get("loss") for h in counted.state.log_history
    ]
    for a, b in zip(loop.model.parameters(), counted.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_count_is_made_whenever_it_is_read(train_args):
    loop = _loop(train_args, OwnMeanLoss(), gradient_accumulation_steps=2)
    batches = [_batch(4), _batch(4)]  # accumulation: the model's mean must be weighed by the count
    assert int(num_items_in_batch(loop, batches)) == 8

    seen = []

    class Weighted:
        name = "weighted"

        def compute_loss(self, model, batch, num_items_in_batch):
            seen.append(num_items_in_batch)
            return model(**batch)["loss"]

    loop = _loop(train_args, OwnMeanLoss(), plugins=[Weighted()])
    assert seen and all(torch.is_tensor(n) and int(n) == 8 for n in seen)  # one batch, still counted

    lm = Loop(
        toys.tiny_llama(),
        train_args(max_steps=1, per_device_train_batch_size=4, overwrite_output_dir=True),
        train_dataset=toys.lm_samples(8),
        blocked_plugins=["console"],
    )
    lm.train()
    batch = next(iter(lm.train_loader))
    expected = int((batch["labels"][:, 1:] != -100).sum())
    assert int(num_items_in_batch(lm, [batch])) == expected  # an HF model takes the count
