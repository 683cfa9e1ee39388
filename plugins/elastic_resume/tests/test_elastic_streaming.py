"""Elastic resume of streaming (``IterableDataset``) data: ``train.stream_split = "global"``, which
the default ``"auto"`` picks for a stream that does not split itself.

Every rank reads one global order of the stream and takes its slice of each global micro-batch,
so the checkpointed position is one number (samples of the stream's epoch consumed), which any
number of processes and dataloader workers continues. The end-to-end test is the issue's, on a
real stream with real torchrun processes (gloo), the corelooper-streaming and corelooper-elastic-resume plugins: 2 processes -> SIGTERM at step 6 -> resumed on 1
-> SIGTERM at step 9 -> resumed on 2, equal to an uninterrupted 2-process run to 1e-5, with a
record of the samples every step consumed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import corelooper_elastic_resume
import corelooper_streaming
import pytest
import torch
from corelooper_streaming.loader import StreamingLoader
from safetensors.torch import load_file

from corelooper.config import TrainArgs
from corelooper.errors import CheckpointError, ConfigError
from corelooper.loop import Loop as _Loop

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[2] / "tests")]  # the task here; streams, cluster_task
from cluster_task import ELASTIC, REPO, claim_two_processes, env, max_diff  # noqa: E402
from elastic_stream_task import RECORD_PLUGIN, ShuffledStream, epoch_order  # noqa: E402
from streams import Recorder, StatefulStream, Stream  # noqa: E402

TASK = HERE / "elastic_stream_task.py"


def Loop(*args, **kwargs):  # noqa: N802 - the Loop with both plugins (autoload is off here)
    return _Loop(*args, plugins=[corelooper_streaming, corelooper_elastic_resume], **kwargs)


def _ids(batch) -> list[int]:
    return batch["idx"].tolist()


def _loaders(world: int, batch: int, make, **kw) -> list[StreamingLoader]:
    return [
        StreamingLoader(make(), batch, rank=r, num_replicas=world, split="global", **kw) for r in range(world)
    ]


def _take(loaders, micro_batches: int) -> list[int]:
    """``micro_batches`` global micro-batches read by ``loaders`` (one per rank), in global order:
    rank 0's slice, then rank 1's, ... of each."""
    its = [iter(loader) for loader in loaders]
    return [i for _ in range(micro_batches) for it in its for i in _ids(next(it))]


# -- the position arithmetic, in one process --------------------------------------------------------


@pytest.mark.parametrize(
    "make", [lambda: StatefulStream(40), lambda: Stream(40)], ids=["stateful", "stateless"]
)
def test_the_global_position_continues_on_another_world_size(make):
    """2 ranks x 3 per device read 4 micro-batches (24 samples); their positions are one and the
    same number, and 3 ranks x 2 per device, loaded with it, continue the stream at sample 24:
    the global order is the stream's, nothing repeated, nothing skipped."""
    two = _loaders(2, 3, make)
    seen = _take(two, 4)
    assert seen == list(range(24))
    assert two[0].state_dict() == {**two[1].state_dict()}  # the same position on every rank
    state = two[0].state_dict()
    assert (state["split"], state["epoch"], state["position"], state["micro_batch"], state["batches"]) == (
        "global",
        0,
        24,
        6,
        4,
    )
    three = _loaders(3, 2, make)
    for loader in three:
        loader.load_state_dict(json.loads(json.dumps(state)))  # as the checkpoint stores it
    rest = _take(three, 2)
    assert rest == list(range(24, 36))
    if isinstance(make(), StatefulStream):
        assert three[0].dataset.reads == 12  # read from the dataset's state: items 24..35 only


def test_each_rank_takes_its_slice_and_a_short_last_micro_batch_is_split_evenly():
    """10 samples, 2 ranks x 3: global micro-batches [0..5], [6..9]; the short one is split into
    2 + 2 (no padding needed); then the next epoch starts, and its position restarts at 0."""
    r0, r1 = _loaders(2, 3, lambda: Stream(10))
    a, b = iter(r0), iter(r1)
    assert [_ids(next(a)) for _ in range(3)] == [[0, 1, 2], [6, 7], [0, 1, 2]]
    assert [_ids(next(b)) for _ in range(3)] == [[3, 4, 5], [8, 9], [3, 4, 5]]
    assert (r0.state_dict()["epoch"], r0.state_dict()["position"]) == (1, 6)
    # 7 samples, 2 ranks x 2: [0..3], then [4, 5, 6] padded with its own first sample
    r0, r1 = _loaders(2, 2, lambda: Stream(7))
    a, b = iter(r0), iter(r1)
    assert [_ids(next(a)) for _ in range(2)] == [[0, 1], [4, 5]]
    assert [_ids(next(b)) for _ in range(2)] == [[2, 3], [6, 4]]
    assert (r0.state_dict()["epoch"], r0.state_dict()["position"]) == (1, 0)  # the epoch ended
    # drop_last: the short micro-batch is not read into a batch; the next epoch follows
    (one,) = _loaders(1, 4, lambda: Stream(7), drop_last=True)
    it = iter(one)
    assert [_ids(next(it)) for _ in range(3)] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_workers_keep_the_global_order_and_position():
    """2 workers per rank read every other global micro-batch; the position recorded is that of
    the last batch the loop consumed (not of prefetched ones), and 3 workers continue from it."""
    two = _loaders(2, 2, lambda: StatefulStream(64), num_workers=2)
    assert _take(two, 5) == list(range(20))
    assert [loader.state_dict()["position"] for loader in two] == [20, 20]
    (one,) = _loaders(1, 4, lambda: StatefulStream(64), num_workers=3)
    one.load_state_dict(two[1].state_dict())
    assert _take([one], 4) == list(range(20, 36))


def test_a_shuffled_stream_continues_across_its_epochs():
    """A stream that reorders itself each epoch (set_epoch): a position in epoch 1 resumes there."""
    (one,) = _loaders(1, 8, lambda: ShuffledStream(16))
    seen = _take([one], 3)  # epoch 0 (2 micro-batches), then the first of epoch 1
    assert seen == [*epoch_order(16, 7, 0), *epoch_order(16, 7, 1)[:8]]
    two = _loaders(2, 2, lambda: ShuffledStream(16))
    for loader in two:
        loader.load_state_dict(one.state_dict())
    assert _take(two, 2) == epoch_order(16, 7, 1)[8:]


def _hf_stream(n: int = 40):
    datasets = pytest.importorskip("datasets")
    rows = {"idx": list(range(n)), "x": [[float(i)] * 8 for i in range(n)]}
    return datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=4).with_format("torch")


def test_a_hugging_face_iterable_dataset_continues_from_its_own_state():
    """datasets.IterableDataset (4 shards) has state_dict()/load_state_dict(): 2 ranks x 3 stop
    after 24 samples with the same state, and 3 ranks x 2 continue at sample 24."""
    two = _loaders(2, 3, _hf_stream)
    assert _take(two, 4) == list(range(24))
    state = json.loads(json.dumps(two[0].state_dict()))
    assert state == two[1].state_dict() and state["dataset"]["epoch"] == 0
    three = _loaders(3, 2, _hf_stream)
    for loader in three:
        loader.load_state_dict(state)
    assert _take(three, 2) == list(range(24, 36))


def test_a_hugging_face_stream_that_reads_only_a_part_is_refused():
    pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    from corelooper.errors import DataError

    with pytest.raises(
        DataError,
        match="split by datasets.distributed.split_dataset_by_node.*Pass the dataset before that split",
    ):
        StreamingLoader(split_dataset_by_node(_hf_stream(), rank=0, world_size=2), 2, split="global")
    with pytest.raises(
        DataError,
        match="splits its shards among DataLoader workers by itself \\(2 asked\\).*"
        "dataloader_num_workers = 0",
    ):
        StreamingLoader(_hf_stream(), 2, split="global", num_workers=2)
    # shards (and "auto", which picks it here): each worker reads its own shards (tests/test_streaming.py)
    StreamingLoader(_hf_stream(), 2, split="shards", num_workers=2)
    assert StreamingLoader(_hf_stream(), 2, split="auto", num_workers=2).split == "shards"


# -- refusals --------------------------------------------------------------------------------------


def _args(tmp_path, **kw) -> TrainArgs:
    base = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=6,
        save_steps=3,
        per_device_train_batch_size=2,
        logging_steps=3,
        disable_tqdm=True,
    )
    return TrainArgs(**{**base, **kw})


@pytest.mark.distributed
def test_a_stream_split_by_shards_refuses_another_world_size_naming_what_works(tmp_path, monkeypatch):
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
    shards = dict(stream_split="shards")
    Loop(Recorder(), _args(tmp_path, **shards), train_dataset=StatefulStream(64)).train()
    ckpt = tmp_path / "run" / "checkpoint-3"
    claim_two_processes(ckpt)
    with pytest.raises(
        ConfigError,
        match=r"on 1 processes: it was saved on 2, and its training stream is split "
        r'into shards \(train.stream_split = "shards", as configured\).*Resume on '
        r"2 processes.*ignore_data_skip = true.*if you set train.stream_split = "
        r'"auto" or "global"',
    ):
        Loop(Recorder(), _args(tmp_path, **shards), train_dataset=StatefulStream(64)).train(
            resume_from_checkpoint=str(ckpt)
        )
    # the default ("auto") would read this stream globally, but the checkpoint's is in shards
    with pytest.raises(
        ConfigError,
        match=r'split into shards \(train.stream_split = "shards", as the run that '
        r"saved it split its stream\).*Resume on 2 processes.*ignore_data_skip"
        r".*New runs of this configuration read their stream globally",
    ):
        Loop(Recorder(), _args(tmp_path), train_dataset=StatefulStream(64)).train(
            resume_from_checkpoint=str(ckpt)
        )
    # what the message names works: ignore_data_skip restarts the stream (with a warning)
    model = Recorder()
    with pytest.warns(UserWarning, match="not with the batches an uninterrupted run would have seen"):
        Loop(model, _args(tmp_path, ignore_data_skip=True, **shards), train_dataset=StatefulStream(64)).train(
            resume_from_checkpoint=str(ckpt)
        )
    assert model.seen == [[0, 1], [2, 3], [4, 5]]  # steps 4-6, from the stream's beginning


class OwnShards(StatefulStream):
    """Reads only its shard (current_shard()): "auto" splits it by shards."""

    shards_itself = True

    def __iter__(self):
        from corelooper_streaming.loader import current_shard

        shard = current_shard()
        for i in super().__iter__():
            if int(i["idx"]) % shard.count == shard.index:
                yield i


@pytest.mark.distributed
def test_auto_splits_a_stream_that_shards_itself_and_the_refusal_names_what_reads_it_globally(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
    Loop(Recorder(), _args(tmp_path), train_dataset=OwnShards(64)).train()
    state = json.loads((tmp_path / "run" / "checkpoint-3" / "data_state_0.json").read_text())
    assert "split" not in state and state["num_shards"] == 1  # the shards format
    claim_two_processes(tmp_path / "run" / "checkpoint-3")
    with pytest.raises(
        ConfigError,
        match=r'\(train.stream_split = "shards", "auto": OwnShards sets shards_itself = '
        r"True and reads only its shard\).*Resume on 2 processes.*if you set "
        r'train.stream_split = "global" \(every process and worker then reads',
    ):
        Loop(Recorder(), _args(tmp_path), train_dataset=OwnShards(64)).train(
            resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3")
        )


def test_switching_the_split_on_resume_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
    Loop(Recorder(), _args(tmp_path, stream_split="shards"), train_dataset=StatefulStream(64)).train()
    with pytest.raises(
        CheckpointError,
        match=r'for train.stream_split = "shards", this run has "global".*'
        r'Resume with train.stream_split = "shards" \(or "auto"\)',
    ):
        Loop(Recorder(), _args(tmp_path, stream_split="global"), train_dataset=StatefulStream(64)).train(
            resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3")
        )
    Loop(
        Recorder(),
        _args(tmp_path, stream_split="global", output_dir=str(tmp_path / "g")),
        train_dataset=StatefulStream(64),
    ).train()
    with pytest.raises(
        CheckpointError,
        match=r'for a stream read globally \(train.stream_split = "global"\), this '
        r"run splits it by shards \(as configured\).*set train.stream_split = "
        r'"auto" or "global", or set train.ignore_data_skip',
    ):
        Loop(
            Recorder(),
            _args(tmp_path, stream_split="shards", output_dir=str(tmp_path / "g")),
            train_dataset=StatefulStream(64),
        ).train(resume_from_checkpoint=str(tmp_path / "g" / "checkpoint-3"))


def test_a_checkpoint_of_the_old_default_resumes_in_shards_mode_with_auto(tmp_path, monkeypatch):
    """The default before "auto" was "shards": its checkpoints (no "split", no "next": the
    DataLoader took the workers in turn from the first) continue on the same number of processes
    with the new default, in shards mode: the same batches and weights as the run that wrote it.
    2 workers, saved after 3 batches: the next one comes from the second worker."""
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
    first = Recorder()
    Loop(
        first,
        _args(tmp_path, stream_split="shards", dataloader_num_workers=2),
        train_dataset=StatefulStream(64),
    ).train()
    ckpt = tmp_path / "run" / "checkpoint-3"
    path = ckpt / "data_state_0.json"
    state = json.loads(path.read_text())
    assert state.pop("next") == 1
    path.write_text(json.dumps(state))  # as the code before "auto" wrote it
    from corelooper.checkpoints.manifest import write_manifest

    (ckpt / "manifest.json").unlink()
    write_manifest(ckpt)
    assert set(json.loads(path.read_text())) == {"num_shards", "rank", "batches", "shards"}
    resumed = Recorder()
    Loop(resumed, _args(tmp_path, dataloader_num_workers=2), train_dataset=StatefulStream(64)).train(
        resume_from_checkpoint=str(ckpt)
    )
    assert resumed.seen == first.seen[3:] == [[5, 7], [8, 10], [9, 11]]  # shards: evens | odds
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), resumed.parameters(), strict=True))
    assert "split" not in json.loads((tmp_path / "run" / "checkpoint-6" / "data_state_0.json").read_text())


def test_in_process_resume_of_a_global_stream(tmp_path, monkeypatch):
    """The checkpoint holds one global position (the same data_state_{rank}.json on every rank);
    resumed with 2 dataloader workers, the run continues at sample 6 with the same weights."""
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
    first = Recorder()
    Loop(first, _args(tmp_path, stream_split="global"), train_dataset=StatefulStream(64)).train()
    state = json.loads((tmp_path / "run" / "checkpoint-3" / "data_state_0.json").read_text())
    assert {k: state[k] for k in ("split", "epoch", "position", "micro_batch")} == {
        "split": "global",
        "epoch": 0,
        "position": 6,
        "micro_batch": 2,
    }
    resumed = Recorder()
    Loop(
        resumed,
        _args(tmp_path, stream_split="global", dataloader_num_workers=2),
        train_dataset=StatefulStream(64),
    ).train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert resumed.seen == first.seen[3:] == [[6, 7], [8, 9], [10, 11]]
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), resumed.parameters(), strict=True))


# -- end to end: real processes, a real stream -------------------------------------------------------


def _write_config(tmp_path: Path, name: str, output_dir: Path, **train) -> Path:
    settings = {
        "max_steps": 12,
        "per_device_train_batch_size": 4,
        "learning_rate": 0.05,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 3,
        "eval_strategy": "no",
        "seed": 3,
        "output_dir": str(output_dir),
        **train,
    }  # stream_split: the default, "auto"
    toml = lambda v: f'"{v}"' if isinstance(v, str) else repr(v)  # noqa: E731
    lines = [
        "[model]",
        f'factory = "{TASK}:recording_mlp"',
        "[data]",
        f'train = "{TASK}:shuffled_stream"',
        "[train]",
        *(f"{k} = {toml(v)}" for k, v in settings.items()),
    ]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(tmp_path, config, nproc: int, record: Path, stop: int = 0, resume: bool = False):
    record.mkdir(exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "corelooper",
        "run",
        str(config),
        "-p",
        str(tmp_path / "record.py"),
        *ELASTIC,
    ]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    if resume:
        args += ["--resume-from-checkpoint", "latest"]
    return subprocess.run(
        args,
        cwd=REPO,
        env={**env(tmp_path), "STOP_AT_STEP": str(stop), "RECORD_DIR": str(record)},
        capture_output=True,
        text=True,
        timeout=240,
    )


def _step_losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(x["step"], x["loss"]) for x in lines if "loss" in x and "train_runtime" not in x]
    assert len({s for s, _ in losses}) == len(losses), losses  # each step logged once
    return dict(losses)


def _samples_per_step(record: Path) -> dict[int, list[int]]:
    """step -> the samples all processes consumed in it; a step recorded twice is a repeat."""
    by_rank_step: dict[tuple[str, int], list[int]] = {}
    for path in sorted(record.glob("seen.*.jsonl")):
        rank = path.name.split(".")[1]
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            key = (rank, entry["step"])
            assert key not in by_rank_step, f"{key} recorded twice"
            by_rank_step[key] = entry["idx"]
    steps: dict[int, list[int]] = {}
    for (_, step), idx in by_rank_step.items():
        steps.setdefault(step, []).extend(idx)
    return {s: sorted(v) for s, v in sorted(steps.items())}


@pytest.mark.slow
@pytest.mark.distributed
def test_two_then_one_then_two_processes_equals_an_uninterrupted_run(tmp_path):
    """64-sample stream, global batch 8 (8 steps a stream epoch): stopped at 6 (epoch 0) and 9
    (epoch 1). Dataloader workers: 0 in the reference; 2, then 3, then 1 in the interrupted run.
    train.stream_split is left at its default ("auto"), which reads this stream globally."""
    (tmp_path / "record.py").write_text(RECORD_PLUGIN)
    ref = _run(tmp_path, _write_config(tmp_path, "ref.toml", tmp_path / "ref"), 2, tmp_path / "ref_seen")
    assert ref.returncode == 0, ref.stderr[-3000:]

    run = tmp_path / "run"
    first = _run(
        tmp_path,
        _write_config(tmp_path, "a.toml", run, dataloader_num_workers=2),
        2,
        tmp_path / "seen",
        stop=6,
    )
    assert first.returncode != 0 and (run / "checkpoint-6").is_dir(), first.stderr[-3000:]
    assert not (run / "checkpoint-9").exists()
    one = _run(
        tmp_path,
        _write_config(tmp_path, "b.toml", run, dataloader_num_workers=3),
        1,
        tmp_path / "seen",
        stop=9,
        resume=True,
    )
    assert one.returncode == 143, one.stderr[-3000:]
    assert (
        "saved with 4 per device x 1 accumulation x 2 processes = 8; on 1 processes: "
        "4 per device x 2 accumulation x 1 processes = 8"
    ) in one.stdout
    assert "continuing the stream after sample 48 of its epoch 0" in one.stdout
    last = _run(
        tmp_path,
        _write_config(tmp_path, "c.toml", run, dataloader_num_workers=1),
        2,
        tmp_path / "seen",
        resume=True,
    )
    assert last.returncode == 0, last.stderr[-3000:]
    assert "continuing the stream after sample 8 of its epoch 1" in last.stdout  # step 9: 1 step into epoch 1

    # the samples: step s consumed the stream's samples 8(s-1) .. 8s-1, epoch after epoch
    order = epoch_order(64, 7, 0) + epoch_order(64, 7, 1)
    expected = {s: sorted(order[8 * (s - 1) : 8 * s]) for s in range(1, 13)}
    assert _samples_per_step(tmp_path / "ref_seen") == expected
    got_samples = _samples_per_step(tmp_path / "seen")
    assert got_samples == expected  # each step once: no sample repeated, none skipped
    assert sorted(i for s in range(1, 9) for i in got_samples[s]) == list(range(64))  # epoch 0 exactly once
    # who consumed them: steps 1-6 two processes (4 + 4), 7-9 one process (8), 10-12 two again
    per_file = {
        p.name: [(e["step"], len(e["idx"])) for e in map(json.loads, p.read_text().splitlines())]
        for p in (tmp_path / "seen").glob("seen.*.jsonl")
    }
    assert sorted(per_file.values()) == sorted(
        [[(s, 4) for s in range(1, 7)]] * 2
        + [[(s, 8) for s in range(7, 10)]]
        + [[(s, 4) for s in range(10, 13)]] * 2
    )

    got, want = _step_losses(run), _step_losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, 13)) == sorted(want)
    loss_diff = max(abs(got[s] - want[s]) for s in want)
    assert loss_diff <= 1e-5, (got, want)
    final = load_file(str(run / "model.safetensors"))
    diff = max_diff(final, load_file(str(tmp_path / "ref" / "model.safetensors")))
    print(f"max difference to the uninterrupted run: weights {diff:.3g}, step losses {loss_diff:.3g}")
    assert diff <= 1e-5
    assert max_diff(final, load_file(str(run / "checkpoint-6" / "model.safetensors"))) > 1e-3
