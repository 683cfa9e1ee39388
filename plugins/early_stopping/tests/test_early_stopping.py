"""corelooper-early-stopping: HF's EarlyStoppingCallback decisions, its counter across a resume,
and start-up errors. Metrics come from a scripted compute_metrics provider so every decision is
known in advance; training itself is real (the tiny task of corelooper_testing)."""

from __future__ import annotations

import json
from pathlib import Path

import corelooper_early_stopping as es_plugin
import pytest
from corelooper_testing import SigtermAt

from corelooper.errors import ConfigError


class Scores:
    """Provides ``eval_score`` = ``table[global_step]`` (a provider: it answers before the builtin)."""

    name = "scores"

    def __init__(self, table: dict[int, float]):
        self.table = table

    def compute_metrics(self, loop):
        return {"score": self.table[loop.state.global_step]}


def stopper(loop):
    """This run's EarlyStopping object (one per Loop, registered by corelooper_configure)."""
    return loop.plugins.get("early_stopping.run")


def table(*values: float) -> dict[int, float]:
    return {step: v for step, v in enumerate(values, start=1)}


EVERY_STEP = dict(eval_steps=1, max_steps=10, save_strategy="no")


@pytest.mark.parametrize(
    ("scores", "section", "stop_step"),
    [
        # best 0.5, 0.6; then 0.6 (no gain) and 0.55: two evaluations without improvement
        ((0.5, 0.6, 0.6, 0.55, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9), {"patience": 2}, 4),
        # an improvement must exceed the threshold: 0.52 and 0.54 do not count against 0.5
        ((0.5, 0.52, 0.54, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9), {"patience": 2, "threshold": 0.05}, 3),
        # mode = "min": lower is better; the counter resets at 0.3
        ((0.5, 0.6, 0.3, 0.4, 0.4, 0.4, 0.1, 0.1, 0.1, 0.1), {"patience": 3, "mode": "min"}, 6),
        # improving all along: never stops
        ((0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), {"patience": 1}, 10),
    ],
)
def test_stops_after_patience_evaluations_without_improvement(run_loop, scores, section, stop_step):
    loop = run_loop(
        [es_plugin, Scores(table(*scores))],
        sections={"early_stopping": {"metric": "score", **section}},
        **EVERY_STEP,
    )
    assert loop.state.global_step == stop_step
    evaluated = [h["step"] for h in loop.state.log_history if "eval_score" in h]
    assert evaluated == list(range(1, stop_step + 1))
    assert stopper(loop).stopped_at == (stop_step if stop_step < 10 else None)


def test_metric_and_mode_default_to_metric_for_best_model(run_loop):
    # greater_is_better = false for "score" here: a falling score is an improvement
    scores = table(0.9, 0.8, 0.85, 0.85, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7)
    loop = run_loop(
        [es_plugin, Scores(scores)],
        sections={"early_stopping": {"patience": 2}},
        metric_for_best_model="score",
        greater_is_better=False,
        **EVERY_STEP,
    )
    assert es_plugin.resolved(loop.config) == ("eval_score", "min", 2, 0.0)
    assert (stopper(loop).metric, stopper(loop).mode) == ("eval_score", "min")
    assert loop.state.global_step == 4


def test_counter_is_saved_in_checkpoints_and_survives_a_resume(run_loop, tmp_path):
    # best 0.5 at step 1, then no improvement: a fresh counter would stop at step 5, not 4
    scores = Scores(table(0.5, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4))
    args = dict(
        eval_steps=1,
        max_steps=10,
        save_steps=1,
        output_dir=tmp_path / "run",
        sections={"early_stopping": {"metric": "score", "patience": 3}},
    )
    run_loop([es_plugin, scores, SigtermAt(at_step=3)], **args)
    saved = json.loads((tmp_path / "run" / "checkpoint-3" / "plugins.json").read_text())
    assert saved["early_stopping"] == {"best": 0.5, "bad_evals": 2}

    loop = run_loop([es_plugin, scores], resume="latest", **args)
    assert loop.state.global_step == 4 and stopper(loop).stopped_at == 4
    assert stopper(loop).state_dict() == {"best": 0.5, "bad_evals": 3}
    assert not Path(tmp_path / "run" / "checkpoint-5").exists()


def test_enabled_without_evaluation_fails_at_start_up(make_loop):
    with pytest.raises(ConfigError, match=r'train.eval_strategy = "no".*\[early_stopping\]'):
        make_loop([es_plugin], sections={"early_stopping": {}}, eval_strategy="no")
    # switched off, or without a section, the same config is fine
    make_loop([es_plugin], sections={"early_stopping": {"enabled": False}}, eval_strategy="no")
    make_loop([es_plugin], eval_strategy="no")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"mode": "maximum"}, r'early_stopping.mode must be "min" or "max"'),
        ({"patience": 0}, r"early_stopping.patience must be >= 1"),
        ({"patiense": 3}, r"Unknown key early_stopping.patiense. Did you mean 'patience'"),
        ({"patience": "3"}, r"early_stopping.patience must be of type int"),
    ],
)
def test_bad_settings_fail_at_start_up(make_loop, section, message):
    with pytest.raises(ConfigError, match=message):
        make_loop([es_plugin], sections={"early_stopping": section})


def test_unknown_metric_names_the_metrics_evaluation_returned(run_loop):
    with pytest.raises(ConfigError, match=r"'eval_f1'.*\['eval_accuracy', 'eval_loss'\]"):
        run_loop([es_plugin], sections={"early_stopping": {"metric": "f1"}})


def test_inert_without_its_section(run_loop):
    loop = run_loop([es_plugin, Scores(table(*[0.5] * 10))], **EVERY_STEP)
    assert loop.state.global_step == 10 and stopper(loop) is None
    assert loop.plugins.inactive["early_stopping"] == "no [early_stopping] section"


def test_two_loops_in_one_process_each_have_their_own_early_stopping(make_loop, tmp_path):
    """Bug 1 of the architecture issue: the entry point was one module-level object that
    remembered only the newest Loop, so building a second Loop silently switched off the
    first one's early stopping (it then trained every step)."""
    section = {"early_stopping": {"metric": "score", "patience": 1}}
    alone = make_loop(
        [es_plugin, Scores(table(0.5, 0.4, *[0.3] * 8))],
        sections=section,
        output_dir=tmp_path / "alone",
        **EVERY_STEP,
    )
    alone.train()
    first = make_loop(
        [es_plugin, Scores(table(0.5, 0.4, *[0.3] * 8))],
        sections=section,
        output_dir=tmp_path / "first",
        **EVERY_STEP,
    )
    second = make_loop(
        [es_plugin, Scores(table(*[0.1 * i for i in range(1, 11)]))],
        sections=section,
        output_dir=tmp_path / "second",
        **EVERY_STEP,
    )
    first.train()
    second.train()
    assert alone.state.global_step == 2
    assert first.state.global_step == 2 and stopper(first).stopped_at == 2
    assert second.state.global_step == 10 and stopper(second).stopped_at is None
    assert stopper(first) is not stopper(second)
