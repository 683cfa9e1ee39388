"""corelooper-hf's ``train.report_to`` for every Hugging Face integration and ``[hf] callbacks``:
real ``corelooper run`` subprocesses report to a real MLflow file store and to DVCLive's files,
read back (``MlflowClient``, DVCLive's ``metrics.json`` and plots) and compared value by value
with the run's ``metrics.jsonl``; callbacks named in the config steer the run; a missing library
is one paragraph."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import corelooper_hf
import pytest
from corelooper_hf import reporting

from corelooper.config import Config
from corelooper.errors import ConfigError
from corelooper.plugins import load_plugins

# corelooper's per-window throughput: in metrics.jsonl, not in HF's logs (the bridge leaves it out)
NOT_IN_HF_LOGS = {"samples_per_second", "tokens_per_second", "skipped_steps"}

CONFIG = """
[model]
factory = "corelooper_testing:tiny_model"
[data]
train = "corelooper_testing:tiny_train_set"
eval = "corelooper_testing:tiny_eval_set"
[train]
output_dir = "run"
run_name = "tiny"
max_steps = 8
per_device_train_batch_size = 8
learning_rate = 0.05
logging_steps = 2
eval_strategy = "{eval_strategy}"
eval_steps = 4
save_strategy = "steps"
save_steps = 4
report_to = {report_to}
"""

STOPPER = """
from transformers import TrainerCallback


class StopAt(TrainerCallback):
    def __init__(self, step=3):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


STOP_AT_2 = StopAt(2)


class FailAt3(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise RuntimeError("the callback failed at step 3")
"""


def write_project(
    tmp_path: Path, report_to: list[str], eval_strategy: str = "steps", extra: str = ""
) -> Path:
    config = CONFIG.format(report_to=json.dumps(report_to), eval_strategy=eval_strategy) + extra
    (tmp_path / "config.toml").write_text(config)
    (tmp_path / "stopper.py").write_text(STOPPER)
    return tmp_path / "config.toml"


def run_cli(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real ``corelooper run`` in ``tmp_path`` (DVCLive writes ``dvclive/`` in the current
    folder, MLflow to the file store under ``tmp_path``)."""
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 prefers a database; the file store is a real one
        "DVC_NO_ANALYTICS": "1",
        "DO_NOT_TRACK": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }
    return subprocess.run(
        [sys.executable, "-m", "corelooper", "run", "config.toml", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def jsonl(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def logged_values(records: list[dict]) -> dict[str, Counter]:
    """Each numeric key of metrics.jsonl -> the (step, value) pairs logged, as HF's logs carry them."""
    out: dict[str, Counter] = {}
    for record in records:
        for key, value in record.items():
            if key in ("event", "step") or key in NOT_IN_HF_LOGS or not isinstance(value, (int, float)):
                continue
            out.setdefault(key, Counter())[(record["step"], float(value))] += 1
    return out


def mlflow_runs(tmp_path: Path, monkeypatch) -> tuple:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return client, runs


def mlflow_values(client, run) -> dict[str, Counter]:
    return {
        key: Counter((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }


# -- the names ---------------------------------------------------------------------------------------


def test_report_to_names_are_hf_integrations_less_those_corelooper_plugins_answer():
    from corelooper_tensorboard import corelooper_settings as tensorboard_settings
    from corelooper_wandb import corelooper_settings as wandb_settings
    from transformers.integrations import INTEGRATION_TO_CALLBACK

    assert set(reporting.corelooper_settings()["report_to"]) == set(INTEGRATION_TO_CALLBACK) - {
        "tensorboard",
        "wandb",
    }
    for name, (callback, _, _) in reporting.INTEGRATIONS.items():
        assert INTEGRATION_TO_CALLBACK[name].__name__ == callback
    # the two left out are declared by the plugins that own them
    assert set(reporting.OWNED_BY_PLUGINS) == {
        *tensorboard_settings()["report_to"],
        *wandb_settings()["report_to"],
    }


def test_reading_the_names_imports_neither_transformers_nor_torch():
    code = (
        "import sys\nfrom corelooper_hf import reporting\n"
        "assert 'mlflow' in reporting.corelooper_settings()['report_to']\n"
        "print(sorted(m for m in ('transformers', 'torch', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def config_with(report_to, sections=None, **train) -> Config:
    return Config.from_dict(
        {"train": {"output_dir": "unused", "report_to": report_to, **train}, **(sections or {})}
    )


def test_report_to_all_runs_no_hf_integration_and_a_named_one_runs_through_the_bridge():
    # "all" (corelooper's default): corelooper's loggers; an HF integration only when named
    plugins = load_plugins(config_with("all"), autoload=True)
    assert plugins.get(reporting.BRIDGE) is None
    assert "names no Hugging Face integration" in plugins.inactive[reporting.ENTRY_POINT]

    pytest.importorskip("mlflow")
    plugins = load_plugins(config_with(["mlflow"]), autoload=True)
    bridge = plugins.get(reporting.BRIDGE)
    assert [type(cb).__name__ for cb in bridge.handler.callbacks] == ["MLflowCallback"]
    # [hf] callbacks come after the integrations, in the same bridge (HF's order)
    early = {"callbacks": ["transformers:EarlyStoppingCallback"]}
    plugins = load_plugins(config_with(["mlflow"], {"hf": early}), autoload=True)
    names = [type(cb).__name__ for cb in plugins.get(reporting.BRIDGE).handler.callbacks]
    assert names == ["MLflowCallback", "EarlyStoppingCallback"]
    assert (
        "tensorboard" not in plugins.info and "hf_integrations" in plugins.info
    )  # report_to names no tensorboard

    # -p no:hf_integrations: nobody answers report_to's HF names this run, and the run is refused
    with pytest.raises(ConfigError, match=r"train\.report_to names \['mlflow'\]"):
        load_plugins(config_with(["mlflow"]), blocked=["hf_integrations"], autoload=True)


def test_training_arguments_describe_the_run_and_set_up_no_device():
    from accelerate.state import PartialState
    from corelooper_hf.callbacks import training_arguments

    config = config_with(["mlflow"], run_name="r1", seed=7, logging_steps=3, learning_rate=0.01, tf32=True)
    before = dict(PartialState._shared_state)
    args = training_arguments(config)
    assert (args.output_dir, args.run_name, args.seed, args.logging_steps) == ("unused", "r1", 7, 3)
    assert args.learning_rate == 0.01 and args.report_to == []
    assert args.tf32 is None  # HF refuses tf32 without an Ampere GPU: left at HF's default
    assert str(args.device) in ("cpu", "cuda:0") and args.world_size == 1
    assert PartialState._shared_state == before  # HF's would reset accelerate's state and make its own


# -- [hf] callbacks ------------------------------------------------------------------------------------


def test_early_stopping_from_the_config_counts_evaluations_as_hf(run_loop):
    """HF's EarlyStoppingCallback with args: the first evaluation sets the best, two that do not
    improve by the threshold stop the run (evaluations at steps 2, 4, 6: stopped at 6)."""
    early = {
        "ref": "transformers:EarlyStoppingCallback",
        "args": {"early_stopping_patience": 2, "early_stopping_threshold": 100.0},
    }
    loop = run_loop(
        [corelooper_hf],
        sections={"hf": {"callbacks": [early]}},
        max_steps=20,
        eval_steps=2,
        save_steps=2,
        metric_for_best_model="accuracy",
    )
    assert loop.state.global_step == 6
    (callback,) = loop.plugins.get(reporting.BRIDGE).handler.callbacks
    assert callback.early_stopping_patience_counter == 2


def test_a_callback_object_named_in_the_config_stops_the_run(run_loop, tmp_path, monkeypatch):
    (tmp_path / "stopper.py").write_text(STOPPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    loop = run_loop([corelooper_hf], sections={"hf": {"callbacks": ["stopper:STOP_AT_2"]}})
    assert loop.state.global_step == 2


def test_the_readme_table_names_every_report_to_and_what_to_install():
    readme = (Path(corelooper_hf.__file__).parents[1] / "README.md").read_text()
    table = readme.split("<!-- report_to table")[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[3:]:
        name, runs_as, install = (cell.strip() for cell in line.strip("|").split("|"))
        rows[name.strip("`")] = (runs_as, install)
    assert set(rows) == set(reporting.INTEGRATIONS) | set(reporting.OWNED_BY_PLUGINS)
    for name, (callback, _, pip) in reporting.INTEGRATIONS.items():
        assert rows[name][0] == f"HF's `{callback}` through corelooper-hf"
        assert pip == "" or rows[name][1].startswith(f"`{pip}`")
    for name, package in reporting.OWNED_BY_PLUGINS.items():
        assert rows[name] == (f"corelooper plugin {package}", f"`{package}`")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("transformers:TrainerState", "not a transformers.TrainerCallback"),
        ({"ref": "transformers:EarlyStoppingCallback", "args": {"patience": 2}}, "unexpected keyword"),
        ({"ref": "transformers:EarlyStoppingCallback", "kwargs": {}}, 'expected "module:Class"'),
        ("transformers:NoSuchCallback", "has no attribute 'NoSuchCallback'"),
    ],
)
def test_a_wrong_callback_is_a_config_error_naming_it(make_loop, item, message):
    with pytest.raises(ConfigError, match=r"hf\.callbacks\[0\]") as e:
        make_loop([corelooper_hf], sections={"hf": {"callbacks": [item]}})
    assert message in str(e.value)


@pytest.mark.slow
def test_callbacks_from_the_config_steer_a_cli_run(tmp_path):
    early = '{ ref = "transformers:EarlyStoppingCallback", args = { early_stopping_patience = 50 } }'
    extra = f'metric_for_best_model = "loss"\n[hf]\ncallbacks = ["stopper:StopAt", {early}]\n'
    write_project(tmp_path, [], extra=extra)
    done = run_cli(tmp_path, "--set", "train.save_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    records = jsonl(tmp_path / "run")
    assert max(r["step"] for r in records) == 3  # StopAt stopped the run, as in HF
    state = json.loads((tmp_path / "run" / "loop_state.json").read_text())
    assert state["global_step"] == 3
    # EarlyStoppingCallback ran with its args: its state is in the checkpoint, in HF's format
    saved = json.loads((tmp_path / "run" / "checkpoint-3" / "plugins.json").read_text())["hf_callbacks"]
    assert saved["EarlyStoppingCallback"]["args"]["early_stopping_patience"] == 50


# -- real integrations ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_and_dvclive_run(tmp_path_factory):
    pytest.importorskip("mlflow")
    pytest.importorskip("dvclive")
    tmp_path = tmp_path_factory.mktemp("report_to")
    write_project(tmp_path, ["mlflow", "dvclive"])
    done = run_cli(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path, jsonl(tmp_path / "run")


@pytest.mark.slow
def test_mlflow_holds_the_metrics_of_metrics_jsonl(mlflow_and_dvclive_run, monkeypatch):
    tmp_path, records = mlflow_and_dvclive_run
    client, runs = mlflow_runs(tmp_path, monkeypatch)
    (run,) = runs
    got = mlflow_values(client, run)
    assert got == logged_values(records)  # every value at its step: loss, eval_loss, learning_rate, ...
    assert sorted(s for s, _ in got["loss"]) == [2, 4, 6, 8]
    assert sorted(s for s, _ in got["eval_loss"]) == [4, 8]
    assert {"learning_rate", "grad_norm", "epoch", "train_loss", "train_runtime"} <= set(got)
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert run.data.params["learning_rate"] == "0.05" and run.data.params["max_steps"] == "8"


@pytest.mark.slow
def test_dvclive_holds_the_metrics_of_metrics_jsonl(mlflow_and_dvclive_run):
    from dvclive.utils import standardize_metric_name

    tmp_path, records = mlflow_and_dvclive_run
    live = tmp_path / "dvclive"
    # HF's DVCLiveCallback: one DVCLive step per log (its own count), names as DVCLive's HF rules
    plots: dict[str, list] = {}
    for tsv in (live / "plots" / "metrics").rglob("*.tsv"):
        rows = [line.split("\t") for line in tsv.read_text().splitlines()[1:]]
        name = tsv.relative_to(live / "plots" / "metrics").with_suffix("").as_posix()
        plots[name] = [(int(step), float(value)) for step, value in rows]
    expected: dict[str, list] = {}
    for i, record in enumerate(records):
        for key, value in record.items():
            if key in ("event", "step") or key in NOT_IN_HF_LOGS:
                continue
            expected.setdefault(standardize_metric_name(key, "dvclive.huggingface"), []).append(
                (i, float(value))
            )
    assert plots == expected
    assert "eval/loss" in plots and "train/loss" in plots and "learning_rate" in plots
    summary = json.loads((live / "metrics.json").read_text())
    last_eval = [r for r in records if "eval_loss" in r][-1]
    assert summary["eval"]["loss"] == pytest.approx(last_eval["eval_loss"])
    assert summary["step"] == len(records) - 1


@pytest.mark.slow
def test_a_failed_run_ends_its_mlflow_run_as_failed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    write_project(tmp_path, ["mlflow"], extra='[hf]\ncallbacks = ["stopper:FailAt3"]\n')
    done = run_cli(tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "the callback failed at step 3" in done.stderr and "Traceback" not in done.stderr
    client, runs = mlflow_runs(tmp_path, monkeypatch)
    (run,) = runs
    assert run.info.status == "FAILED"  # ended when the Loop closed, the logs before it flushed
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2]


@pytest.mark.slow
def test_a_missing_library_is_one_paragraph_naming_the_package(tmp_path):
    if reporting._importable("comet_ml"):
        pytest.skip("comet_ml is installed here")
    write_project(tmp_path, ["comet_ml"])
    done = run_cli(tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        'corelooper: error: train.report_to names "comet_ml": Hugging Face\'s CometCallback reports it '
        "(run by corelooper-hf), and it needs comet_ml, which is not installed in this environment "
        f'({sys.executable}). Install it with `pip install comet-ml`, or remove "comet_ml" from train.report_to.'
    )
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_report_one_mlflow_run(tmp_path, monkeypatch):
    """Rank 0 reports: one MLflow run with one set of metrics, the evaluation that `corelooper run`
    makes after training (eval_strategy "no") included, in the same run."""
    pytest.importorskip("mlflow")
    # a callback from the config runs on every process: both stop after step 6 (one would hang)
    extra = '[hf]\ncallbacks = [{ ref = "stopper:StopAt", args = { step = 6 } }]\n'
    write_project(tmp_path, ["mlflow"], eval_strategy="no", extra=extra)
    done = run_cli(tmp_path, "--nproc", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    records = jsonl(tmp_path / "run")
    client, runs = mlflow_runs(tmp_path, monkeypatch)
    (run,) = runs
    got = mlflow_values(client, run)
    assert got == logged_values(records)
    assert sorted(s for s, _ in got["loss"]) == [2, 4, 6]  # each once: one rank logged
    assert list(got["eval_loss"]) == [(6, records[-1]["eval_loss"])]
    assert run.info.status == "FINISHED"
