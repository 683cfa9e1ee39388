"""corelooper-tensorboard: real event files, read back with TensorBoard's EventAccumulator and
compared value by value with what corelooper's metrics.jsonl recorded."""

from __future__ import annotations

import json
from pathlib import Path

import corelooper_tensorboard as tb_plugin
import pytest
from corelooper_tensorboard import tag
from corelooper_testing import SigtermAt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2


def read_events(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalar_values(acc: EventAccumulator) -> dict[str, dict[int, float]]:
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def jsonl(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def assert_matches_jsonl(acc: EventAccumulator, records: list[dict]) -> int:
    """Every numeric value of every record is in TensorBoard at its step; returns how many."""
    got = scalar_values(acc)
    checked = 0
    for record in records:
        for key, value in record.items():
            if key in ("event", "step") or not isinstance(value, (int, float)):
                continue
            assert got[tag(key)][record["step"]] == pytest.approx(value, rel=1e-6, abs=1e-7), (key, record)
            checked += 1
    return checked


def test_scalars_hparams_and_config_match_metrics_jsonl(run_loop, tmp_path):
    loop = run_loop([tb_plugin])
    out = Path(loop.args.output_dir)
    acc = read_events(out / "tensorboard")
    got = scalar_values(acc)

    for name in (
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "train/samples_per_second",
        "train/epoch",
        "eval/loss",
        "eval/accuracy",
        "train/train_runtime",
        "train/train_loss",
    ):
        assert name in got, sorted(got)
    assert sorted(got["train/loss"]) == [2, 4, 6, 8]  # logging_steps = 2, max_steps = 8
    assert sorted(got["eval/accuracy"]) == [4, 8]  # eval_steps = 4
    records = jsonl(out)
    assert assert_matches_jsonl(acc, records) >= 4 * 5 + 2 * 2 + 4
    # ... and the loop's own history agrees
    assert got["eval/loss"][8] == pytest.approx(loop.state.log_history[-2]["eval_loss"], rel=1e-6)

    # the resolved config, as text and as hparams, in the same run
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "learning_rate = 0.05" in text and "[train]" in text
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert start.hparams["train.learning_rate"].number_value == pytest.approx(0.05)
    assert start.hparams["train.lr_scheduler_type"].string_value == "constant"
    assert start.hparams["train.max_steps"].number_value == 8


def test_log_dir_from_config_and_disabled_by_config(run_loop, tmp_path):
    tb_dir = tmp_path / "tb-here"
    loop = run_loop(
        [tb_plugin], sections={"tensorboard": {"log_dir": str(tb_dir)}}, output_dir=tmp_path / "a"
    )
    assert not (Path(loop.args.output_dir) / "tensorboard").exists()
    assert sorted(scalar_values(read_events(tb_dir))["train/loss"]) == [2, 4, 6, 8]

    loop = run_loop([tb_plugin], sections={"tensorboard": {"enabled": False}}, output_dir=tmp_path / "b")
    assert (Path(loop.args.output_dir) / "metrics.jsonl").exists()
    assert not (Path(loop.args.output_dir) / "tensorboard").exists()
    assert loop.plugins.inactive["tensorboard"] == "[tensorboard] enabled = false"


def test_unknown_key_is_rejected_with_a_hint(make_loop):
    from corelooper.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tensorboard\.logdir.*Did you mean 'log_dir'"):
        make_loop([tb_plugin], sections={"tensorboard": {"logdir": "x"}})


def test_preempted_run_is_flushed_and_a_resume_continues_the_curves(run_loop, tmp_path):
    out = tmp_path / "run"
    # SIGTERM at step 6: the writer is flushed and closed by on_train_end (state.preempted)
    run_loop([tb_plugin, SigtermAt(at_step=6)], output_dir=out)
    first = scalar_values(read_events(out / "tensorboard"))
    assert sorted(first["train/loss"]) == [2, 4, 6]
    lost = first["train/loss"][6]

    # resumed from the older checkpoint-4 (as after a crash): the first attempt's step 6 is
    # purged, steps 6 and 8 are new
    run_loop([tb_plugin], output_dir=out, resume=str(out / "checkpoint-4"))
    acc = read_events(out / "tensorboard")
    got = scalar_values(acc)
    assert sorted(got["train/loss"]) == [2, 4, 6, 8]
    assert sorted(got["eval/loss"]) == [4, 8]
    resumed = [r for r in jsonl(out) if r["event"] == "log" and r["step"] == 6][-1]
    assert got["train/loss"][6] == pytest.approx(resumed["loss"], rel=1e-6)
    assert got["train/loss"][2] == first["train/loss"][2]
    assert lost == pytest.approx(resumed["loss"], rel=1e-4)  # same data order and RNG after resume


def test_evaluate_outside_training_is_written_at_once(make_loop, tmp_path):
    loop = make_loop([tb_plugin], eval_strategy="no")
    loop.evaluate()
    got = scalar_values(read_events(Path(loop.args.output_dir) / "tensorboard"))
    # the eval log carries the epoch, as HF's log() adds it (rewrite_logs files it under train/);
    # no num_input_tokens_seen: this data has no input_ids, there are no tokens to count
    assert set(got) == {"eval/loss", "eval/accuracy", "train/epoch"}
    assert list(got["eval/loss"]) == [0]


def test_one_event_file_for_training_and_later_evaluations_closed_when_the_loop_ends(make_loop):
    """Flushed at the end of train() and of each evaluation, closed by corelooper_unconfigure
    (before: train() closed its file and an evaluate() after it opened a second one, flushed
    after every write and never closed)."""
    loop = make_loop([tb_plugin])
    log_dir = Path(loop.args.output_dir) / "tensorboard"
    loop.train()
    logger = loop.plugins.get("tensorboard.run")
    assert logger.writer is not None  # open until the Loop ends
    assert sorted(scalar_values(read_events(log_dir))["train/loss"]) == [2, 4, 6, 8]  # flushed
    loop.evaluate()
    assert [e.step for e in read_events(log_dir).Scalars("eval/accuracy")] == [4, 8, 8]  # flushed
    loop.close()
    assert logger.writer is None
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1
    records = [r for r in jsonl(Path(loop.args.output_dir)) if r["event"] == "eval"]
    assert [e.value for e in read_events(log_dir).Scalars("eval/accuracy")] == pytest.approx(
        [r["eval_accuracy"] for r in records], rel=1e-6
    )
