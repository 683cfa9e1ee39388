"""Bad checkpoints and output dirs: a clear error naming the file or the mismatch, a non-zero
exit, and nothing deleted or changed. Some through the real CLI in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from corelooper.checkpoints.checkpoint import MANIFEST
from corelooper.config import Config
from corelooper.errors import CheckpointError
from corelooper.loop import Loop

TASK = """
import torch
from torch import nn


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.tensor(i % 3)}


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)


def build(hidden=16):
    return Net(hidden)


def train_set(**_):
    return Samples()
"""


def config_text(out: Path) -> str:
    return f'''
[model]
factory = "task.py:build"
args = {{ hidden = 16 }}

[data]
train = "task.py:train_set"

[train]
output_dir = "{out}"
max_steps = 4
per_device_train_batch_size = 8
save_steps = 2
learning_rate = 0.01
'''


@pytest.fixture(autouse=True)
def _no_installed_plugins(monkeypatch):
    monkeypatch.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished run (checkpoint-2, checkpoint-4, final model), made once in-process."""
    root = tmp_path_factory.mktemp("run")
    (root / "task.py").write_text(textwrap.dedent(TASK))
    (root / "config.toml").write_text(config_text(root / "out"))
    with pytest.MonkeyPatch.context() as mp:  # module scope: no monkeypatch fixture; leak nothing
        mp.setenv("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", "1")
        Loop(config=Config.load(root / "config.toml"), blocked_plugins=["console"]).train()
    return root


@pytest.fixture
def project(finished, tmp_path) -> Path:
    """A private copy of the finished run, to damage."""
    root = tmp_path / "proj"
    shutil.copytree(finished, root)
    (root / "config.toml").write_text(config_text(root / "out"))
    return root


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, except the run lock's (it names the PID of the last run to open the folder)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".corelooper.lock"
    }


def command(root: Path, *argv: str) -> subprocess.CompletedProcess:
    """``corelooper ARGV...`` in ``root``, a real CLI process."""
    env = {**os.environ, "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(
        [sys.executable, "-m", "corelooper", *argv],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return command(root, "run", "config.toml", *args)


def assert_one_paragraph(result: subprocess.CompletedProcess, *needles: str, code: int = 5) -> None:
    assert result.returncode == code, result.stderr  # CheckpointError.exit_code unless told
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def loop_for(root: Path, **overrides) -> Loop:
    cfg = Config.load(root / "config.toml", [f"{k}={v}" for k, v in overrides.items()])
    return Loop(config=cfg, blocked_plugins=["console"])


# -- through the CLI ------------------------------------------------------------------------------


def test_cli_checkpoint_path_that_does_not_exist(project):
    before = snapshot(project / "out")
    missing = project / "out" / "checkpoint-99"
    result = cli(project, "--resume-from-checkpoint", str(missing))
    assert_one_paragraph(result, f"Checkpoint '{missing}' does not exist")
    assert snapshot(project / "out") == before


@pytest.mark.slow
def test_cli_output_dir_holding_another_run(project):
    before = snapshot(project / "out")
    result = cli(project)  # no --resume-from-checkpoint: would mix two runs
    assert_one_paragraph(
        result,
        "already holds a run",
        "checkpoint-4",
        "--resume-from-checkpoint latest",
        "overwrite_output_dir",
        code=2,
    )  # a usage problem, not a bad checkpoint
    assert snapshot(project / "out") == before


def test_cli_truncated_weights(project):
    weights = project / "out" / "checkpoint-4" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    before = snapshot(project / "out")
    result = cli(project, "--resume-from-checkpoint", str(weights.parent))  # named: refused
    assert_one_paragraph(result, str(weights), f"is {size // 2} bytes, but {size} were written")
    assert snapshot(project / "out") == before  # config.toml, metrics.jsonl, checkpoints untouched


def test_resume_with_another_model_config(project):
    before = snapshot(project / "out")
    loop = loop_for(project, **{"model.args.hidden": 32})
    with pytest.raises(
        CheckpointError,
        match=r"belongs to a different run \(model.args: checkpoint "
        r"\{'hidden': 16\} vs config \{'hidden': 32\}\)",
    ):
        loop.train(resume_from_checkpoint="latest")
    assert snapshot(project / "out") == before


# -- in-process ------------------------------------------------------------------------------------


def test_latest_when_there_is_none(tmp_path, project):
    loop = loop_for(project, **{"train.output_dir": f'"{tmp_path / "empty"}"'})
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        loop.train(resume_from_checkpoint="latest")


def _rewrite_manifest(ckpt: Path) -> None:
    """Make the manifest agree with damaged files, so the deeper checks have to catch them."""
    from corelooper.checkpoints.manifest import write_manifest

    write_manifest(ckpt)


@pytest.mark.parametrize(
    "name",
    [
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state_0.pth",
        "loop_state.json",
        "plugins.json",
    ],
)
def test_truncated_file_is_named(project, name):
    ckpt = project / "out" / "checkpoint-4"
    path = ckpt / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _rewrite_manifest(ckpt)  # also truncated in the manifest's eyes: the file itself must be checked
    before = snapshot(project / "out")
    with pytest.raises(CheckpointError, match=f"{path}.*(unreadable|truncated)"):
        loop_for(project).train(resume_from_checkpoint=ckpt)
    assert snapshot(project / "out") == before


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state_0.pth", "model.safetensors"])
def test_missing_file_is_named(project, name):
    ckpt = project / "out" / "checkpoint-4"
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=f"{ckpt / name}.* missing|{ckpt}.*no model weights"):
        loop_for(project).train(resume_from_checkpoint=ckpt)
    _rewrite_manifest(ckpt)  # even when the manifest does not list it
    with pytest.raises(CheckpointError, match=f"{ckpt / name}.* missing|{ckpt}.*no model weights"):
        loop_for(project).train(resume_from_checkpoint=ckpt)


def test_wrong_shape_names_keys_and_shapes(project):
    """A model of another shape passed in Python (no model.factory to compare): the shapes tell."""
    from corelooper.config import import_object

    torch.manual_seed(0)
    model = import_object("task.py:build", "model.factory", project)(hidden=32)
    cfg = Config.load(project / "config.toml")
    cfg = cfg.replace("model", factory="")
    loop = Loop(model, cfg, train_dataset=loop_for(project).train_dataset, blocked_plugins=["console"])
    with pytest.raises(CheckpointError, match=r"net\.0\.weight: checkpoint \(16, 8\) vs model \(32, 8\)"):
        loop.train(resume_from_checkpoint=project / "out" / "checkpoint-2")


def test_incomplete_folder_cannot_be_resumed_by_name(project):
    ckpt = project / "out" / "checkpoint-4"
    half = project / "out" / ".tmp-checkpoint-6"
    shutil.copytree(ckpt, half)
    (half / MANIFEST).unlink()  # what a killed save leaves: everything but the manifest
    with pytest.raises(CheckpointError, match=f"{half}.* is incomplete"):
        loop_for(project).train(resume_from_checkpoint=half)
    assert half.exists()  # an error deletes nothing


def test_debris_of_killed_saves_is_cleared_and_complete_ones_put_back(project):
    """A kill between the two renames of a re-save leaves a complete ``.old-checkpoint-N`` and
    no ``checkpoint-N``: it is put back at the next start; incomplete folders are removed."""
    from corelooper.checkpoints.run_dir import _clear_debris, list_checkpoints

    out = project / "out"
    before = snapshot(out / "checkpoint-4")
    (out / "checkpoint-4").rename(out / ".old-checkpoint-4")
    shutil.copytree(out / "checkpoint-2", out / ".tmp-checkpoint-6")
    (out / ".tmp-checkpoint-6" / MANIFEST).unlink()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    _clear_debris(out)
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert snapshot(out / "checkpoint-4") == before
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != ".corelooper.lock"]


@pytest.mark.slow
def test_a_run_finished_without_checkpoints_gets_advice_that_does_not_loop(tmp_path):
    """save_strategy = "no": the folder holds the final model and no checkpoint. Running again
    does not send the user to --resume-from-checkpoint latest (which has nothing to resume), and
    that flag says the run finished; eval/predict's --checkpoint latest evaluate the final model
    and, where there is none, name their own flag."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "task.py").write_text(textwrap.dedent(TASK))
    (root / "config.toml").write_text(config_text(root / "out") + 'save_strategy = "no"\n')
    with loop_for(root) as first:  # the first run only sets the folder up: in-process, as the CLI's
        first.train()
    assert (root / "out" / "model.safetensors").is_file()
    again = cli(root)
    assert again.returncode == 2 and "no checkpoint to resume" in again.stderr, again.stderr
    assert "--resume-from-checkpoint latest" not in again.stderr and "overwrite_output_dir" in again.stderr
    before = {
        p: p.read_bytes() for p in (root / "out").rglob("*") if p.is_file() and p.name != ".corelooper.lock"
    }
    for resume in ("latest", "auto"):  # a finished run, not a start: nothing to do, nothing written
        resumed = cli(root, "--resume-from-checkpoint", resume)
        assert resumed.returncode == 0 and "already finished at step 4: nothing to do" in resumed.stdout, (
            resumed
        )
    assert {p: p.read_bytes() for p in before} == before
    verify = command(root, "verify", str(root / "out"))
    assert (
        verify.returncode == 0
        and verify.stdout.strip() == "no checkpoints; the final model: model.safetensors (step 4)"
    )
    evaluate = ("eval", "config.toml", "--checkpoint", "latest", "--set", 'data.eval = "task.py:train_set"')
    ev = command(root, *evaluate)
    assert ev.returncode == 0 and "eval_loss" in ev.stdout, ev.stderr
    (root / "out" / "model.safetensors").unlink()
    ev = command(root, *evaluate)
    assert ev.returncode == 5 and "--checkpoint latest: there is no complete checkpoint" in ev.stderr, (
        ev.stderr
    )
    assert "--resume-from-checkpoint" not in ev.stderr


def test_resume_lines_write_values_as_the_config_does(tmp_path):
    """num_train_epochs is a float in TrainArgs: its resume line says 1 -> 2, as the config writes
    it, not 1.0 -> 2.0; a fractional value keeps its decimals."""
    from corelooper import TrainArgs
    from corelooper.checkpoints import resume_settings
    from corelooper.config import Config
    from corelooper.state import LoopState

    Config(train=TrainArgs(output_dir=str(tmp_path), num_train_epochs=1)).write(tmp_path / "config.toml")
    now = Config(train=TrainArgs(output_dir=str(tmp_path), num_train_epochs=2, learning_rate=2.5e-5))
    lines = resume_settings.compare(now, tmp_path, {"world_size": 1}, LoopState())
    assert sorted(lines) == [
        "resume: train.learning_rate 5e-05 -> 2.5e-05 (applied)",
        "resume: train.num_train_epochs 1 -> 2 (applied)",
    ]
