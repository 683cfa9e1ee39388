"""`corelooper plot`: a PNG of loss, LR, grad norm and eval metrics from real runs' metrics.jsonl."""

from __future__ import annotations

import pytest
from toys import accuracy, blobs_eval, blobs_train, mlp

from corelooper import Loop
from corelooper.plugins import AUTOLOAD_ENV


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two real runs of 8 steps (logs every 2, evaluations at 4 and 8), learning rates 0.05 and 0.01,
    with no installed plugin loaded (nothing else writes into metrics.jsonl)."""
    base = tmp_path_factory.mktemp("runs")
    dirs = []
    for lr in (0.05, 0.01):
        out = base / f"lr{lr}"
        train = {
            "output_dir": str(out),
            "max_steps": 8,
            "per_device_train_batch_size": 8,
            "per_device_eval_batch_size": 32,
            "learning_rate": lr,
            "lr_scheduler_type": "linear",
            "logging_steps": 2,
            "eval_strategy": "steps",
            "eval_steps": 4,
            "save_strategy": "no",
            "max_grad_norm": 1.0,
            "disable_tqdm": True,
            "seed": 0,
        }
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(AUTOLOAD_ENV, "1")
            loop = Loop(
                mlp(),
                {"train": train},
                train_dataset=blobs_train(),
                eval_dataset=blobs_eval(),
                compute_metrics=accuracy,
            )
        with loop:
            loop.train()
        dirs.append(out)
    return dirs


def png_panels(path):
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        assert im.format == "PNG"
        return im.size, im.text["Description"].removeprefix("panels: ").split(", ")


def test_plot_two_runs_has_one_panel_per_quantity(two_runs, cli, tmp_path):
    out = tmp_path / "compare.png"
    proc = cli("plot", *map(str, two_runs), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    size, panels = png_panels(out)
    # the runs log loss, learning_rate, grad_norm; evaluate eval_loss and eval_accuracy
    assert panels == ["loss", "learning_rate", "grad_norm", "eval_loss", "eval_accuracy"]
    # 5 panels in a 3 x 2 grid at 110 dpi
    assert size == (round(4.6 * 3 * 110), round(3.3 * 2 * 110))


def test_plot_series_are_the_logged_numbers(two_runs):
    import json

    from corelooper.cli.plot import read_metrics, series

    s = series(read_metrics(two_runs[0]))
    logged = [json.loads(line) for line in (two_runs[0] / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in logged if r["event"] == "eval"]
    assert s["eval_loss"] == ([r["step"] for r in evals], [r["eval_loss"] for r in evals])
    assert s["learning_rate"][0] == [2, 4, 6, 8]  # logging_steps 2; the summary is not a point
    # the rate step k trained with (read before scheduler.step(), as HF since PR #36973)
    assert s["learning_rate"][1] == pytest.approx([0.05 * (8 - (k - 1)) / 8 for k in (2, 4, 6, 8)])


def test_plot_default_output_and_errors(two_runs, tmp_path, monkeypatch):
    from corelooper.cli.plot import plot_runs

    from corelooper.errors import ConfigError, DataError

    monkeypatch.chdir(tmp_path)  # the default is the current folder, never a run's folder
    assert plot_runs([two_runs[1]]).resolve() == tmp_path / "metrics.png"
    assert png_panels(tmp_path / "metrics.png")[1][0] == "loss"
    assert not (two_runs[1] / "metrics.png").exists()
    with pytest.raises(DataError, match="has no metrics.jsonl"):
        plot_runs([tmp_path / "nope"])
    with pytest.raises(ConfigError, match="ending in .png"):
        plot_runs([two_runs[0]], tmp_path / "x.jpg")
