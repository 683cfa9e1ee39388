"""IterableDataset training: sharding over processes x workers, epochs, exact resume."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import corelooper_streaming
import datasets  # the test extra: a real Hugging Face IterableDataset below
import pytest

from corelooper.config import TrainArgs
from corelooper.errors import CheckpointError, DataError
from corelooper.loop import Loop as _Loop

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS.parents[2] / "tests"))  # streams.py: shared with the elastic tests
from streams import Recorder, StatefulStream, Stream  # noqa: E402


def Loop(*args, **kwargs):  # noqa: N802 - the Loop, with this plugin (autoload is off here)
    return _Loop(*args, plugins=[corelooper_streaming], **kwargs)


@pytest.fixture(autouse=True)
def _no_autoload(monkeypatch):
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """2 processes (torchrun, gloo) x 2 dataloader workers; see tests/stream_worker.py."""
    out = tmp_path_factory.mktemp("stream")
    env = {**os.environ, "TMPDIR": str(out), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(TESTS / "stream_worker.py"),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, [json.loads((out / f"result.rank{r}.json").read_text()) for r in range(2)]


SPLITS = ["auto", "shards"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("kind", ["stateful", "stateless"])
def test_each_sample_seen_exactly_once_across_2_processes_x_2_workers(two_by_two, kind, split):
    _, ranks = two_by_two
    seen = [i for r in ranks for batch in r[split][kind]["first"] for i in batch]
    assert len(seen) == 64 and sorted(seen) == list(range(64))  # 16 steps x 2 ranks x 2 = one pass


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["stateful", "stateless"])
def test_the_default_reads_one_global_order_and_each_rank_takes_its_slice(two_by_two, kind):
    """ "auto" for a stream that does not split itself: read globally. Global micro-batches of
    2 x 2 samples, in stream order: rank 0 takes the first two of each, rank 1 the last two."""
    _, ranks = two_by_two
    assert ranks[0]["auto"][kind]["first"] == [[4 * m, 4 * m + 1] for m in range(16)]
    assert ranks[1]["auto"][kind]["first"] == [[4 * m + 2, 4 * m + 3] for m in range(16)]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["stateful", "stateless"])
def test_shards_mode_gives_each_process_x_worker_its_own_shard(two_by_two, kind):
    """ "shards": shard 2r + w keeps items i % 4 == 2r + w, and the batches of a rank's two
    workers alternate: rank 0 [0, 4], [1, 5], [8, 12], [9, 13], ..."""
    _, ranks = two_by_two
    for r in (0, 1):
        shard = [[i for i in range(64) if i % 4 == 2 * r + w] for w in (0, 1)]
        expected = [shard[b % 2][2 * (b // 2) : 2 * (b // 2) + 2] for b in range(16)]
        assert ranks[r]["shards"][kind]["first"] == expected


@pytest.mark.distributed
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("kind", ["stateful", "stateless"])
def test_resume_continues_with_exactly_the_same_batches_and_weights(two_by_two, kind, split):
    """Checkpoint at step 5 (an odd number of batches per process: the next batch comes from the
    second worker), resumed in a fresh Loop: the same batches in the same order, same weights."""
    _, ranks = two_by_two
    for r in ranks:
        assert r[split][kind]["resumed"] == r[split][kind]["first"][5:]
        assert r[split][kind]["params_resumed"] == r[split][kind]["params_first"]


@pytest.mark.distributed
def test_checkpoint_holds_each_shards_position(two_by_two):
    out, _ = two_by_two
    state = json.loads((out / "shards" / "stateful" / "checkpoint-5" / "data_state_0.json").read_text())
    assert state["num_shards"] == 4 and state["batches"] == 5
    assert state["next"] == 1  # the next batch comes from shard 1 (worker 1)
    # rank 0 consumed 3 batches of shard 0 (items 0,4 | 8,12 | 16,20) and 2 of shard 1 (1,5 | 9,13)
    assert state["shards"]["0"] == {"epoch": 0, "position": 21, "dataset": {"pos": 21}}
    assert state["shards"]["1"] == {"epoch": 0, "position": 14, "dataset": {"pos": 14}}
    assert (
        json.loads((out / "shards" / "stateless" / "checkpoint-5" / "data_state_1.json").read_text())[
            "shards"
        ]["2"]["dataset"]
        is None
    )
    # the default's: one global position, the same on both ranks (5 steps x 4 samples)
    states = [
        json.loads((out / "auto" / "stateful" / "checkpoint-5" / f"data_state_{r}.json").read_text())
        for r in (0, 1)
    ]
    assert states[0] == states[1]
    assert {k: states[0][k] for k in ("split", "epoch", "position", "batches", "dataset")} == {
        "split": "global",
        "epoch": 0,
        "position": 20,
        "batches": 5,
        "dataset": {"pos": 20},
    }


def args(tmp_path, **kw) -> TrainArgs:
    base = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=8,
        save_steps=3,
        per_device_train_batch_size=2,
        logging_steps=4,
        disable_tqdm=True,
    )
    return TrainArgs(**{**base, **kw})


def test_stateful_resume_reads_nothing_twice(tmp_path):
    Loop(Recorder(), args(tmp_path), train_dataset=StatefulStream(64)).train()
    stream = StatefulStream(64)
    model = Recorder()
    Loop(model, args(tmp_path), train_dataset=stream).train(resume_from_checkpoint="latest")
    assert model.seen == []  # latest is checkpoint-8: nothing left to do
    Loop(model, args(tmp_path), train_dataset=stream).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3")
    )
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
    with caplog.at_level(logging.WARNING, logger="corelooper.checkpoints"):
        Loop(model, args(tmp_path, ignore_data_skip=True), train_dataset=Stream(64)).train(
            resume_from_checkpoint=ckpt
        )
    assert model.seen[0] == [0, 1]
    assert "ignore_data_skip = true: the training stream starts again from its beginning" in caplog.text


def test_stream_restarts_each_epoch_until_max_steps(tmp_path):
    class Epochs(Stream):
        epochs: list[int] = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    model = Recorder()
    ds = Epochs(10)
    Loop(
        model,
        args(tmp_path, max_steps=5, per_device_train_batch_size=4, save_strategy="no"),
        train_dataset=ds,
    ).train()
    assert model.seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert ds.epochs == [0, 1]


def test_other_geometry_on_resume_and_no_max_steps_are_clear_errors(tmp_path):
    shards = dict(stream_split="shards")
    Loop(
        Recorder(), args(tmp_path, dataloader_num_workers=2, **shards), train_dataset=StatefulStream(64)
    ).train()
    # a longer plan: a real resume (a finished one has nothing to read, so nothing to refuse)
    with pytest.raises(
        CheckpointError, match='for 2 stream shards.*this run has 1.*ignore_data_skip.*stream_split = "auto"'
    ):
        Loop(Recorder(), args(tmp_path, max_steps=12, **shards), train_dataset=StatefulStream(64)).train(
            resume_from_checkpoint="latest"
        )
    # the same checkpoint with the default ("auto"): still in shards, so refused the same way
    with pytest.raises(CheckpointError, match="for 2 stream shards.*this run has 1"):
        Loop(Recorder(), args(tmp_path, max_steps=12), train_dataset=StatefulStream(64)).train(
            resume_from_checkpoint="latest"
        )
    with pytest.raises(DataError, match="max_steps"):
        Loop(
            Recorder(), args(tmp_path, max_steps=-1, output_dir=str(tmp_path / "b")), train_dataset=Stream(8)
        ).train()


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
    from corelooper_streaming.loader import current_shard

    class OwnShards(Stream):
        shards_itself = True

        def __iter__(self):
            shard = current_shard()
            for i in range(shard.index, self.n, shard.count):
                yield sample(i)

    from streams import sample

    model = Recorder()
    Loop(
        model,
        args(tmp_path, max_steps=4, dataloader_num_workers=2, save_strategy="no"),
        train_dataset=OwnShards(16),
    ).train()
    assert model.seen == [[0, 2], [1, 3], [4, 6], [5, 7]]


# -- Hugging Face datasets.IterableDataset in shards mode ---------------------------------------------


def hf_stream(n: int = 40, num_shards: int = 4):
    """A real ``datasets.IterableDataset`` of the stream's samples, in ``num_shards`` shards."""
    from streams import sample

    rows = [sample(i) for i in range(n)]
    columns = {k: [r[k].tolist() for r in rows] for k in ("x", "labels", "idx")}
    return datasets.Dataset.from_dict(columns).to_iterable_dataset(num_shards=num_shards).with_format("torch")


def _one_pass(make, world: int, workers: int, split: str = "shards") -> list[int]:
    from corelooper_streaming.loader import StreamingLoader

    return [
        i
        for rank in range(world)
        for batch in StreamingLoader(
            make(rank), 4, rank=rank, num_replicas=world, num_workers=workers, cycle=False, split=split
        )
        for i in batch["idx"].tolist()
    ]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize(
    ("num_shards", "world", "workers"), [(4, 1, 2), (4, 2, 2), (3, 2, 2), (2, 1, 3), (4, 2, 0)]
)
def test_a_hugging_face_stream_with_dataloader_workers_reads_every_sample_once(num_shards, world, workers):
    """datasets.IterableDataset gives each DataLoader worker its own shards (worker w: shards
    w, w + K, ...; none to a worker past num_shards); corelooper splits only the processes on
    top. One pass over 40 samples reads each exactly once: 1 process x 2 workers read 20 before
    (corelooper's worker filter on top of the dataset's)."""
    seen = _one_pass(lambda rank: hf_stream(40, num_shards), world, workers)
    assert len(seen) == 40 and sorted(seen) == list(range(40))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_hugging_face_stream_split_by_node_is_not_split_again(workers):
    """split_dataset_by_node already gives each process its part (4 shards / 2 processes: two
    shards each); corelooper keeps all of it."""
    from datasets.distributed import split_dataset_by_node

    seen = _one_pass(lambda rank: split_dataset_by_node(hf_stream(), rank=rank, world_size=2), 2, workers)
    assert len(seen) == 40 and sorted(seen) == list(range(40))
    assert (
        _one_pass(
            lambda rank: split_dataset_by_node(hf_stream(), rank=rank, world_size=2), 2, workers, split="auto"
        )
        == seen
    )  # "auto": shards, the dataset's own split


def test_auto_picks_shards_where_the_dataset_splits_itself_and_global_elsewhere(caplog):
    from corelooper_streaming.loader import StreamingLoader
    from datasets.distributed import split_dataset_by_node

    def choice(ds, workers=0):
        return StreamingLoader(ds, 2, num_workers=workers, split="auto").choice

    assert (choice(Stream(8)).mode, choice(Stream(8), 2).mode, choice(hf_stream()).mode) == ("global",) * 3
    hf = choice(hf_stream(), 2)
    assert (hf.mode, hf.to_global) == ("shards", "set train.dataloader_num_workers = 0")
    assert "IterableDataset splits its shards among the 2 dataloader workers itself" in hf.why
    node = choice(split_dataset_by_node(hf_stream(), rank=0, world_size=2))
    assert (node.mode, node.to_global) == ("shards", "pass the dataset before that split")
    with caplog.at_level(logging.INFO, logger="corelooper.streaming"):  # the run says which and why
        choice(Stream(8))
    assert 'Training stream split: "global" ("auto": Stream does not split itself' in caplog.text


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize(
    ("num_shards", "workers"), [(4, 2), (2, 3)], ids=["4-shards-2-workers", "2-shards-3-workers"]
)
def test_a_hugging_face_stream_with_workers_trains_one_epoch_and_resumes_exactly(
    tmp_path, num_shards, workers
):
    """The default ("auto" -> shards here) for a datasets.IterableDataset with dataloader
    workers: 10 steps x 4 = one epoch of 40, each sample once; resumed from step 3 (the next
    batch is the second worker's) in a fresh Loop, from the dataset's own state in each worker:
    the same batches, the same weights. With 2 shards and 3 workers the third reads nothing."""
    kw = dict(max_steps=10, save_steps=3, per_device_train_batch_size=4, dataloader_num_workers=workers)
    first = Recorder()
    Loop(first, args(tmp_path, **kw), train_dataset=hf_stream(40, num_shards)).train()
    assert len(first.seen) == 10 and sorted(i for b in first.seen for i in b) == list(range(40))
    state = json.loads((tmp_path / "run" / "checkpoint-3" / "data_state_0.json").read_text())
    assert (state["num_shards"], state["batches"], state["next"]) == (workers, 3, 1)
    resumed = Recorder()
    Loop(resumed, args(tmp_path, **kw), train_dataset=hf_stream(40, num_shards)).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3")
    )
    assert resumed.seen == first.seen[3:]
    assert all(p.equal(q) for p, q in zip(first.parameters(), resumed.parameters(), strict=True))


def _epochs(batches: list[list[int]], per_epoch: int) -> list[list[int]]:
    """The samples of each whole epoch of ``per_epoch`` samples, sorted (batches do not straddle)."""
    out, current = [], []
    for b in batches:
        current += b
        if len(current) == per_epoch:
            out, current = [*out, sorted(current)], []
    assert len(current) < per_epoch, "a batch straddles two epochs"
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_shards", [4, 3])
def test_a_hugging_face_stream_on_2_processes_x_2_workers_continues_each_shard_exactly(num_shards):
    """Each rank reads its half of every epoch, the workers' epochs together (the dataset's epoch
    is shared with its workers; 3 shards: one worker reads two, the other one, so their streams
    differ in length). Stopped after 5 batches and at the end of the first epoch (state as the
    checkpoint stores it), a fresh loader continues with the batches an uninterrupted one gives."""
    from itertools import islice

    from corelooper_streaming.loader import StreamingLoader

    def loader(rank, cycle=True):
        return StreamingLoader(
            hf_stream(40, num_shards), 4, rank=rank, num_replicas=2, num_workers=2, split="auto", cycle=cycle
        )

    passes = [sorted(i for b in loader(rank, cycle=False) for i in b["idx"].tolist()) for rank in (0, 1)]
    assert sorted(passes[0] + passes[1]) == list(range(40))  # one pass of both ranks: each sample once
    if num_shards == 4:
        assert passes == [list(range(0, 40, 2)), list(range(1, 40, 2))]
    for rank in (0, 1):
        ref = [b["idx"].tolist() for b in islice(loader(rank), 16)]
        epochs = _epochs(ref, len(passes[rank]))
        assert len(epochs) >= 2 and epochs[0] == epochs[1] == passes[rank]
        first_epoch = next(n for n in range(1, 17) if len(_epochs(ref[:n], len(passes[rank]))) == 1)
        for stop in (5, first_epoch):
            stopped = loader(rank)
            assert [b["idx"].tolist() for b in islice(stopped, stop)] == ref[:stop]
            state = json.loads(json.dumps(stopped.state_dict()))
            resumed = loader(rank)
            resumed.load_state_dict(state)
            assert [b["idx"].tolist() for b in islice(resumed, 16 - stop)] == ref[stop:], (rank, stop)


def test_a_map_style_dataset_is_left_to_the_builtin_loader(tmp_path):
    from streams import sample

    from corelooper.data.loader import BatchLoader

    data = [sample(i) for i in range(8)]
    loop = Loop(Recorder(), args(tmp_path, max_steps=1, save_strategy="no"), train_dataset=data)
    assert corelooper_streaming.train_dataloader(loop, data) is None
    assert corelooper_streaming.eval_dataloader(loop, data) is None
    answer, impl = loop.plugins.call_provider("train_dataloader", loop=loop, dataset=data)
    assert isinstance(answer, BatchLoader) and loop.plugins.pm.get_name(impl.plugin) == "builtin"


def test_stream_split_is_the_plugins_setting(tmp_path):
    loop = Loop(Recorder(), args(tmp_path, stream_split="global"), train_dataset=StatefulStream(8))
    assert loop.config.section("streaming") == {"split": "global"}
    assert Loop(Recorder(), args(tmp_path), train_dataset=StatefulStream(8)).config.section("streaming") == {
        "split": "auto"
    }
    with pytest.raises(
        Exception, match=r'train.stream_split must be "auto", "shards" or "global", not \'rows\''
    ):
        args(tmp_path, stream_split="rows")
