"""The last mile from outside (issue 48): what a user meets first, through the real CLI.

Bad input ends with one paragraph naming what is wrong and how to fix it, with the README's exit
code; stop signals from the first moments of a command end it with one line; a model name that
is not there fails in seconds, offline; and the first hour's frictions (set-up run twice, the
plugins listing, plot's output, HF's TrainingArguments without every plugin installed).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from run_here import train_here
from test_bad_input import assert_clean_error, write_config

TOYS = REPO / "tests" / "toys.py"
SCRIPT = Path(sys.executable).parent / "corelooper"  # the console script pip wrote
NO_PLUGINS = {"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "1"}


def cli(*args: str, env: dict | None = None, **kwargs):
    return run_cli(*args, env={**NO_PLUGINS, **(env or {})}, **kwargs)


# -- stop signals from the first moments of a command ----------------------------------------------

# Imported by the interpreter at the end of its own start-up (site), before any of the command's
# code: it tells the test when the process can first run Python code of its own, so the delays
# below count from there and not from fork/exec (seconds apart on a loaded machine).
_READY = """
import os
fd = os.environ.pop("CORELOOPER_TEST_READY_FD", None)
if fd:
    os.write(int(fd), b"r")
    os.close(int(fd))
"""


def _signal_after(cmd: list[str], cwd: Path, env: dict, sig: int, delay: float):
    """``(exit code, stdout, stderr)`` of ``cmd`` sent ``sig`` ``delay`` s after its interpreter
    is up; a command that ignores it is killed after a minute (exit code None)."""
    site = cwd / "ready_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_READY)
    read_end, write_end = os.pipe()
    full_env = {**os.environ, **env, "PYTHONPATH": str(site), "CORELOOPER_TEST_READY_FD": str(write_end)}
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=full_env,
        pass_fds=(write_end,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"r"  # the interpreter is up
    finally:
        os.close(read_end)
    time.sleep(delay)
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


def _clean_stop(code, err: str, sig: int) -> bool:
    """One line and 75 / 76 before training, or 143 / 130 with a checkpoint once it trains."""
    lines = err.strip().splitlines()
    if "Traceback" in err or "KeyboardInterrupt" in err or len(lines) != 1:
        return False
    name = signal.Signals(sig).name
    if code == {signal.SIGTERM: 75, signal.SIGINT: 76}[sig]:
        return lines[0] == (
            f"corelooper: {name} received outside training: stopped, no checkpoint written by this "
            f"stop. Exit {code}."
        )
    return (
        code == 128 + sig
        and lines[0].startswith("corelooper: stopped at step ")
        and "checkpoint saved in" in lines[0]
    )


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.05, 0.1, 0.3, 0.8, 1.5, 4.0])
def test_a_stop_signal_from_the_first_moment_ends_the_command_with_one_line(tmp_path, delay):
    """SIGINT / SIGTERM at each moment of start-up (the interpreter just up, typer, torch and the
    plugins importing, the model built) and then in training: one line and 76 / 75 before
    training, 130 / 143 with a checkpoint once it trains; never a traceback, a signal ignored, nor
    death by the signal. The console script (every plugin loaded) and ``python -m corelooper``
    (none) take turns.

    The handlers are live a few milliseconds of CPU after the interpreter is up; on a machine
    busier than its cores (two test workers and more), 50 ms of wall time can pass before the
    process gets those milliseconds, and Python's own defaults then apply (death by SIGTERM, or a
    KeyboardInterrupt). So below 0.3 s a run is tried up to three times: handlers installed late
    (after typer's import, as before) fail all three."""
    config = write_config(
        tmp_path,
        model=f'factory = "{TOYS}:mlp"',
        data=f'train = "{TOYS}:blobs_train"',
        train=f'output_dir = "{tmp_path / "out"}"\nmax_steps = 1000000\nsave_strategy = "no"\n'
        "logging_steps = 100000\ndisable_tqdm = true\noverwrite_output_dir = true",
    )
    runs = [
        ([str(SCRIPT), "run", str(config)], {}, signal.SIGINT),
        ([sys.executable, "-m", "corelooper", "run", str(config)], NO_PLUGINS, signal.SIGTERM),
    ]
    if int(delay * 10) % 2:  # and the other way round
        runs = [(runs[0][0], runs[0][1], signal.SIGTERM), (runs[1][0], runs[1][1], signal.SIGINT)]
    for cmd, env, sig in runs:
        tries = []
        for _ in range(3 if delay < 0.3 else 1):
            code, out, err = _signal_after(cmd, tmp_path, env, sig, delay)
            tries.append(f"exit {code}\n{out}{err}")
            if _clean_stop(code, err, sig):
                break
        else:
            pytest.fail(
                f"{signal.Signals(sig).name} {delay} s after start-up, {cmd[0]}:\n" + "\n".join(tries)
            )


# -- bad data: the column, what is wrong with it, and what to do (exit 4) ---------------------------

_DATA = """
import torch
from torch import nn


class Rows(torch.utils.data.Dataset):
    def __init__(self, row):
        self.row = row

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return self.row(i)


def string_labels(**_):
    return Rows(lambda i: {"x": torch.randn(4), "labels": "pos" if i % 2 else "neg"})


def list_column(**_):
    return Rows(lambda i: {"x": [0.5, 1.0, 1.5, 2.0], "labels": i % 2})


def token_lists(**_):
    return Rows(lambda i: {"input_ids": [1, 2, 3, 4 + i % 3], "labels": [1, 2, 3, 4 + i % 3]})


def float_labels(**_):
    return Rows(lambda i: {"x": torch.randn(4), "labels": float(i % 2)})


def five_classes(**_):
    return Rows(lambda i: {"x": torch.randn(4), "labels": i % 5})


def pixel_values(**_):
    return Rows(lambda i: {"pixel_values": torch.randn(4), "labels": i % 2})


def ids_five_classes(**_):
    return Rows(lambda i: {"input_ids": torch.tensor([1, 2, 3, 4]), "labels": i % 5})


def ids_float_labels(**_):
    return Rows(lambda i: {"input_ids": torch.tensor([1, 2, 3, 4]), "labels": float(i % 2)})


def raw_text(**_):
    return Rows(lambda i: {"text": f"a review, number {i}", "labels": i % 2})


def token_ids_beyond_vocab(**_):
    return Rows(lambda i: {"input_ids": torch.tensor([1, 2, 3, 40]), "labels": torch.tensor([1, 2, 3, 4])})


def labels_beyond_vocab(**_):
    return Rows(lambda i: {"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, 2, 3, 40])})


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 2)

    def forward(self, x):
        return self.net(x)


def net(**_):
    return Net()


def tiny_llama(**_):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))


def tiny_classifier(**_):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=2, pad_token_id=0))
"""


def _data_run(tmp_path: Path, model: str, data: str):
    module = tmp_path / "userdata.py"
    module.write_text(_DATA)
    config = write_config(
        tmp_path,
        model=f'factory = "{module}:{model}"',
        data=f'train = "{module}:{data}"',
        train=f'output_dir = "{tmp_path / "out"}"\nmax_steps = 2\nsave_strategy = "no"\n'
        "per_device_train_batch_size = 4\ndisable_tqdm = true",
    )
    return cli("run", str(config)), f"data.train = '{module}:{data}'"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "data", "needles"),
    [
        # (a) strings or lists without a collator: was exit 6, "'list' object has no attribute
        # 'is_floating_point'. The error came from the model or its loss"
        (
            "net",
            "string_labels",
            ["Column 'labels'", "holds strings (e.g. ", "Map the class names to integer ids"],
        ),
        (
            "net",
            "list_column",
            ["Column 'x'", "is a list in each sample", "makes 4 tensors of it", "collator"],
        ),
        (
            "tiny_llama",
            "token_lists",
            ["Column 'input_ids'", "is a list in each sample", "`corelooper plugins` lists those installed"],
        ),
        # raw text that forward() does not take, so it was held back and the model got no input: was
        # exit 6, "ValueError: You must specify exactly one of input_ids or inputs_embeds"
        (
            "tiny_classifier",
            "raw_text",
            ["Column 'text'", "holds strings (e.g. 'a review, number ", "inputs_embeds", "Tokenize it"],
        ),
        # (c) columns forward() does not take: was "The batch's columns: []"
        (
            "net",
            "pixel_values",
            ["Net.forward cannot be called", "The batch's columns: ['pixel_values', 'labels']"],
        ),
        # (d) labels of the wrong type or range: was exit 6, blamed on the model
        ("net", "float_labels", ["Column 'labels'", "holds torch.float64 values", "2 class scores", "int"]),
        ("net", "five_classes", ["Column 'labels'", "class ids from 0 to ", "the model has 2 classes (0-1"]),
        ("tiny_classifier", "ids_five_classes", ["Column 'labels'", "the model has 2 classes", "IndexError"]),
        ("tiny_classifier", "ids_float_labels", ["Column 'labels'", "holds torch.float64", "2 class scores"]),
        # an HF causal LM computing its own loss: was exit 6, "IndexError: Target 40 is out of bounds.
        # The error came from the model or its loss"
        (
            "tiny_llama",
            "labels_beyond_vocab",
            ["Column 'labels'", "from 1 to 40", "the model has 32 classes"],
        ),
        (
            "tiny_llama",
            "token_ids_beyond_vocab",
            ["Column 'input_ids'", "from 1 to 40", "embedding has 32 rows", "resize_token_embeddings"],
        ),
    ],
)
def test_data_the_model_cannot_take_names_the_column_and_exits_4(tmp_path, model, data, needles):
    r, where = _data_run(tmp_path, model, data)
    message = assert_clean_error(r, where, *needles, code=4)
    assert "came from the model" not in message


# -- a plugin that fails to import: exit 3, the plugin, the file and the line ------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "needles"),
    [
        ("import os\ndef on_step_end(state:\n    pass\n", ["SyntaxError: '(' was never closed", "line 2"]),
        ("import os\nraise RuntimeError('needs libfoo 2')\n", ["RuntimeError: needs libfoo 2", "line 2"]),
        ("import no_such_dependency\n", ["No module named 'no_such_dependency'", "line 1"]),
    ],
)
def test_a_local_plugin_that_fails_to_import_exits_3_naming_file_and_line(tmp_path, source, needles):
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(source)
    config = write_config(tmp_path, plugins='local = ["my_plugin.py"]')
    assert_clean_error(
        cli("run", str(config)), "plugins.local", "'my_plugin.py'", str(plugin), *needles, code=3
    )


def test_a_local_plugin_that_is_not_there_is_a_config_error(tmp_path):
    config = write_config(tmp_path, plugins='local = ["no_such_plugin_module"]')
    assert_clean_error(
        cli("run", str(config)), "plugins.local", "cannot import 'no_such_plugin_module'", code=2
    )


def test_an_installed_plugin_with_a_syntax_error_exits_3_naming_file_and_line(tmp_path):
    site = tmp_path / "site"
    info = site / "broken_ep-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-ep\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[corelooper]\nbroken = broken_ep_module\n")
    (site / "broken_ep_module.py").write_text("x = 1\ndef on_step_end(state)\n    pass\n")
    env = {
        "PYTHONPATH": str(site),
        "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": "",
        "CORELOOPER_PLUGIN_ALLOWLIST": "broken",
    }
    config = write_config(tmp_path, plugins='enable = ["broken"]')
    assert_clean_error(
        cli("run", str(config), env=env),
        "Plugin 'broken' (package broken-ep 1.0",
        "failed to import: SyntaxError: expected ':'",
        f"({site / 'broken_ep_module.py'}, line 2)",
        "-p no:broken",
        code=3,
    )


# -- a config file with a byte-order mark ---------------------------------------------------------


@pytest.mark.slow
def test_a_config_with_a_utf8_bom_is_read_and_utf16_is_named(tmp_path):
    """Windows editors write a UTF-8 BOM: read as if it were not there (as editors and other TOML
    tools do; Python's tomllib alone says "Invalid statement (at line 1, column 1)"). UTF-16
    (PowerShell's ``>``) is named, with the fix."""
    config = write_config(tmp_path, train="learning_rat = 1e-3")
    text = config.read_text()
    config.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert_clean_error(cli("run", str(config)), "train.learning_rat", "Did you mean 'learning_rate'?", code=2)
    config = write_config(tmp_path)
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())
    r = cli("run", str(config))
    assert r.returncode == 0, r.stderr
    config.write_bytes(config.read_text(encoding="utf-8-sig").encode("utf-16"))
    assert_clean_error(cli("run", str(config)), "is not valid TOML: it is UTF-16", "save it as UTF-8", code=2)


# -- a model name that is neither a folder nor in the local cache: seconds, offline ---------------

_LM_DATA = f"""
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
from toys import lm_samples


def train_set(**_):
    return lm_samples(16)
"""


def _hub_config(tmp_path: Path, name: str) -> Path:
    (tmp_path / "lm_data.py").write_text(_LM_DATA)
    config = tmp_path / f"{name.replace('/', '_')}.toml"
    config.write_text(
        f'[model]\nname_or_path = "{name}"\n[data]\ntrain = "lm_data.py:train_set"\n'
        f'[train]\noutput_dir = "{tmp_path / "out"}"\nmax_steps = 1\nsave_strategy = "no"\ndisable_tqdm = true\n'
    )
    return config


def _no_hub(tmp_path: Path) -> dict:
    """An empty HF cache, and a hub that does not answer (a closed local port: the same on a
    machine with a network), as on a cluster node without one."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the socket is: connections are refused
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    return {**env, "HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "", "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": ""}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["models/tiny-llama", "tiny-lama"])
def test_a_model_name_not_here_fails_offline_at_once(tmp_path, name):
    """Was: 22 lines of hub retries over ~49 s, then a paragraph whose sentences ran together. Now
    one paragraph, no retry, and no longer than a path that is surely local ("./...", refused before
    the hub is asked): what the two runs share is start-up (torch and the plugins importing)."""
    env = _no_hub(tmp_path)
    start = time.monotonic()
    local = run_cli("run", str(_hub_config(tmp_path, "./no/such/folder")), env=env, cwd=tmp_path, timeout=600)
    baseline = time.monotonic() - start
    assert_clean_error(local, "'./no/such/folder': the folder does not exist", code=2)
    start = time.monotonic()
    r = run_cli("run", str(_hub_config(tmp_path, name)), env=env, cwd=tmp_path, timeout=600)
    took = time.monotonic() - start
    message = assert_clean_error(
        r,
        f"model.name_or_path = {name!r}: the folder does not exist (looked in {tmp_path}).",
        "This machine is offline (the hub does not answer), so hub names cannot be downloaded",
        f"the local Hugging Face cache ({tmp_path / 'hf' / 'hub'}) holds no model of that name",
        "hf download NAME --local-dir DIR",
        code=2,
    )
    assert ".." not in message and ". this" not in message.lower().replace("this machine", "")
    assert "Retrying" not in r.stderr and "thrown while requesting" not in r.stderr
    assert took < baseline + 30, (took, baseline)  # the retries alone took 49 s


@pytest.mark.slow
def test_a_hub_name_in_the_local_cache_loads_offline(tmp_path):
    """A hub name whose files are in the local HF cache (the layout ``hf download`` writes:
    models--ORG--NAME/snapshots/REV with refs/main) trains, with the hub out of reach."""
    sys.path.insert(0, str(REPO / "tests"))
    from toys import tiny_llama

    env = _no_hub(tmp_path)
    repo = tmp_path / "hf" / "hub" / "models--corelooper-test--tiny-llama"
    revision = "0123456789abcdef0123456789abcdef01234567"
    tiny_llama().save_pretrained(repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    r = run_cli(
        "run", str(_hub_config(tmp_path, "corelooper-test/tiny-llama")), env=env, cwd=tmp_path, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert "Retrying" not in r.stderr


# -- first-hour frictions ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("save", ["steps", "no"])
def test_a_second_run_into_a_run_folder_says_so_with_its_parentheses_closed(tmp_path, save):
    out = tmp_path / "out"
    config = write_config(
        tmp_path, train=f'output_dir = "{out}"\nmax_steps = 2\nsave_strategy = "{save}"\nsave_steps = 1'
    )
    train_here(config)  # the first run; the second, checked, through the CLI
    message = assert_clean_error(
        cli("run", str(config)), f"output_dir {str(out)!r} already holds a run (", code=2
    )
    assert message.count("(") == message.count(")"), message
    what = (
        "(2 checkpoints, latest checkpoint-2). Resume it with --resume-from-checkpoint latest, choose another"
        if save == "steps"
        else "(a finished model, model.safetensors, and no checkpoint to resume). Choose another"
    )
    assert what in message, message


_LOSS_PLUGIN = """
import torch.nn.functional as F


def compute_loss(model, batch, return_outputs):
    logits = model(batch["x"])
    loss = F.cross_entropy(logits, batch["labels"])
    return (loss, logits) if return_outputs else loss
"""


@pytest.mark.slow
def test_a_users_compute_loss_is_listed_first_and_named_in_the_run_banner(tmp_path):
    """With corelooper-lm's per-run objects (an [lm] section), pluggy asks two of them before a
    user's compute_loss: one passes the user's loss on (counting its tokens), one answers only where
    no plugin does. ``corelooper plugins`` listed the user's third, as if it never ran; now in the
    order they answer, and the run's start says which plugin answers (the model's factory is the
    builtin's: not listed, though corelooper-hf is asked first)."""
    (tmp_path / "my_loss.py").write_text(_LOSS_PLUGIN)
    config = write_config(
        tmp_path,
        train=f'output_dir = "{tmp_path / "out"}"\nmax_steps = 2\nsave_strategy = "no"\ndisable_tqdm = true',
        body='[lm]\ntoken_accuracy = true\n[plugins]\nlocal = ["my_loss.py"]\n',
    )
    everything = {"CORELOOPER_DISABLE_PLUGIN_AUTOLOAD": ""}
    r = cli("plugins", "--config", str(config), env=everything)
    assert r.returncode == 0, r.stderr
    assert "providers (in the order they answer: the first answer wins):" in r.stdout
    listed = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("compute_loss:")]
    assert listed == ["compute_loss: my_loss.py  (then lm.run, builtin; wrapped by lm.train_token_accuracy)"]
    r = cli("run", str(config), env=everything)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("corelooper: training 2 steps"), r.stdout
    assert (
        lines[1]
        == "corelooper: providers from plugins: compute_loss my_loss.py (wrapped by lm.train_token_accuracy)"
    )
    r = cli(
        "run", str(config), "--set", "train.overwrite_output_dir=true", "-p", "no:lm"
    )  # no plugin but the user's
    assert r.returncode == 0, r.stderr
    assert "corelooper: providers from plugins: compute_loss my_loss.py" in r.stdout.splitlines()


def _on_a_terminal(*args: str, cwd: Path) -> tuple[int, str]:
    """The real CLI with a pseudo-terminal as its stdout and stderr: ``(exit code, what it wrote)``
    without the terminal's control sequences."""
    import pty

    primary, secondary = pty.openpty()
    env = {**os.environ, **NO_PLUGINS, "TERM": "xterm-256color", "COLUMNS": "100", "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "corelooper", *args],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        cwd=cwd,
        env=env,
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # EIO: the command closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    code = proc.wait(timeout=600)
    os.close(primary)
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))


@pytest.mark.slow
def test_eval_and_predict_show_their_progress_on_a_terminal(tmp_path):
    """``corelooper eval`` / ``predict`` on a terminal show a bar of the evaluation's batches (32
    samples, 8 a batch: 4), as training shows its steps; not in a pipe (every other test)."""
    config = write_config(
        tmp_path,
        data=f'train = "{TOYS}:blobs_train"\neval = "{TOYS}:blobs_eval"',
        train=f'output_dir = "{tmp_path / "out"}"\nmax_steps = 2\nsave_strategy = "steps"\nsave_steps = 2',
    )
    train_here(config)  # the checkpoint to evaluate (in-process: eval and predict are checked)
    for command in (["eval", str(config)], ["predict", str(config), "--output", str(tmp_path / "p.jsonl")]):
        code, shown = _on_a_terminal(*command, "--checkpoint", "latest", cwd=tmp_path)
        assert code == 0, shown
        assert re.search(r"eval .*━.* 4/4", shown), shown  # the label, the bar, batches done / all
        piped = cli(*command, "--checkpoint", "latest")
        assert piped.returncode == 0 and "4/4" not in piped.stdout + piped.stderr


@pytest.mark.slow
def test_plot_of_two_runs_writes_into_the_current_folder_or_output(tmp_path):
    """``corelooper plot A B`` wrote into A's folder; now into the current folder (or --output)."""
    runs = []
    for name, lr in (("a", 0.1), ("b", 0.05)):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        lines = [
            f'{{"step": {s}, "loss": {2.0 / s}, "learning_rate": {lr}, "grad_norm": 1.0}}' for s in (1, 2, 3)
        ]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        runs.append(str(run))
    work = tmp_path / "work"
    work.mkdir()
    r = run_cli("plot", *runs, cwd=work)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "plot written to metrics.png"
    assert (work / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any((Path(run) / "metrics.png").exists() for run in runs)
    r = run_cli("plot", *runs, "--output", str(tmp_path / "figs" / "ab.png"), cwd=work)
    assert r.returncode == 0 and (tmp_path / "figs" / "ab.png").is_file(), r.stderr


# -- scripts/setup, run again ---------------------------------------------------------------------


def test_setup_run_again_returns_at_once_and_installs_again_after_a_pyproject_change(tmp_path):
    """The README's first command runs scripts/setup each time: the second run checks a stamp and
    stops in a second; a changed pyproject.toml (or a venv without its command) installs again.
    The repository is a copy (its pyproject files) and the venv's python a stand-in that logs what
    pip was asked: what is tested is the script's decision, not pip."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "setup").write_text((REPO / "scripts" / "setup").read_text())
    (repo / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    for name in ("hf", "lm"):
        (repo / "plugins" / name).mkdir(parents=True)
        (repo / "plugins" / name / "pyproject.toml").write_text(
            (REPO / "plugins" / name / "pyproject.toml").read_text()
        )
    venv, log = repo / ".venv", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    stand_in = f'#!/usr/bin/env bash\n[ "$1" = -m ] && echo "$*" >> {log}\nexit 0\n'
    for name in ("python", "corelooper"):
        (venv / "bin" / name).write_text(stand_in)
        (venv / "bin" / name).chmod(0o755)

    def setup() -> tuple[str, list[str]]:
        before = log.read_text().splitlines() if log.exists() else []
        r = subprocess.run(["bash", "scripts/setup"], cwd=repo, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout, (log.read_text().splitlines() if log.exists() else [])[len(before) :]

    out, pip = setup()
    assert any("install -q -c" in line and "-e plugins/hf/" in line for line in pip), pip
    start = time.monotonic()
    out, pip = setup()
    assert pip == [] and "is up to date" in out, out
    assert time.monotonic() - start < 10
    (repo / "plugins" / "lm" / "pyproject.toml").write_text(
        (repo / "plugins" / "lm" / "pyproject.toml").read_text() + "\n# a new dependency\n"
    )
    out, pip = setup()
    assert "is up to date" not in out and any("-e plugins/lm/" in line for line in pip), out
    assert setup()[1] == []  # and settled again
    (venv / "bin" / "corelooper").unlink()  # a venv broken since: installed again
    assert setup()[1] != []


# -- HF's TrainingArguments without every plugin installed ------------------------------------------

_NO_PLUGINS_INSTALLED = """
import json, sys
from corelooper import TrainArgs
from corelooper.config import ConfigError
import importlib.metadata
assert not list(importlib.metadata.entry_points(group="corelooper")), "plugins are visible"
hf = json.loads(sys.argv[1])
TrainArgs(**hf)  # every key, each at HF's default: accepted
for key, value in json.loads(sys.argv[2]).items():
    try:
        TrainArgs(**{**hf, key: value})
    except ConfigError as e:
        print(str(e))
    else:
        print(f"{key}: accepted")
"""


def test_hf_training_arguments_as_a_dict_without_the_plugins_installed(tmp_path):
    """``TrainArgs(**TrainingArguments().to_dict())`` works where no plugin is installed (a
    Python that sees corelooper and tomli-w only: no site-packages, no entry points); a key a
    plugin answers to, set away from HF's default, points to the table that names the package
    (plugins/hf/tests/test_hf_options_table.py holds that table against the plugins)."""
    import json

    import tomli_w
    from transformers import TrainingArguments

    hf = TrainingArguments(output_dir=str(tmp_path / "hf")).to_dict()
    site = tmp_path / "site"
    site.mkdir()
    (site / "corelooper").symlink_to(REPO / "corelooper")
    (site / "tomli_w").symlink_to(Path(tomli_w.__file__).parent)
    changed = {
        "use_liger_kernel": True,
        "deepspeed": "ds.json",
        "neftune_noise_alpha": 5.0,
        "fsdp": "full_shard",
    }
    r = subprocess.run(
        [sys.executable, "-S", "-c", _NO_PLUGINS_INSTALLED, json.dumps(hf), json.dumps(changed)],
        env={"PYTHONPATH": str(site), "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(changed), r.stdout
    for line, (key, value) in zip(lines, changed.items(), strict=True):
        assert line.startswith(f"train.{key} = {value!r} is a Hugging Face option that a corelooper plugin")
        assert "docs/trainer-options.md" in line and f"or remove train.{key} (HF's default" in line
    # where the plugins are installed, the same dict is theirs to translate (and accepted)
    from corelooper import TrainArgs

    TrainArgs(**hf)
