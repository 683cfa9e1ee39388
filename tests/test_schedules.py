"""LR schedules by name: values at given steps, by formula and against transformers.get_scheduler."""

from __future__ import annotations

import math

import pytest
import torch

from corelooper.config import Config, TrainArgs
from corelooper.errors import ConfigError
from corelooper.hf.schedules import create_scheduler

LR, TOTAL, WARMUP = 0.1, 20, 4


def lrs(kind: str, steps: int = TOTAL + 2, warmup: int = WARMUP, **kwargs) -> list[float]:
    """LR after 0, 1, ... steps for our scheduler (as the loop steps it)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=LR)
    args = TrainArgs(lr_scheduler_type=kind, warmup_steps=warmup, lr_scheduler_kwargs=kwargs)
    sched = create_scheduler(args, opt, TOTAL)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def hf_lrs(kind: str, steps: int = TOTAL + 2, warmup: int = WARMUP, **kwargs) -> list[float]:
    from transformers import get_scheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=LR)
    sched = get_scheduler(
        kind, opt, num_warmup_steps=warmup, num_training_steps=TOTAL, scheduler_specific_kwargs=kwargs
    )
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


# Expected LR at a few steps, written out from the HF formulas (warmup 4, 20 steps, lr 0.1).
def cos_half(progress: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * progress))


FORMULAS = {
    ("cosine_with_restarts", (("num_cycles", 2),)): {
        # two hard restarts over the 16 decay steps: cycle length 8
        2: LR * 2 / 4,
        4: LR,
        8: LR * cos_half(0.5),
        11: LR * cos_half((2 * 7 / 16) % 1),
        12: LR,  # restart
        16: LR * cos_half((2 * 12 / 16) % 1),
        20: 0.0,
    },
    ("polynomial", (("power", 2.0), ("lr_end", 1e-3))): {
        2: LR * 0.5,
        4: LR,
        8: (LR - 1e-3) * (1 - 4 / 16) ** 2 + 1e-3,
        14: (LR - 1e-3) * (1 - 10 / 16) ** 2 + 1e-3,
        20: 1e-3,
        21: 1e-3,
    },
    ("inverse_sqrt", ()): {
        2: LR * 0.5,
        4: LR,
        5: LR / math.sqrt(5 / 4),
        16: LR / math.sqrt(16 / 4),
        21: LR / math.sqrt(21 / 4),
    },
    ("cosine_with_min_lr", (("min_lr", 0.01),)): {
        4: LR,
        12: LR * (cos_half(0.5) * 0.9 + 0.1),
        20: 0.01,
    },
    ("warmup_stable_decay", (("num_decay_steps", 6), ("min_lr_ratio", 0.1), ("decay_type", "linear"))): {
        # warmup 0..4 (linear from 0.1*LR), stable 4..14, linear decay 14..20 to 0.1*LR
        0: LR * 0.1,
        2: LR * (0.5 * 0.9 + 0.1),
        4: LR,
        13: LR,
        14: LR,
        17: LR * ((1 - 3 / 6) * 0.9 + 0.1),
        20: LR * 0.1,
    },
    ("warmup_stable_decay", (("num_decay_steps", 8),)): {  # HF default decay: cosine
        12: LR,
        16: LR * cos_half(0.5),
        20: 0.0,
    },
}


@pytest.mark.parametrize("kind,kwargs", list(FORMULAS), ids=lambda v: str(v))
def test_schedule_values_by_formula_and_match_transformers(kind, kwargs):
    kw = dict(kwargs)
    ours = lrs(kind, **kw)
    for step, expected in FORMULAS[(kind, kwargs)].items():
        assert ours[step] == pytest.approx(expected, rel=1e-9, abs=1e-12), f"{kind} at step {step}"
    assert ours == pytest.approx(hf_lrs(kind, **kw), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_first_four_still_match_transformers(kind):
    assert lrs(kind) == pytest.approx(hf_lrs(kind), rel=1e-12, abs=1e-15)


def test_warmup_ratio_and_lr_multiplier_groups_keep_their_ratio():
    a = torch.nn.Parameter(torch.zeros(1))
    b = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": LR * 0.1}], lr=LR)
    sched = create_scheduler(TrainArgs(lr_scheduler_type="cosine", warmup_steps=0.2), opt, TOTAL)
    for _ in range(7):
        opt.step()
        sched.step()
    # warmup = ceil(0.2 * 20) = 4; step 7: progress 3/16
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * cos_half(3 / 16))
    assert opt.param_groups[1]["lr"] == pytest.approx(LR * 0.1 * cos_half(3 / 16))


def test_bad_kwargs_and_missing_options_name_the_key():
    with pytest.raises(ConfigError, match="lr_scheduler_kwargs.*cosine_with_restarts.*num_cycles"):
        lrs("cosine_with_restarts", num_cycle=2)
    with pytest.raises(ConfigError, match="num_decay_steps"):
        lrs("warmup_stable_decay")
    with pytest.raises(ConfigError, match="min_lr or min_lr_rate"):
        lrs("cosine_with_min_lr")
    with pytest.raises(ConfigError, match="reduce_lr_on_plateau.*eval_strategy"):
        Config.from_dict({"train": {"lr_scheduler_type": "reduce_lr_on_plateau"}})


def test_reduce_lr_on_plateau_follows_the_eval_metric(make_loop):
    """The LR is cut by `factor` once the metric has not improved for more than `patience`
    evaluations (torch's ReduceLROnPlateau rule); between evaluations it does not move."""
    scores = iter([1.0, 0.9, 0.95, 0.97, 0.8, 0.85, 0.9, 0.9])
    seen = []

    class Scores:
        def compute_metrics(self):
            return {"score": next(scores)}

        def on_evaluate(self, loop, metrics):  # before this evaluation's plateau step
            seen.append(loop.optimizer.param_groups[0]["lr"])

    loop = make_loop(
        [Scores()],
        max_steps=8,
        eval_steps=1,
        logging_steps=1,
        save_strategy="no",
        learning_rate=0.1,
        lr_scheduler_type="reduce_lr_on_plateau",
        metric_for_best_model="score",
        greater_is_better=False,
        lr_scheduler_kwargs={"factor": 0.5, "patience": 1},
    )
    loop.train()
    # eval 4 is the 2nd without improvement (> patience 1): halve; eval 7 likewise after eval 5's best.
    assert seen == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025])
    step_lrs = [h["learning_rate"] for h in loop.state.log_history if "learning_rate" in h]
    assert step_lrs == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025][: len(step_lrs)])
    assert loop.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
