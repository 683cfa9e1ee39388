"""Issue 27, "the exit-code contract holds for every input": 2 bad config, 4 bad data, 5 bad
checkpoint, 6 the model or step; one paragraph each, through the real CLI where the user meets it."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from test_bad_input import assert_clean_error, write_config

from corelooper import Loop
from corelooper.checkpoints import manifest
from corelooper.checkpoints.run_dir import resolve


@pytest.fixture
def cli():
    def run(*args, env=None):
        return run_cli(*args, env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})})

    return run


@pytest.mark.parametrize(
    ("setting", "needles"),
    [
        ("train.dataloader_num_workers=-1", ["train.dataloader_num_workers = -1", "worker processes"]),
        ("train.max_steps=-5", ["train.max_steps = -5", "-1 (HF's default)"]),
        ("train.max_steps=0", ["train.max_steps = 0"]),
        ("train.seed=-1", ["train.seed = -1", "[0, 2**32 - 1]"]),
        ("train.data_seed=-3", ["train.data_seed = -3"]),
        (
            'train.save_max_shard_size="5 gigs"',
            ["train.save_max_shard_size = '5 gigs' is not a size", "'5GB'"],
        ),
    ],
)
def test_bad_integers_and_sizes_exit_2_naming_the_key(cli, tmp_path, setting, needles):
    path = write_config(tmp_path)
    r = cli("run", str(path), "--set", setting)
    assert_clean_error(r, *needles, code=2)


def test_hf_max_steps_minus_1_still_means_use_the_epochs(tmp_path, train_args):
    from toys import blobs_train, mlp

    loop = Loop(
        mlp(),
        train_args(max_steps=-1, num_train_epochs=1, per_device_train_batch_size=32),
        train_dataset=blobs_train(),
    )
    loop.train()
    assert loop.state.global_step == loop.state.steps_per_epoch > 0


_MODELS = """
import torch
from torch import nn


class Words(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": f"sample number {i}", "labels": i % 4}


def words(**_):
    return Words()


class Images(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 4)

    def forward(self, pixel_values, labels=None):
        return self.net(pixel_values)


def images():
    return Images()
"""


def _module(tmp_path: Path) -> Path:
    path = tmp_path / "userproject.py"
    path.write_text(textwrap.dedent(_MODELS))
    return path


@pytest.mark.slow
def test_a_text_column_exits_4_naming_the_dataset_and_column(cli, tmp_path):
    module = _module(tmp_path)
    path = write_config(tmp_path, data=f'train = "{module}:words"')
    r = cli("run", str(path))
    message = assert_clean_error(
        r,
        "Column 'x'",
        f"data.train = '{module}:words'",
        "holds strings",
        "'sample number",
        "Tokenize",
        code=4,
    )
    assert "must be Tensor, not list" in message  # what the model said, kept in the paragraph


@pytest.mark.slow
def test_forward_that_does_not_take_the_columns_names_both(cli, tmp_path):
    module = _module(tmp_path)
    path = write_config(tmp_path, model=f'factory = "{module}:images"')
    r = cli("run", str(path))
    assert_clean_error(
        r,
        "Images.forward cannot be called with the batch",
        "missing 1 required positional",
        "The batch's columns: ['x', 'labels']",
        "forward's arguments: ['pixel_values', 'labels']",
        code=4,
    )


# -- skip_step: skipped steps are counted, not averaged ----------------------------------------------


class _NanAt(torch.utils.data.Dataset):
    """Regression samples; sample ``bad`` has a NaN input (its step's loss is NaN)."""

    def __init__(self, n: int, bad: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.x[bad] = float("nan")
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.net(x)


def _skip_run(train_args, tmp_path, logging_steps: int):
    torch.manual_seed(0)
    model = _Linear()
    args = train_args(
        output_dir=str(tmp_path / f"out{logging_steps}"),
        per_device_train_batch_size=1,
        max_steps=6,
        logging_steps=logging_steps,
        on_nonfinite="skip_step",
        train_sampling_strategy="sequential",
        optim="sgd",
        learning_rate=0.01,
    )
    loop = Loop(model, args, train_dataset=_NanAt(6, bad=2), blocked_plugins=["console"])
    loop.train()
    return loop.state.log_history


def test_skip_step_logs_skipped_steps_and_averages_only_the_applied_ones(tmp_path, train_args):
    per_step = _skip_run(train_args, tmp_path, logging_steps=1)
    windows, summary = per_step[:-1], per_step[-1]
    assert [h["step"] for h in windows] == [1, 2, 3, 4, 5, 6]
    assert "loss" not in windows[2] and windows[2]["skipped_steps"] == 1  # step 3: sample 2, skipped
    assert all(json.dumps({k: v for k, v in h.items() if "loss" in k}).count("NaN") == 0 for h in per_step)
    applied = [h["loss"] for h in windows if "loss" in h]
    assert len(applied) == 5
    assert summary["train_loss"] == pytest.approx(sum(applied) / 5, rel=1e-6)
    # a window of 2 steps, one skipped: the applied step's loss alone
    by_two = _skip_run(train_args, tmp_path, logging_steps=2)
    assert [h["step"] for h in by_two[:-1]] == [2, 4, 6]
    assert (
        by_two[1]["loss"] == pytest.approx(windows[3]["loss"], abs=1e-6) and by_two[1]["skipped_steps"] == 1
    )
    assert by_two[-1]["train_loss"] == pytest.approx(summary["train_loss"], rel=1e-6)


# -- checkpoints: weights_only failures fall back; NaN weights are screened on load -----------------


def _checkpointed_config(tmp_path: Path) -> Path:
    return write_config(
        tmp_path,
        train=f'output_dir = "{tmp_path / "out"}"\nmax_steps = 3\nsave_steps = 1\n'
        "logging_steps = 1\nper_device_train_batch_size = 8",
    )


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> tuple[Path, str]:
    """One CLI run of 3 steps with a checkpoint at each, for the module (it was one per test):
    ``(its folder, its stdout)``. Tests that damage its checkpoints take a copy (_run_with_checkpoints)."""
    root = tmp_path_factory.mktemp("checkpointed")
    r = run_cli("run", str(_checkpointed_config(root)), env={"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert r.returncode == 0, r.stderr
    return root, r.stdout


def _run_with_checkpoints(checkpointed, tmp_path) -> Path:
    """The config of a private copy of the ``checkpointed`` run (its out/ beside it)."""
    shutil.copytree(checkpointed[0] / "out", tmp_path / "out")
    return _checkpointed_config(tmp_path)


class Planted:  # an object weights_only loading refuses
    pass


@pytest.mark.slow
def test_a_checkpoint_whose_optimizer_does_not_load_weights_only_is_skipped_by_latest(
    cli, tmp_path, checkpointed
):
    config = _run_with_checkpoints(checkpointed, tmp_path)
    out = tmp_path / "out"
    newest = out / "checkpoint-3"
    state = torch.load(newest / "optimizer.pt", weights_only=True)
    state["planted"] = Planted()
    torch.save(state, newest / "optimizer.pt")
    manifest.write_manifest(newest)  # it verifies: only loading it shows the problem
    assert manifest.problem(newest) is None
    assert resolve("latest", out) == out / "checkpoint-2"
    # named explicitly: exit 5, one paragraph (torch's several are left out)
    r = cli("run", str(config), "--set", "train.max_steps=4", "--resume-from-checkpoint", str(newest))
    message = assert_clean_error(r, str(newest / "optimizer.pt"), "weights_only", "latest skips it", code=5)
    assert "Weights only load failed" in message and "Planted" not in r.stderr.split(message)[-1]
    # a resume from latest continues from checkpoint-2 and says why checkpoint-3 was skipped
    r = cli(
        "run",
        str(config),
        "--set",
        "train.max_steps=4",
        "--set",
        "train.overwrite_output_dir=false",
        "--resume-from-checkpoint",
        "latest",
    )
    assert r.returncode == 0, r.stderr
    assert "skipped newer checkpoint-3 (optimizer.pt does not load with weights_only" in r.stdout + r.stderr
    assert "Weights only load failed" not in r.stdout + r.stderr  # torch's paragraphs stay out
    assert "resuming from checkpoint-2" in r.stdout + r.stderr


@pytest.mark.slow
def test_nan_weights_under_a_finite_manifest_are_refused_on_load(cli, tmp_path, checkpointed):
    from safetensors.torch import load_file, save_file

    config = _run_with_checkpoints(checkpointed, tmp_path)
    ckpt = tmp_path / "out" / "checkpoint-2"
    weights = load_file(ckpt / "model.safetensors")
    first = next(iter(weights))
    weights[first][0] = float("nan")
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    manifest.write_manifest(ckpt)
    assert json.loads((ckpt / manifest.MANIFEST).read_text())["finite"] is True
    r = cli("run", str(config), "--set", "train.max_steps=4", "--resume-from-checkpoint", str(ckpt))
    assert_clean_error(r, str(ckpt), "holds NaN or inf weights", code=5)
    assert "verifies and is finite" not in r.stderr


def test_planted_pickle_in_optimizer_is_not_run(tmp_path):
    """The fallback never unpickles the planted object (weights_only refuses it)."""
    marker = tmp_path / "ran"
    payload = tmp_path / "optimizer.pt"

    class Boom:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"state": Boom()}, payload)
    from corelooper.checkpoints.run_dir import unloadable

    assert unloadable(tmp_path) is not None and not marker.exists()


# -- two stop signals during start-up: one paragraph, one exit code ----------------------------------

_TWO_SIGNALS = """
import os
import subprocess
import time


def model():
    # two SIGTERMs {gap} s apart, from outside, while the model is built (start-up)
    subprocess.Popen(["sh", "-c", "kill -TERM {{0}}; sleep {gap}; kill -TERM {{0}}".format(os.getpid())])
    time.sleep(30)
"""


@pytest.mark.slow
@pytest.mark.parametrize("gap", ["0.001", "0.005", "0.02"])
def test_two_signals_during_start_up_give_one_paragraph_and_exit_75(cli, tmp_path, gap):
    module = tmp_path / "twosignals.py"
    module.write_text(_TWO_SIGNALS.format(gap=gap))
    path = write_config(tmp_path, model=f'factory = "{module}:model"')
    r = cli("run", str(path))
    out = r.stdout + r.stderr
    assert r.returncode == 75, out
    assert out.count("Exit 75") == 1, out
    assert "Exception ignored" not in out and "Traceback" not in out and "StartupStop" not in out, out


def test_a_collective_that_fails_because_a_process_left_is_not_blamed_on_the_waiting_plugin():
    """Real gloo, two processes: rank 1 leaves, rank 0's all-reduce inside a plugin's hook fails.
    Exit 7, "a collective between the processes failed", not "Fix the plugin" (which it was)."""
    import socket
    import subprocess
    import sys

    from conftest import REPO

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    task = str(REPO / "tests" / "peer_lost_task.py")
    procs = [
        subprocess.Popen(
            [sys.executable, task, str(r), port], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    out0, err0 = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=30)
    assert out0.startswith("PeerLostError 7 "), out0 + err0[-2000:]
    assert "a collective between the processes failed" in out0 and "at global_step 7" in out0
    assert "Fix the plugin" not in out0 and "from the model" not in out0


@pytest.mark.slow
def test_a_closed_pipe_ends_nothing_but_the_output(tmp_path):
    """``corelooper run ... 2>&1 | head -1``: the reader closes the pipe after one line; the run
    goes on quietly and ends as it would have (exit 0, the final model written), instead of the
    next plugin that prints (the console, the doctor) failing with BrokenPipeError (exit 3)."""
    import os
    import subprocess

    from conftest import CORELOOPER

    path = write_config(
        tmp_path,
        train='output_dir = "{}"\nmax_steps = 30\nsave_strategy = "steps"\n'
        "save_steps = 10\nlogging_steps = 1".format(tmp_path / "out"),
    )
    for both in (True, False):  # stdout and stderr into the pipe; stdout alone
        run = subprocess.Popen(
            [*CORELOOPER, "run", str(path), "--set", f'train.output_dir="{tmp_path / str(both)}"'],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if both else subprocess.DEVNULL,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        assert run.stdout.readline()
        run.stdout.close()
        assert run.wait(timeout=120) == 0
        assert (tmp_path / str(both) / "model.safetensors").is_file()


@pytest.mark.slow
def test_the_start_line_counts_the_steps_that_run(checkpointed):
    """max_steps under the epochs' steps: the line says how much of an epoch that is, and its
    numbers multiply out (not "30 steps (2 epochs x 23 steps)"). The module's run of 3 steps (its
    own run was the same but for the checkpoints; the fixture asserts exit 0)."""
    _, stdout = checkpointed
    head = next(line for line in stdout.splitlines() if line.startswith("corelooper: training"))
    steps_per_epoch = int(head.split(" epochs of ")[1].split(" steps")[0])
    epochs = float(head.split("(")[1].split(" epochs")[0])
    assert head.startswith("corelooper: training 3 steps (") and epochs == pytest.approx(
        3 / steps_per_epoch, rel=1e-2
    )
