"""label_smoothing_factor in the default loss, normalised over the step's loss tokens."""

from __future__ import annotations

import math

import pytest
import torch

from corelooper.config import Config
from corelooper.loop import Loop

EPS = 0.1


def hand_smoothed(logits: torch.Tensor, labels: torch.Tensor, eps: float) -> tuple[float, int]:
    """Sum over items of (1-eps) * -log p_y + eps * mean_c(-log p_c), skipping -100; and the count."""
    total, n = 0.0, 0
    for row, y in zip(logits.tolist(), labels.tolist(), strict=True):
        if y == -100:
            continue
        m = max(row)
        log_z = m + math.log(sum(math.exp(v - m) for v in row))
        logp = [v - log_z for v in row]
        total += (1 - eps) * -logp[y] + eps * sum(-lp for lp in logp) / len(row)
        n += 1
    return total, n


def test_eval_loss_with_label_smoothing_matches_hand_computation(make_loop):
    loop = make_loop(label_smoothing_factor=EPS)
    metrics = loop.evaluate()
    x, y = loop.eval_dataset.x, loop.eval_dataset.y
    with torch.no_grad():
        logits = loop.model(x)
    total, n = hand_smoothed(logits, y, EPS)
    assert metrics["eval_loss"] == pytest.approx(total / n, rel=1e-6)
    plain, _ = hand_smoothed(logits, y, 0.0)
    assert abs(total - plain) > 1e-3  # the smoothing really changed the number


def causal_loop(tmp_path, eps: float) -> Loop:
    import os
    import sys

    os.environ["CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # installed plugins play no part here

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from toys import tiny_lm

    cfg = Config.from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "label_smoothing_factor": eps,
                "max_steps": 1,
                "disable_tqdm": True,
                "loss_type": "causal_lm",
            }
        }
    )
    loop = Loop(tiny_lm(), cfg)
    loop.prepare_for_evaluation()
    return loop


def test_causal_lm_label_smoothing_is_token_normalised(tmp_path):
    """Two micro-batches with different numbers of real tokens: each returns its summed smoothed
    loss / num_items_in_batch of the whole step, so the two add up to the token mean."""
    loop = causal_loop(tmp_path, EPS)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 32, (2, 12), generator=g) for _ in range(2)]
    labels = [i.clone() for i in ids]
    labels[0][0, 5:] = -100  # padding: fewer loss tokens in the first micro-batch
    labels[1][1, :9] = -100
    batches = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]
    n_items = sum(int((lab[:, 1:] != -100).sum()) for lab in labels)
    step = sum(
        loop.hook.compute_loss(
            loop=loop,
            model=loop.model,
            batch=b,
            num_items_in_batch=torch.tensor(n_items),
            return_outputs=False,
        )
        for b in batches
    )
    total, n = 0.0, 0
    with torch.no_grad():
        for i, lab in zip(ids, labels, strict=True):
            logits = loop.model(i)[:, :-1].reshape(-1, 32)
            t, k = hand_smoothed(logits, lab[:, 1:].reshape(-1), EPS)
            total, n = total + t, n + k
    assert n == n_items
    assert step.item() == pytest.approx(total / n, rel=1e-6)


def test_matches_transformers_label_smoother(tmp_path):
    from transformers.trainer_pt_utils import LabelSmoother

    loop = causal_loop(tmp_path, EPS)
    ids = torch.randint(0, 32, (3, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[2, 7:] = -100
    loss = loop.hook.compute_loss(
        loop=loop,
        model=loop.model,
        batch={"input_ids": ids, "labels": labels},
        num_items_in_batch=None,
        return_outputs=False,
    )
    with torch.no_grad():
        hf = LabelSmoother(epsilon=EPS)({"logits": loop.model(ids)}, labels, shift_labels=True)
    assert loss.item() == pytest.approx(hf.item(), rel=1e-6)


def test_out_of_range_factor_is_a_config_error():
    from corelooper.errors import ConfigError

    with pytest.raises(ConfigError, match="label_smoothing_factor"):
        Config.from_dict({"train": {"label_smoothing_factor": 1.0}})
