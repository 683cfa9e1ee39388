"""IterableDataset training: sharding over processes x workers, epochs, exact resume."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corelooper.config import TrainArgs
from corelooper.errors import CheckpointError, DataError
from corelooper.loop import Loop

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from streams import Recorder, StatefulStream, Stream  # noqa: E402


@pytest.fixture(autouse=True)
def _no_autoload(monkeypatch):
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """2 processes (torchrun, gloo) x 2 dataloader workers; see tests/stream_worker.py."""
    out = tmp_path_factory.mktemp("stream")
    env = {**os.environ, "TMPDIR": str(out), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(TESTS / "stream_worker.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, [json.loads((out / f"result.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("kind", ["stateful", "stateless"])
def test_each_sample_seen_exactly_once_across_2_processes_x_2_workers(two_by_two, kind):
    _, ranks = two_by_two
    seen = [i for r in ranks for batch in r[kind]["first"] for i in batch]
    assert len(seen) == 64 and sorted(seen) == list(range(64))  # 16 steps x 2 ranks x 2 = one pass
    # each rank takes its own shards: rank 0 items with i % 4 in {0, 1}, rank 1 in {2, 3}
    assert {i % 4 for b in ranks[0][kind]["first"] for i in b} == {0, 1}
    assert {i % 4 for b in ranks[1][kind]["first"] for i in b} == {2, 3}


@pytest.mark.parametrize("kind", ["stateful", "stateless"])
def test_resume_continues_with_exactly_the_same_batches_and_weights(two_by_two, kind):
    """Checkpoint at step 5 (an odd number of batches per process: the next batch comes from the
    second worker), resumed in a fresh Loop: the same batches in the same order, same weights."""
    _, ranks = two_by_two
    for r in ranks:
        assert r[kind]["resumed"] == r[kind]["first"][5:]
        assert r[kind]["params_resumed"] == r[kind]["params_first"]


def test_checkpoint_holds_each_shards_position(two_by_two):
    out, _ = two_by_two
    state = json.loads((out / "stateful" / "checkpoint-5" / "data_state_0.json").read_text())
    assert state["num_shards"] == 4 and state["batches"] == 5
    # rank 0 consumed 3 batches of shard 0 (items 0,4 | 8,12 | 16,20) and 2 of shard 1 (1,5 | 9,13)
    assert state["shards"]["0"] == {"epoch": 0, "position": 21, "dataset": {"pos": 21}}
    assert state["shards"]["1"] == {"epoch": 0, "position": 14, "dataset": {"pos": 14}}
    assert json.loads((out / "stateless" / "checkpoint-5" / "data_state_1.json").read_text())["shards"]["2"][
        "dataset"] is None


def args(tmp_path, **kw) -> TrainArgs:
    base = dict(output_dir=str(tmp_path / "run"), max_steps=8, save_steps=3, per_device_train_batch_size=2,
                logging_steps=4, disable_tqdm=True)
    return TrainArgs(**{**base, **kw})


def test_stateful_resume_reads_nothing_twice(tmp_path):
    Loop(Recorder(), args(tmp_path), train_dataset=StatefulStream(64)).train()
    stream = StatefulStream(64)
    model = Recorder()
    Loop(model, args(tmp_path), train_dataset=stream).train(resume_from_checkpoint="latest")
    assert model.seen == []  # latest is checkpoint-8: nothing left to do
    Loop(model, args(tmp_path), train_dataset=stream).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert model.seen == [[6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert stream.reads == 10  # items 6..15 only: the position came from the dataset's state


def test_stateless_resume_rereads_with_a_warning_and_ignore_data_skip_restarts(tmp_path, caplog):
    Loop(Recorder(), args(tmp_path), train_dataset=Stream(64)).train()
    ckpt = str(tmp_path / "run" / "checkpoint-3")
    model = Recorder()
    with caplog.at_level(logging.WARNING, logger="corelooper.streaming"):
        Loop(model, args(tmp_path), train_dataset=Stream(64)).train(resume_from_checkpoint=ckpt)
    assert model.seen[0] == [6, 7]
    assert "Stream has no state_dict()/load_state_dict(): resuming re-reads" in caplog.text
    caplog.clear()
    model = Recorder()
    with caplog.at_level(logging.WARNING, logger="corelooper.streaming"):
        Loop(model, args(tmp_path, ignore_data_skip=True), train_dataset=Stream(64)).train(
            resume_from_checkpoint=ckpt)
    assert model.seen[0] == [0, 1]
    assert "ignore_data_skip = true: the training stream starts again from its beginning" in caplog.text


def test_stream_restarts_each_epoch_until_max_steps(tmp_path):
    class Epochs(Stream):
        epochs: list[int] = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    model = Recorder()
    ds = Epochs(10)
    Loop(model, args(tmp_path, max_steps=5, per_device_train_batch_size=4, save_strategy="no"),
         train_dataset=ds).train()
    assert model.seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert ds.epochs == [0, 1]


def test_other_geometry_on_resume_and_no_max_steps_are_clear_errors(tmp_path):
    Loop(Recorder(), args(tmp_path, dataloader_num_workers=2), train_dataset=StatefulStream(64)).train()
    with pytest.raises(CheckpointError, match="for 2 stream shards.*this run has 1.*ignore_data_skip"):
        Loop(Recorder(), args(tmp_path), train_dataset=StatefulStream(64)).train(resume_from_checkpoint="latest")
    with pytest.raises(DataError, match="max_steps"):
        Loop(Recorder(), args(tmp_path, max_steps=-1, output_dir=str(tmp_path / "b")),
             train_dataset=Stream(8)).train()


def test_evaluate_on_a_stream(tmp_path):
    """Evaluation reads the stream once (no cycling) and weights the loss by samples."""
    import torch

    model = Recorder()
    loop = Loop(model, args(tmp_path, per_device_eval_batch_size=5), eval_dataset=Stream(13))
    metrics = loop.evaluate()
    from streams import sample

    xs = torch.stack([sample(i)["x"] for i in range(13)])
    ys = torch.stack([sample(i)["labels"] for i in range(13)])
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model.net(xs), ys).item()
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-5)


def test_a_dataset_that_shards_itself_reads_only_its_part(tmp_path):
    """`shards_itself = True`: the dataset asks current_shard() and yields only its items; the
    loader does no skipping of its own. 2 workers: shards {even, odd} alternate batch by batch."""
    from corelooper.streaming import current_shard

    class OwnShards(Stream):
        shards_itself = True

        def __iter__(self):
            shard = current_shard()
            for i in range(shard.index, self.n, shard.count):
                yield sample(i)

    from streams import sample

    model = Recorder()
    Loop(model, args(tmp_path, max_steps=4, dataloader_num_workers=2, save_strategy="no"),
         train_dataset=OwnShards(16)).train()
    assert model.seen == [[0, 2], [1, 3], [4, 6], [5, 7]]
