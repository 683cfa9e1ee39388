"""The one metric-direction rule (corelooper/metric.py), checked against the HF Trainer's own code:
``TrainingArguments`` decides ``greater_is_better``, ``EarlyStoppingCallback`` decides "improved"."""

from __future__ import annotations

import math

import pytest

from corelooper.config import Config, TrainArgs
from corelooper.metric import greater_for, greater_is_better, is_better, metric_key

NAMES = [
    "loss",
    "eval_loss",
    "accuracy",
    "eval_accuracy",
    "nll_loss",
    "eval_f1",
    "perplexity",
    "lossy",
    "bleu",
]


def test_metric_key_adds_the_prefix_once():
    assert metric_key("accuracy") == "eval_accuracy"
    assert metric_key("eval_accuracy") == "eval_accuracy"
    assert metric_key("loss", prefix="test") == "test_loss"
    assert metric_key("evaluation") == "eval_evaluation"  # "eval" without "_" is not the prefix


@pytest.mark.parametrize("name", NAMES)
def test_default_direction_is_hf_training_arguments(name, tmp_path):
    from transformers import TrainingArguments

    hf = TrainingArguments(output_dir=str(tmp_path), metric_for_best_model=name, report_to=[])
    assert greater_is_better(name) is hf.greater_is_better
    ours = Config.from_dict({"train": {"output_dir": str(tmp_path), "metric_for_best_model": name}})
    assert ours.train.greater_is_better is hf.greater_is_better  # what corelooper's config fills in
    for explicit in (True, False):
        assert greater_is_better(name, explicit) is explicit


def test_explicit_direction_belongs_to_metric_for_best_model_only(tmp_path):
    args = TrainArgs(output_dir=str(tmp_path), metric_for_best_model="score", greater_is_better=False)
    assert greater_for("score", args) is False
    assert greater_for("eval_score", args) is False  # same metric, with the prefix
    assert greater_for("eval_accuracy", args) is True  # another metric: its name decides
    assert greater_for("eval_loss", args) is False
    assert greater_for("accuracy", TrainArgs(output_dir=str(tmp_path))) is True


@pytest.mark.parametrize("greater", [True, False])
@pytest.mark.parametrize("threshold", [0.0, 0.05])
def test_improvement_is_hf_early_stopping(greater, threshold, tmp_path):
    from transformers import EarlyStoppingCallback, TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), metric_for_best_model="m", greater_is_better=greater, report_to=[]
    )
    values = [0.5, 0.52, 0.58, 0.58, 0.4, 0.3, 0.31, 0.9, 0.6]
    for best in (None, *values):
        for value in values:
            cb = EarlyStoppingCallback(early_stopping_patience=3, early_stopping_threshold=threshold)
            cb.early_stopping_patience_counter = 1
            state = TrainerState(best_metric=best)
            cb.check_metric_value(args, state, TrainerControl(), value)
            hf_improved = cb.early_stopping_patience_counter == 0
            assert is_better(value, best, greater, threshold) is hf_improved, (value, best)


def test_nan_never_improves():
    assert not is_better(math.nan, None, True)
    assert not is_better(math.nan, 1.0, False)
    assert is_better(1.0, None, False)


def test_a_missing_metric_names_the_setting_and_what_there_is():
    from corelooper.errors import ConfigError
    from corelooper.metric import metric_value

    metrics = {"eval_loss": 0.5, "eval_accuracy": 0.75}
    assert metric_value(metrics, "accuracy", "train.metric_for_best_model") == 0.75
    assert metric_value(metrics, "eval_loss", "early_stopping.metric") == 0.5
    with pytest.raises(ConfigError) as e:
        metric_value(metrics, "f1", "early_stopping.metric")
    assert str(e.value) == (
        "early_stopping.metric = 'f1' watches 'eval_f1', but the evaluation returned only "
        "['eval_accuracy', 'eval_loss']. Set early_stopping.metric to one of those names (with or "
        "without the eval_ prefix)."
    )
    assert e.value.exit_code == 2


def test_plateau_scheduler_uses_the_rule(tmp_path):
    import torch

    from corelooper.errors import ConfigError
    from corelooper.hf.schedules import create_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    args = Config.from_dict(
        {
            "train": {
                "output_dir": str(tmp_path),
                "lr_scheduler_type": "reduce_lr_on_plateau",
                "eval_strategy": "steps",
                "metric_for_best_model": "accuracy",
                "lr_scheduler_kwargs": {"patience": 0, "factor": 0.5},
            }
        }
    ).train
    sched = create_scheduler(args, opt, 10)
    sched.step_on_metrics({"eval_accuracy": 0.5})
    sched.step_on_metrics({"eval_accuracy": 0.6})  # higher is better for accuracy: no cut
    assert sched.get_last_lr() == [1.0]
    sched.step_on_metrics({"eval_accuracy": 0.55})
    assert sched.get_last_lr() == [0.5]
    with pytest.raises(ConfigError, match=r"train.metric_for_best_model = 'eval_accuracy' watches"):
        sched.step_on_metrics({"eval_loss": 1.0})
