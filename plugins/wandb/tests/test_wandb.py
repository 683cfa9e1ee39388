"""corelooper-wandb: real offline W&B runs (WANDB_MODE=offline, nothing leaves the machine), read
back from the run files and compared with what corelooper's metrics.jsonl recorded."""

from __future__ import annotations

import json
from pathlib import Path

import corelooper_wandb as wb_plugin
import pytest
from corelooper_testing import SigtermAt
from corelooper_wandb.offline import find_runs as _find_runs
from corelooper_wandb.offline import read_run

from corelooper.errors import PluginError


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Offline W&B with every folder it writes under tmp_path."""
    import wandb

    wandb.teardown()  # W&B keeps its settings (an earlier test's online mode) until torn down
    root = tmp_path / "wandb-home"
    for var, sub in (
        ("WANDB_DIR", "runs"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
    ):
        (root / sub).mkdir(parents=True)
        monkeypatch.setenv(var, str(root / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    return root / "runs"


def find_runs(wandb_dir: Path) -> list[Path]:
    """The run files, once W&B's service has written them: ``run.finish()`` returns before its
    background process has flushed the ``.wandb`` file; ``wandb.teardown()`` waits for that."""
    import wandb

    wandb.teardown()
    return _find_runs(wandb_dir)


def jsonl(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def rows_by_step(history: list[dict], key: str) -> dict[int, float]:
    return {row["train/global_step"]: row[key] for row in history if key in row}


@pytest.mark.slow
def test_offline_run_holds_config_metrics_by_step_and_summary(run_loop, wandb_env):
    section = {"project": "digits", "name": "first", "tags": ["cpu", "tiny"]}
    loop = run_loop([wb_plugin], sections={"wandb": section})
    out = Path(loop.args.output_dir)
    (path,) = find_runs(wandb_env)
    run = read_run(path)

    assert (run.project, run.name, run.tags) == ("digits", "first", ["cpu", "tiny"])
    assert run.config["train"]["learning_rate"] == 0.05 and run.config["wandb"]["project"] == "digits"
    assert run.config["model/num_parameters"] == 8 * 16 + 16 + 16 * 3 + 3
    records = jsonl(out)
    for name, key in (
        ("loss", "train/loss"),
        ("learning_rate", "train/learning_rate"),
        ("grad_norm", "train/grad_norm"),
        ("samples_per_second", "train/samples_per_second"),
    ):
        expected = {r["step"]: r[name] for r in records if r["event"] == "log" and name in r}
        assert rows_by_step(run.history, key) == pytest.approx(expected, rel=1e-9), key
    evals = {r["step"]: r["eval_accuracy"] for r in records if r["event"] == "eval"}
    assert rows_by_step(run.history, "eval/accuracy") == evals and sorted(evals) == [4, 8]
    final = records[-1]
    assert run.summary["train_runtime"] == final["train_runtime"]
    assert run.summary["train_loss"] == pytest.approx(final["train_loss"])
    assert run.summary["global_step"] == 8 and run.summary["preempted"] is False
    assert run.exit_code == 0 and not run.preempting
    # the run id is stored in every checkpoint, for resuming
    saved = json.loads((out / "checkpoint-8" / "plugins.json").read_text())
    assert saved["wandb"] == {"run_id": run.run_id}


def test_preempted_run_is_finished_and_resume_continues_the_same_run(run_loop, wandb_env, tmp_path):
    out = tmp_path / "run"
    run_loop([wb_plugin, SigtermAt(at_step=6)], output_dir=out, sections={"wandb": {}})
    (first_path,) = find_runs(wandb_env)
    first = read_run(first_path)
    assert first.preempting and first.exit_code == 0 and first.summary["preempted"] is True
    assert sorted(rows_by_step(first.history, "train/loss")) == [2, 4, 6]

    run_loop([wb_plugin], output_dir=out, sections={"wandb": {}}, resume=str(out / "checkpoint-4"))
    runs = [read_run(p) for p in find_runs(wandb_env)]
    resumed = [r for r in runs if sorted(rows_by_step(r.history, "train/loss")) == [6, 8]]
    assert len(resumed) == 1, [r.history for r in runs]
    assert resumed[0].run_id == first.run_id
    assert resumed[0].summary["global_step"] == 8 and resumed[0].exit_code == 0
    assert json.loads((out / "checkpoint-8" / "plugins.json").read_text())["wandb"]["run_id"] == first.run_id


def test_exception_finishes_the_run_as_failed(run_loop, wandb_env, tmp_path):
    class Boom:
        name = "boom"

        def on_step_end(self, state):
            if state.global_step == 3:
                raise RuntimeError("boom")

    with pytest.raises(PluginError, match="'boom' raised in hook 'on_step_end'"):
        run_loop([wb_plugin, Boom()], sections={"wandb": {}})
    (path,) = find_runs(wandb_env)
    run = read_run(path)
    assert run.exit_code == 1
    assert sorted(rows_by_step(run.history, "train/loss")) == [2]


def test_inactive_unless_configured_and_honours_wandb_mode_disabled(
    run_loop, wandb_env, monkeypatch, tmp_path
):
    from corelooper.config import Config

    monkeypatch.delenv("WANDB_MODE")
    assert "no [wandb] section" in wb_plugin.inactive_reason(Config())
    run_loop([wb_plugin], output_dir=tmp_path / "a")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert "disabled" in wb_plugin.inactive_reason(Config.from_dict({"wandb": {}}))
    run_loop([wb_plugin], sections={"wandb": {"project": "x"}}, output_dir=tmp_path / "b")
    monkeypatch.delenv("WANDB_MODE")
    assert (
        wb_plugin.inactive_reason(Config.from_dict({"wandb": {"enabled": False}}))
        == "[wandb] enabled = false"
    )
    assert find_runs(wandb_env) == [] and not (tmp_path / "a" / "wandb").exists()
    # WANDB_PROJECT alone switches it on (as with HF's report_to), WANDB_MODE from the env is honoured
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_loop([wb_plugin], output_dir=tmp_path / "c")
    (path,) = find_runs(wandb_env)
    assert read_run(path).project == "from-env"


def test_online_without_credentials_is_one_clear_error(run_loop, wandb_env, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no stored login either
    with pytest.raises(PluginError, match=r"wandb.init failed: .*API key.*WANDB_MODE=offline.*-p no:wandb"):
        run_loop([wb_plugin], sections={"wandb": {}})
    assert not (tmp_path / "run" / "checkpoint-4").exists()


def test_one_run_lives_until_the_loop_ends(make_loop, wandb_env):
    """An evaluate() after train() logs into the open run, which corelooper_unconfigure finishes
    (before: train() finished it and the evaluation reopened it: a second run file)."""
    loop = make_loop([wb_plugin], sections={"wandb": {}})
    loop.train()
    logger = loop.plugins.get("wandb.run")
    assert logger.run is not None
    metrics = loop.evaluate()
    loop.close()
    assert logger.run is None
    (path,) = find_runs(wandb_env)
    run = read_run(path)
    assert run.exit_code == 0 and run.summary["global_step"] == 8
    evals = [row["eval/accuracy"] for row in run.history if "eval/accuracy" in row]
    assert len(evals) == 3 and evals[-1] == pytest.approx(metrics["eval_accuracy"])
