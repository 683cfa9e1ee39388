"""predict()/`corelooper predict`/`corelooper eval`: outputs in dataset order, files, metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from corelooper.cli.predictions import read_predictions

from corelooper.outputs import OutputAccumulator

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from predict_task import blobs_37  # noqa: E402
from toys import mlp  # noqa: E402

CONFIG = """
[model]
factory = "{tests}/toys.py:mlp"
[data]
train = "{tests}/toys.py:blobs_train"
eval = "{tests}/toys.py:blobs_eval"
test = "{tests}/predict_task.py:blobs_37"
[train]
output_dir = "{out}"
max_steps = 6
per_device_train_batch_size = 8
per_device_eval_batch_size = 4
learning_rate = 0.05
logging_steps = 3
save_steps = 6
disable_tqdm = true
[plugins]
local = ["{tests}/predict_task.py"]
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A config and a trained checkpoint (trained in this process), plus the expected outputs:
    the checkpoint's model applied to the test set in order."""
    from safetensors.torch import load_file

    from corelooper.config import Config
    from corelooper.loop import Loop

    base = tmp_path_factory.mktemp("predict")
    cfg = base / "config.toml"
    cfg.write_text(CONFIG.format(tests=TESTS, out=base / "run"))
    os.environ["CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        Loop(config=Config.load(cfg)).train()
    finally:
        os.environ.pop("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD")
    model = mlp()
    model.load_state_dict(load_file(str(base / "run" / "checkpoint-6" / "model.safetensors")))
    data = blobs_37()
    with torch.no_grad():
        logits = model(data.x)
    return base, cfg, logits, data.y


def run(args, cwd, nproc: int = 1):
    env = {
        **os.environ,
        "TMPDIR": str(cwd),
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    launch = (
        [sys.executable, "-m", "corelooper"]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "corelooper",
        ]
    )
    return subprocess.run([*launch, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
@pytest.mark.distributed
def test_predict_across_2_processes_is_in_dataset_order(trained):
    base, cfg, logits, labels = trained
    out = base / "preds2.safetensors"
    proc = run(["predict", str(cfg), "--checkpoint", "latest", "--output", str(out)], base, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    preds, label_ids, metrics = read_predictions(out)
    assert preds.shape == (37, 4)  # 19 + 18 rows: no padding duplicates
    torch.testing.assert_close(preds, logits, rtol=1e-5, atol=1e-6)
    assert torch.equal(label_ids, labels)
    expected_loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert metrics["test_loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["test_accuracy"] == pytest.approx((logits.argmax(-1) == labels).float().mean().item())
    assert metrics["test_count"] == 37
    assert json.loads((base / "preds2.metrics.json").read_text()) == metrics


@pytest.mark.slow
@pytest.mark.distributed
def test_a_streaming_metric_is_summed_over_2_processes(trained):
    base, cfg, logits, labels = trained
    streaming = base / "streaming.toml"
    streaming.write_text(
        cfg.read_text().replace(
            'predict_task.py"]', 'predict_task.py", "{}"]'.format(TESTS / "stream_metric_task.py")
        )
    )
    out = base / "preds_stream.safetensors"
    proc = run(["predict", str(streaming), "--checkpoint", "latest", "--output", str(out)], base, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    preds, _, metrics = read_predictions(out)
    torch.testing.assert_close(preds, logits, rtol=1e-5, atol=1e-6)  # predict still keeps the outputs
    assert metrics["test_count"] == 37  # 19 + 18 samples: both processes' states summed
    assert metrics["test_accuracy"] == pytest.approx((logits.argmax(-1) == labels).float().mean().item())

    os.environ["STREAM_METRIC_NO_SYNC"] = "1"  # run() passes os.environ on
    try:
        proc = run(["predict", str(streaming), "--checkpoint", "latest", "--output", str(out)], base, nproc=2)
    finally:
        del os.environ["STREAM_METRIC_NO_SYNC"]
    # torchrun exits 1 when a worker fails; the worker itself exited 2 (bad config), one paragraph
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert "has no sync(reduce_sum) method" in proc.stderr  # (the traceback after it is torchrun's own)


@pytest.mark.slow
def test_predict_jsonl_one_process(trained):
    base, cfg, logits, labels = trained
    out = base / "preds.jsonl"
    proc = run(
        ["predict", str(cfg), "--checkpoint", str(base / "run" / "checkpoint-6"), "-o", str(out)], base
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(37))
    assert [r["label_ids"] for r in rows] == labels.tolist()
    torch.testing.assert_close(torch.tensor([r["prediction"] for r in rows]), logits, rtol=1e-4, atol=1e-5)
    assert "test_loss" in json.loads(proc.stdout.splitlines()[-1])


def test_eval_command_prints_the_checkpoints_metrics(trained):
    from toys import blobs_eval

    base, cfg, _, _ = trained
    proc = run(["eval", str(cfg), "--checkpoint", str(base / "run")], base)  # output_dir's final model
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout.splitlines()[-1])
    from safetensors.torch import load_file

    model = mlp()
    model.load_state_dict(load_file(str(base / "run" / "model.safetensors")))
    data = blobs_eval()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(data.x), data.y).item()
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["eval_count"] == 32


def test_bad_checkpoint_and_output_are_one_paragraph_errors(trained):
    base, cfg, _, _ = trained
    from corelooper.cli.evaluate import predict

    from corelooper.config import Config
    from corelooper.errors import CheckpointError, ConfigError

    os.environ["CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        with pytest.raises(CheckpointError, match="missing.*does not exist"):
            predict(Config.load(cfg), str(base / "missing"), None)
        # a classifier: no plugin writes per-sample records for it, so nothing to generate from
        with pytest.raises(ConfigError, match="--generate: no loaded plugin writes per-sample predictions"):
            predict(Config.load(cfg), str(base / "run"), str(base / "g.jsonl"), options={"generate": True})
        assert not (base / "g.jsonl").exists()
    finally:
        os.environ.pop("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD")
    from corelooper.cli.predictions import write_predictions

    with pytest.raises(ConfigError, match=r"p.csv.*\.safetensors or \.jsonl"):
        write_predictions(base / "p.csv", torch.zeros(2, 2), None, {})


def test_eval_accumulation_steps_moves_outputs_in_chunks_and_pads():
    acc = OutputAccumulator(steps=2)
    for n, length in enumerate([3, 5, 4, 2, 5]):
        acc.add(torch.full((2, length), float(n)), torch.full((2, length), n))
    assert len(acc._cpu_preds) == 2 and len(acc._preds) == 1  # 2 chunks offloaded, 1 batch pending
    preds, labels = acc.local()
    assert preds.shape == (10, 5) and labels.shape == (10, 5)
    assert preds[0].tolist() == [0, 0, 0, -100, -100]  # shorter rows padded with -100, as HF
    assert labels[6].tolist() == [3, 3, -100, -100, -100]


def test_predict_same_with_and_without_accumulation(make_loop):
    loop = make_loop(eval_accumulation_steps=1)
    p1, l1, m1 = loop.predict(loop.eval_dataset)
    p2, l2, m2 = make_loop().predict(loop.eval_dataset)
    assert torch.equal(p1, p2) and torch.equal(l1, l2) and m1 == m2
    assert p1.shape[0] == len(loop.eval_dataset)


def _files(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_eval_and_predict_leave_the_training_runs_files_as_they_were(tmp_path):
    """`corelooper eval`/`predict` feed no logger: metrics.jsonl gains no eval line (a later
    `corelooper plot` would draw it back to the checkpoint's step) and tensorboard/ is untouched."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(CONFIG.format(tests=TESTS, out=tmp_path / "run"))
    tb = ["-p", "corelooper_tensorboard"]
    proc = run(["run", str(cfg), *tb], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert (run_dir / "tensorboard").is_dir() and (run_dir / "metrics.jsonl").is_file()
    before = _files(run_dir)
    ev = run(["eval", str(cfg), "--checkpoint", "latest", *tb], tmp_path)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "eval_loss" in json.loads(ev.stdout.splitlines()[-1])  # the result: on stdout
    out = tmp_path / "preds.jsonl"
    pr = run(["predict", str(cfg), "--checkpoint", "latest", "-o", str(out), *tb], tmp_path)
    assert pr.returncode == 0, pr.stderr[-3000:]
    assert len(out.read_text().splitlines()) == 37  # ... and in its own file
    assert _files(run_dir) == before


def test_a_jsonl_of_logits_is_written_with_a_note_pointing_at_safetensors(tmp_path, caplog, monkeypatch):
    """A causal LM's predictions are logits over the vocabulary: as JSON hundreds of MB. The file
    is still written as asked; the note says how large and that .safetensors holds them exactly."""
    import logging

    from corelooper.cli import predictions as out

    monkeypatch.setattr(out, "LARGE_JSON", 1000)  # a small stand-in for 10 million numbers
    logits = torch.randn(2, 5, 128)
    with caplog.at_level(logging.WARNING, logger="corelooper"):
        out.write_predictions(tmp_path / "p.jsonl", logits, None, {})
        out.write_predictions(tmp_path / "ids.jsonl", logits.argmax(-1), None, {})  # ids: no note
        out.write_predictions(tmp_path / "p.safetensors", logits, None, {})  # no size note
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2 and all("[2, 5, 128] floats (logits)" in n for n in notes)
    assert ".safetensors holds them exactly" in notes[0] and "MB" not in notes[1]
    assert all(
        "One record per sample (its loss, token ids, generated text) comes from a plugin that answers the "
        "hook predict_records" in n
        for n in notes
    )
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 2
