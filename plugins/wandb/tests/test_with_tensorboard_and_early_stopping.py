"""Three first-party plugin packages installed together (corelooper-wandb, -tensorboard and
-early-stopping), on the digits example through the real CLI: each writes what it should, in a
2-process run from the main process only, and every rank stops together; disabling one (by config
or by -p no:) leaves the others working."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

PLUGINS = {
    "tensorboard": "corelooper-tensorboard",
    "wandb": "corelooper-wandb",
    "early_stopping": "corelooper-early-stopping",
}
CONFIG = "examples/digits/config.toml"  # from REPO
# 3 epochs of 6 steps (batch 256), evaluated after each; no accuracy can beat another by more than
# 1.0, so early stopping (patience 1) ends training after the 2nd evaluation, at step 12.
SETTINGS = [
    "train.num_train_epochs=3",
    "train.per_device_train_batch_size=256",
    "train.logging_steps=2",
    "early_stopping.patience=1",
    "early_stopping.threshold=1.0",
    "wandb.project=digits-it",
    'wandb.tags=["integration"]',
]


def run_cli(*args: str, env: dict, timeout: float):
    """The real ``corelooper`` CLI in a subprocess, from the repository's root."""
    return subprocess.run(
        [sys.executable, "-m", "corelooper", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": "0", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module", autouse=True)
def all_installed():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="corelooper")}
    missing = [dist for name, dist in PLUGINS.items() if name not in eps]
    assert not missing, f"not installed: {missing}; run scripts/setup (pip install -e plugins/NAME)"


@pytest.fixture
def env(tmp_path):
    wandb = tmp_path / "wandb"
    for sub in ("runs", "cache", "config", "data"):
        (wandb / sub).mkdir(parents=True)
    (tmp_path / "tmp").mkdir()
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(wandb / "runs"),
        "WANDB_CACHE_DIR": str(wandb / "cache"),
        "WANDB_CONFIG_DIR": str(wandb / "config"),
        "WANDB_DATA_DIR": str(wandb / "data"),
        "TMPDIR": str(tmp_path / "tmp"),
        "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "",
    }


def digits(out: Path, env: dict, *extra: str, settings=SETTINGS, in_process: bool = False) -> list[dict]:
    """``corelooper run`` on digits: as a subprocess, or (to save start-up time) the same typer app
    called in this process, with the same arguments and environment."""
    args = ["run", CONFIG, "--set", f"train.output_dir={out}"]
    for item in settings:
        args += ["--set", item]
    if in_process:
        import wandb
        from corelooper.cli.app import app
        from typer.testing import CliRunner

        result = CliRunner().invoke(app, [*args, *extra], env=env)
        wandb.teardown()  # the offline run file is complete once W&B's service has stopped
        assert result.exit_code == 0, result.output[-3000:]
    else:
        proc = run_cli(*args, *extra, env=env, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def wandb_runs(env: dict):
    from corelooper_wandb.offline import find_runs, read_run

    return [read_run(p) for p in find_runs(env["WANDB_DIR"])]


def check_tensorboard(out: Path, records: list[dict]) -> None:
    got = tensorboard_scalars(out / "tensorboard")
    logs = [r for r in records if r["event"] == "log" and "loss" in r]
    evals = [r for r in records if r["event"] == "eval"]
    assert got["train/loss"] == pytest.approx({r["step"]: r["loss"] for r in logs}, rel=1e-6)
    assert got["train/learning_rate"] == pytest.approx(
        {r["step"]: r["learning_rate"] for r in logs}, rel=1e-6
    )
    assert got["eval/accuracy"] == pytest.approx({r["step"]: r["eval_accuracy"] for r in evals}, rel=1e-6)


def check_wandb(out: Path, records: list[dict], env: dict) -> None:
    (run,) = wandb_runs(env)
    assert run.project == "digits-it" and run.tags == ["integration"] and run.exit_code == 0
    evals = {r["step"]: r["eval_accuracy"] for r in records if r["event"] == "eval"}
    got = {row["train/global_step"]: row["eval/accuracy"] for row in run.history if "eval/accuracy" in row}
    assert got == evals
    assert run.config["train"]["learning_rate"] == 3e-3
    (last,) = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1:]
    assert json.loads((last / "plugins.json").read_text())["wandb"]["run_id"] == run.run_id


def check_early_stopped(records: list[dict], at_step: int) -> None:
    evals = [r["step"] for r in records if r["event"] == "eval"]
    assert evals == [at_step // 2, at_step], evals  # stopped after its 2nd evaluation, not 3
    assert records[-1]["step"] == at_step


@pytest.mark.slow
def test_disabling_one_by_config_or_by_p_no_leaves_the_others_working(tmp_path, env, monkeypatch):
    monkeypatch.chdir(REPO)  # the config's local plugin: examples.digits
    # [plugins] disable = ["wandb"]: no W&B run; TensorBoard and early stopping unaffected
    out = tmp_path / "no-wandb"
    records = digits(out, env, settings=[*SETTINGS, 'plugins.disable=["wandb"]'], in_process=True)
    assert wandb_runs(env) == []
    check_early_stopped(records, at_step=12)
    check_tensorboard(out, records)

    # -p no:tensorboard: no event files; W&B and early stopping unaffected
    out = tmp_path / "no-tb"
    records = digits(out, env, "-p", "no:tensorboard", in_process=True)
    assert not (out / "tensorboard").exists()
    check_early_stopped(records, at_step=12)
    check_wandb(out, records, env)


@pytest.mark.slow
@pytest.mark.distributed
def test_all_installed_two_processes_each_writes_what_it_should_from_the_main_process_only(tmp_path, env):
    # global batch 2 x 256: 3 steps per epoch, early stopping after the 2nd evaluation (step 6)
    out = tmp_path / "ddp"
    records = digits(out, env, "--nproc", "2")
    check_early_stopped(records, at_step=6)  # a rank that did not stop would hang or train on
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 only
    check_tensorboard(out, records)
    check_wandb(out, records, env)  # exactly one W&B run
    state = json.loads((out / "checkpoint-6" / "plugins.json").read_text())
    first_eval = next(r for r in records if r["event"] == "eval")
    assert state["early_stopping"] == {"best": first_eval["eval_accuracy"], "bad_evals": 1}


@pytest.mark.slow
def test_two_loops_in_one_process_each_behave_as_if_alone(tmp_path, env, monkeypatch):
    """The architecture issue's bug 1: plugin objects were shared by every Loop of a process,
    so a second Loop switched the first one's early stopping off. Now each Loop gets its own
    early stopping, TensorBoard writer and W&B run: built together and trained one after the
    other (and the first evaluated again after the second trained), each writes what it writes
    alone."""
    import wandb

    from corelooper import Loop
    from corelooper.config import Config

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO)

    def build(name: str, patience: int) -> Loop:
        cfg = Config.load(
            REPO / CONFIG,
            [
                f"train.output_dir={tmp_path / name}",
                "train.num_train_epochs=3",
                "train.per_device_train_batch_size=256",
                "train.logging_steps=2",
                f"early_stopping.patience={patience}",
                "early_stopping.threshold=1.0",
                f"wandb.project={name}",
                "train.disable_tqdm=true",
            ],
        )
        return Loop(config=cfg, blocked_plugins=["doctor"])  # its timings differ run to run

    def outputs(loop: Loop) -> tuple:
        out = Path(loop.args.output_dir)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        keep = [{k: v for k, v in r.items() if "runtime" not in k and "per_second" not in k} for r in records]
        tb = tensorboard_scalars(out / "tensorboard")
        return keep, {k: v for k, v in tb.items() if "per_second" not in k and "runtime" not in k}

    alone_a = build("alone_a", 1)
    alone_a.train()
    alone_b = build("alone_b", 5)
    alone_b.train()
    first, second = build("first", 1), build("second", 5)  # both built before either trains
    first.train()
    second.train()
    wandb.teardown()

    assert first.state.global_step == alone_a.state.global_step == 12  # patience 1: early stop
    assert second.state.global_step == alone_b.state.global_step == 18  # patience 5: all 3 epochs
    assert first.plugins.get("early_stopping.run") is not second.plugins.get("early_stopping.run")
    assert first.plugins.get("tensorboard.run") is not second.plugins.get("tensorboard.run")
    assert outputs(first) == outputs(alone_a)
    assert outputs(second) == outputs(alone_b)
    runs = {run.project: run for run in wandb_runs(env)}
    assert sorted(runs) == ["alone_a", "alone_b", "first", "second"]
    for mine, alone in (("first", "alone_a"), ("second", "alone_b")):
        losses = [(r["train/global_step"], r["train/loss"]) for r in runs[mine].history if "train/loss" in r]
        assert losses == [
            (r["train/global_step"], r["train/loss"]) for r in runs[alone].history if "train/loss" in r
        ]
        assert runs[mine].run_id != runs[alone].run_id
