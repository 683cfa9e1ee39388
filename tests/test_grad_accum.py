"""Gradient accumulation is exact, shaped like HF's ``TrainerGradientAccumulationTest``.

A tiny causal LM trains on variable-length sequences padded with label -100. Batch 8 x GA 1 and
batch 2 x GA 4 see the same 8 samples per optimizer step (the sampler's order does not depend
on the batch size), so with correct normalisation (sum of token losses / tokens of the whole
step) their per-step losses and final parameters agree; a mean-of-means loss does not.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import toys

from corelooper.data.loader import epoch_permutation
from corelooper.loop import Loop

TOL = 1e-5


class MeanLoss:
    """The naive loss: a per-micro-batch *mean*, ignoring ``num_items_in_batch``.

    Its signature lacks ``num_items_in_batch``, so the loop falls back to dividing it by the
    number of micro-batches of the step: a mean of means, wrong for variable-length data.
    """

    name = "mean_loss"

    def compute_loss(self, model, batch, return_outputs):
        if hasattr(model, "config"):  # an HF model: its own (mean) loss
            out = model(**batch)
            return (out.loss, out) if return_outputs else out.loss
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            batch["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
        )
        return (loss, logits) if return_outputs else loss


def train(model, samples, train_args, batch, ga, plugins=(), max_steps=-1, epochs=1.0, clip=0.0):
    args = train_args(
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga,
        max_steps=max_steps,
        num_train_epochs=epochs,
        lr_scheduler_type="constant",
        max_grad_norm=clip,
        output_dir=train_args().output_dir + f"-{batch}x{ga}-{len(plugins)}",
    )
    loop = Loop(
        copy.deepcopy(model), args, train_dataset=samples, plugins=plugins, blocked_plugins=["console"]
    )
    loop.train()
    losses = [h["loss"] for h in loop.state.log_history if "loss" in h]
    params = {k: v.detach().clone() for k, v in loop.backend.unwrap_model(loop.model).state_dict().items()}
    return losses, params, loop


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def max_loss_diff(a: list, b: list) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def lm_data():
    return toys.lm_samples(48, seed=0)


def test_plain_module_ga_matches_big_batch_naive_does_not(lm_data, train_args):
    model = toys.tiny_lm(seed=0)
    # clipping on (max_grad_norm 0.5): the norm is taken over the whole step's gradient
    base_losses, base_params, base_loop = train(model, lm_data, train_args, batch=8, ga=1, clip=0.5)
    ga_losses, ga_params, loop = train(model, lm_data, train_args, batch=2, ga=4, clip=0.5)
    naive_losses, naive_params, _ = train(
        model, lm_data, train_args, batch=2, ga=4, clip=0.5, plugins=[MeanLoss()]
    )

    assert len(base_losses) == 6 and loop.state.global_step == 6  # a loss logged every step
    assert max_loss_diff(base_losses, ga_losses) < TOL
    assert max_param_diff(base_params, ga_params) < TOL
    norms = [[h["grad_norm"] for h in lp.state.log_history if "grad_norm" in h] for lp in (base_loop, loop)]
    assert len(norms[0]) == 6 and max_loss_diff(*norms) < TOL
    assert max(norms[0]) > 0.5  # clipping was active
    # the naive run is visibly off, in every step's loss and in the weights
    assert max_loss_diff(base_losses, naive_losses) > 0.01
    assert max_param_diff(base_params, naive_params) > 1e-3
    # and the parameters really moved (the comparison is not between untouched models)
    assert max_param_diff(base_params, {k: v for k, v in model.state_dict().items()}) > 1e-2


def test_hf_llama_gets_num_items_in_batch_and_matches(lm_data, train_args):
    pytest.importorskip("transformers")
    model = toys.tiny_llama(seed=0)
    seen = []

    def spy(module, args, kwargs):
        seen.append(kwargs.get("num_items_in_batch"))

    base_losses, base_params, _ = train(model, lm_data, train_args, batch=8, ga=1, max_steps=3, clip=1.0)
    spied = copy.deepcopy(model)
    spied.register_forward_pre_hook(spy, with_kwargs=True)
    ga_losses, ga_params, _ = train(spied, lm_data, train_args, batch=2, ga=4, max_steps=3, clip=1.0)
    naive_losses, naive_params, _ = train(
        model, lm_data, train_args, batch=2, ga=4, max_steps=3, clip=1.0, plugins=[MeanLoss()]
    )

    # the model computed its own loss with the step's token count: same number for the 4
    # micro-batches of a step, and equal to the label tokens after the causal shift
    order = epoch_permutation(len(lm_data), 42, 0, True)
    expected = [
        int(sum((lm_data[i]["labels"][1:] != -100).sum() for i in order[s * 8 : s * 8 + 8])) for s in range(3)
    ]
    assert [int(n) for n in seen] == [n for n in expected for _ in range(4)]
    assert max_loss_diff(base_losses, ga_losses) < TOL
    assert max_param_diff(base_params, ga_params) < TOL
    assert max_loss_diff(base_losses, naive_losses) > 5e-3  # measured: 1.8e-2 (3 steps)
    assert max_param_diff(base_params, naive_params) > 1e-2  # measured: 5.3e-2


def test_micro_batch_without_loss_tokens(train_args):
    # blank the labels of exactly the two samples the seeded sampler puts in one micro-batch
    samples = toys.lm_samples(16, seed=3)
    order = epoch_permutation(16, 42, 0, True)
    empty = set(order[2:4])  # the 2nd micro-batch of the first step
    samples = [
        dict(s, labels=torch.full_like(s["labels"], -100)) if i in empty else s for i, s in enumerate(samples)
    ]
    model = toys.tiny_lm(seed=1)
    base_losses, base_params, _ = train(model, samples, train_args, batch=8, ga=1)
    ga_losses, ga_params, _ = train(model, samples, train_args, batch=2, ga=4)
    assert all(torch.isfinite(torch.tensor(ga_losses)))
    assert max_loss_diff(base_losses, ga_losses) < TOL
    assert max_param_diff(base_params, ga_params) < TOL


def test_step_without_any_loss_tokens_is_zero_not_nan(train_args):
    samples = [dict(s, labels=torch.full_like(s["labels"], -100)) for s in toys.lm_samples(8)]
    model = toys.tiny_lm(seed=2)
    losses, params, _ = train(model, samples, train_args, batch=2, ga=4)
    assert losses == [0.0]
    assert max_param_diff(params, model.state_dict()) == 0.0  # zero gradient, no weight decay


def hand_training(
    model, samples, steps: list[list[int]], lr: float, mean_of_means: bool = False, micro: int = 2
):
    """The reference: a plain torch loop, normalising each step by hand."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for idx in steps:
        total = torch.zeros(())
        chunks = [idx[i : i + micro] for i in range(0, len(idx), micro)]
        n_tokens = sum(int((samples[i]["labels"][1:] != -100).sum()) for i in idx)
        for chunk in chunks:
            ids = torch.stack([samples[i]["input_ids"] for i in chunk])
            labels = torch.stack([samples[i]["labels"] for i in chunk])
            logits = model(ids)
            flat = (logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            if mean_of_means:
                loss = F.cross_entropy(*flat, ignore_index=-100) / len(chunks)
            else:
                loss = F.cross_entropy(*flat, ignore_index=-100, reduction="sum") / n_tokens
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    return losses, model.state_dict()


def test_final_partial_accumulation_window_matches_hand_computation(train_args):
    # 20 samples, batch 2, GA 4: micro-batches 4 + 4 + 2 -> the last step has 2 micro-batches
    samples = toys.lm_samples(20, seed=5)
    model = toys.tiny_lm(seed=3)
    order = epoch_permutation(20, 42, 0, True)
    steps = [order[0:8], order[8:16], order[16:20]]
    ref_losses, ref_params = hand_training(model, samples, steps, lr=1e-2)

    losses, params, loop = train(model, samples, train_args, batch=2, ga=4)
    assert loop.state.global_step == 3
    assert max_loss_diff(losses, ref_losses) < TOL
    assert max_param_diff(params, ref_params) < TOL

    # the mean-loss fallback divides the short window by 2 (its micro-batches), not by GA = 4
    naive_ref, naive_ref_params = hand_training(model, samples, steps, lr=1e-2, mean_of_means=True)
    naive, naive_params, _ = train(model, samples, train_args, batch=2, ga=4, plugins=[MeanLoss()])
    assert max_loss_diff(naive, naive_ref) < TOL
    assert max_param_diff(naive_params, naive_ref_params) < TOL


def test_one_micro_batch_is_on_the_device_at_a_time_and_the_weights_are_the_same(lm_data, train_args):
    """Each micro-batch moves to the device just before its forward (as accelerate's loader
    moves each batch), so a step of 4 micro-batches holds one on the device, not 4; with auto
    batch size's smaller pieces the inputs' memory then shrinks with the micro-batch. A second
    device cannot exist here: a backend whose ``to_device`` copies, as a move does, stands in
    for it. ``num_items_in_batch`` is counted on the host batches, with the same result."""
    plugin, alive_at_forward = toys.CopyingDevice("input_ids"), []
    model = toys.tiny_lm(seed=0)
    base_losses, base_params, _ = train(model, lm_data, train_args, batch=2, ga=4, clip=0.5)
    copied = copy.deepcopy(model)
    copied.register_forward_pre_hook(lambda *_: alive_at_forward.append(plugin.alive()))
    losses, params, loop = train(copied, lm_data, train_args, batch=2, ga=4, clip=0.5, plugins=[plugin])
    assert loop.state.global_step == 6 and len(plugin.copies) == 24  # every micro-batch was moved once
    assert alive_at_forward == [1] * 24  # only the forward's own micro-batch (before: all 4 of the step)
    assert losses == base_losses  # bit-equal: the same count, the same sums
    assert max_param_diff(base_params, params) == 0.0
