"""An ``IterableDataset`` with no plugin that loads streams: the builtin loader takes map-style data
only, and says so in one paragraph (exit 4) without naming a plugin package; a stream setting
whose plugin is blocked is refused before training (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def _config(tmp_path: Path, *train: str) -> Path:
    path = tmp_path / "stream.toml"
    path.write_text(
        "\n".join(
            [
                "[model]",
                f'factory = "{TESTS / "streams.py"}:recorder"',
                "[data]",
                f'train = "{TESTS / "streams.py"}:stream_train"',
                "[train]",
                "max_steps = 2",
                "per_device_train_batch_size = 4",
                'save_strategy = "no"',
                f'output_dir = "{tmp_path / "run"}"',
                *train,
            ]
        )
        + "\n"
    )
    return path


def test_a_stream_without_a_plugin_that_loads_it_is_refused_in_one_paragraph(tmp_path, cli):
    r = cli("run", str(_config(tmp_path)), "-p", "no:streaming")
    assert r.returncode == 4, r.stderr[-3000:]
    assert "The dataset is a torch IterableDataset (StatefulStream" in r.stderr
    assert "no loaded plugin answers 'train_dataloader' for it" in r.stderr
    assert "Traceback" not in r.stderr and "corelooper-streaming" not in r.stderr


@pytest.mark.slow
def test_the_same_stream_trains_with_the_plugin(tmp_path, cli):
    r = cli("run", str(_config(tmp_path)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_stream_split_with_its_plugin_blocked_is_refused_before_training(tmp_path, cli):
    r = cli("run", str(_config(tmp_path, 'stream_split = "shards"')), "-p", "no:streaming")
    assert r.returncode == 2, r.stderr[-3000:]
    # a blocked plugin is never imported (pytest's rule), so its own key is unknown, and said why
    assert (
        "Unknown key train.stream_split (no loaded plugin declares it; ['streaming'] are installed"
        in r.stderr
    )
    assert "but not loaded for this run (-p no:NAME, [plugins] disable)" in r.stderr
    assert not (tmp_path / "run").exists()
