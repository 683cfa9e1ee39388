"""corelooper-optuna: `corelooper hpo` (the real CLI in a subprocess) on a tiny task; real Optuna
studies in SQLite; trials train for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corelooper.config import tomllib

HERE = Path(__file__).parent

CONFIG = """
[model]
factory = "{here}/task.py:model"
[data]
train = "{here}/task.py:train_set"
eval = "{here}/task.py:eval_set"
[train]
output_dir = "{out}"
max_steps = 8
per_device_train_batch_size = 16
per_device_eval_batch_size = 48
eval_strategy = "steps"
eval_steps = 4
logging_steps = 4
save_strategy = "no"
disable_tqdm = true
learning_rate = 0.01
[plugins]
enable = ["optuna"]
[optuna]
sampler = "random"
seed = 7
{extra}
[optuna.space]
{space}
"""
SPACE = """"train.learning_rate" = { low = 1e-4, high = 0.3, log = true }
"model.args.hidden" = [8, 32]"""


def write_config(tmp_path, extra: str = "", space: str = SPACE) -> Path:
    cfg = tmp_path / "hpo.toml"
    cfg.write_text(CONFIG.format(here=HERE, out=tmp_path / "study", extra=extra, space=space))
    return cfg


def hpo(*args, cwd):
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    env.pop("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", None)
    return subprocess.run(
        [sys.executable, "-m", "corelooper", "hpo", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def last_eval(run_dir: Path, key: str) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if r["event"] == "eval"][-1]


@pytest.mark.slow
def test_three_trials_best_config_and_metric_reported_and_study_resumes(tmp_path):
    import optuna

    cfg = write_config(tmp_path)
    proc = hpo(str(cfg), "--trials", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study_dir = tmp_path / "study"
    best = json.loads((study_dir / "best_trial.json").read_text())

    # the study is in SQLite, with 3 complete trials, each trained in its own folder
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{study_dir / 'optuna.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    values = {}
    for t in study.trials:
        trial_dir = study_dir / f"trial-{t.number}"
        trained = tomllib.loads((trial_dir / "config.toml").read_text())
        assert trained["train"]["learning_rate"] == pytest.approx(t.params["train.learning_rate"])
        assert trained["model"]["args"]["hidden"] == t.params["model.args.hidden"]
        assert t.value == pytest.approx(last_eval(trial_dir, "eval_loss"))  # the trial's own last eval
        values[t.number] = t.value
    assert len(set(values.values())) == 3  # three different configs, three different results

    # the reported best is the lowest eval_loss, with its params, folder and config
    number = min(values, key=values.get)
    assert best["number"] == number and best["value"] == pytest.approx(values[number])
    assert best["metric"] == "eval_loss" and best["direction"] == "minimize"
    assert best["params"] == study.trials[number].params
    assert Path(best["config"]) == study_dir / f"trial-{number}" / "config.toml"
    assert f"best trial {number}: eval_loss = {values[number]:.6g}" in proc.stdout
    assert proc.stdout.count("complete") == 3  # the table lists every trial

    # resume: --trials counts finished trials, so 4 runs one more
    proc = hpo(str(cfg), "--trials", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming study 'study': 3 trials done, 1 to run" in proc.stdout
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{study_dir / 'optuna.db'}")
    assert len(study.trials) == 4 and (study_dir / "trial-3" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_a_bad_trial_is_pruned_at_its_first_evaluation(tmp_path):
    """Trial 0 learns (lr 0.05); trial 1 cannot (lr 0): at step 4 its eval_loss is above the
    median of trial 0's, so the median pruner stops it there."""
    extra = (
        'pruner = "median"\nn_startup_trials = 1\n'
        'enqueue = [{ "train.learning_rate" = 0.05 }, { "train.learning_rate" = 0.0 }]'
    )
    cfg = write_config(tmp_path, extra=extra, space='"train.learning_rate" = [0.05, 0.0]')
    proc = hpo(str(cfg), "--trials", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trial 1: pruned at step 4" in proc.stdout
    rows = [
        json.loads(line)
        for line in (tmp_path / "study" / "trial-1" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["event"] == "eval"] == [4]  # it stopped after that evaluation
    best = json.loads((tmp_path / "study" / "best_trial.json").read_text())
    assert best["number"] == 0 and best["params"] == {"train.learning_rate": 0.05}


def test_space_errors_name_the_key_before_any_trial(tmp_path):
    from corelooper_optuna.search import run_study

    from corelooper.config import Config
    from corelooper.errors import ConfigError

    for space, message in [
        ('"learning_rate" = [0.1]', "optuna.space: 'learning_rate' must be a config path"),
        ('"train.learning_rate" = { low = 0.0, high = 0.1, log = true }', "low > 0 with log = true"),
        ('"train.learning_rat" = [0.1]', "Unknown key train.learning_rat"),
    ]:
        with pytest.raises(ConfigError, match=message):
            run_study(Config.load(write_config(tmp_path, space=space)), trials=1, echo=lambda _: None)
    assert not (tmp_path / "study" / "trial-0").exists()


def test_inert_in_a_normal_run(tmp_path, make_loop):
    """Installed, the plugin only declares [optuna]: a run with the section trains as without it."""
    from corelooper_optuna import DEFAULTS

    loop = make_loop(
        autoload=True,
        save_strategy="no",
        sections={"plugins": {"enable": ["optuna"]}, "optuna": {"space": {"train.learning_rate": [0.1]}}},
    )
    loop.train()
    assert loop.config.section("optuna")["n_trials"] == DEFAULTS["n_trials"]
    assert loop.state.global_step == 8
