"""corelooper-auto-batch-size: behaviour and numbers.

There is no GPU in CI, so every out-of-memory error here is FAKED: the toy models in
``auto_batch_toys.py`` raise ``torch.OutOfMemoryError`` when a forward pass gets more rows than
their limit. The loop, the plugin (loaded through its real entry point), gradient accumulation,
checkpoints and the 2-process run are all real.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from auto_batch_toys import LimitedLM, blobs, mlp, tokens

from corelooper import Loop
from corelooper.backends.base import AccelerateBackend
from corelooper.config import Config
from corelooper.errors import ConfigError, TrainingError

HERE = Path(__file__).resolve().parent
RUN = "auto_batch_size.run"


def make_loop(tmp_path, name, model, *, section=None, plugins=(), train_data=None, eval_data=None, **train):
    base = dict(
        output_dir=str(tmp_path / name),
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        disable_tqdm=True,
        num_train_epochs=2,
        per_device_train_batch_size=16,
        seed=0,
    )
    raw = {"train": {**base, **train}}
    if section is not None:
        raw["auto_batch_size"] = section
    return Loop(
        model,
        Config.from_dict(raw),
        train_dataset=train_data or blobs(64),
        eval_dataset=eval_data,
        plugins=plugins,
    )


def weights(loop) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in loop.backend.unwrap_model(loop.model).state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def losses(loop) -> list[float]:
    return [h["loss"] for h in loop.state.log_history if "loss" in h and "train_runtime" not in h]


def geometry(loop) -> tuple:
    s = loop.state
    return s.train_batch_size, s.gradient_accumulation_steps, loop.plugins.get(RUN).train_size


def shrinks(loop, key="train_micro_batch_size") -> list[tuple[int, int]]:
    return [(h["step"], h[key]) for h in loop.state.log_history if key in h]


class At:
    """A test plugin: runs ``action(loop)`` when ``on_step_end`` sees ``global_step == step``."""

    def __init__(self, step, action):
        self.step, self.action, self.name = step, action, f"at-{step}"

    def on_step_end(self, loop, state):
        if state.global_step == self.step:
            self.action(loop)


def test_batch_16_that_does_not_fit_trains_exactly_like_4_x_4_accumulation(tmp_path):
    """OOM on the very first step: 16 fails, 8 fails, 4 fits; same steps, same weights."""
    oom = make_loop(tmp_path, "oom", mlp(train_limit=4), auto_find_batch_size=True)
    oom.train()
    ref = make_loop(tmp_path, "ref", mlp(), per_device_train_batch_size=4, gradient_accumulation_steps=4)
    ref.train()

    assert oom.state.global_step == ref.state.global_step == 8
    assert max_diff(weights(oom), weights(ref)) <= 1e-5
    assert losses(oom) == pytest.approx(losses(ref), rel=1e-5)
    assert oom.model.ooms == 2
    assert oom.model.train_sizes()[:3] == [16, 8, 4]
    assert set(oom.model.train_sizes()[2:]) == {4}
    assert shrinks(oom) == [(0, 8), (0, 4)]
    assert [h["micro_batches_per_step"] for h in oom.state.log_history if "micro_batches_per_step" in h] == [
        2,
        4,
    ]
    assert geometry(oom) == (16, 1, 4)  # the loader's batches and GA unchanged, cut into 4s
    assert oom.plugins.pm.get_plugin(RUN).state_dict() == {
        "train_micro_batch_size": 4,
        "eval_batch_size": None,
    }


def test_oom_in_backward_discards_the_partial_gradients(tmp_path):
    """The fake OOM is raised in the backward, after the last layer already got its gradient."""
    oom = make_loop(
        tmp_path,
        "oom",
        mlp(train_limit=8, in_backward=True),
        auto_find_batch_size=True,
        gradient_accumulation_steps=2,
        num_train_epochs=3,
    )
    oom.train()
    ref = make_loop(
        tmp_path,
        "ref",
        mlp(),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,
        num_train_epochs=3,
    )
    ref.train()
    assert oom.model.ooms == 1 and oom.state.global_step == ref.state.global_step == 6
    assert geometry(oom) == (16, 2, 8)  # 2 x 16 became 4 x 8
    assert max_diff(weights(oom), weights(ref)) <= 1e-5


def test_oom_in_the_middle_of_training(tmp_path):
    """The limit drops after step 3: step 4 is retried at 8 x 2; the result equals no OOM at all."""

    def squeeze(loop):
        loop.backend.unwrap_model(loop.model).train_limit = 8

    oom = make_loop(tmp_path, "oom", mlp(), auto_find_batch_size=True, plugins=[At(3, squeeze)])
    oom.train()
    ref = make_loop(tmp_path, "ref", mlp())
    ref.train()
    assert oom.state.global_step == ref.state.global_step == 8
    assert max_diff(weights(oom), weights(ref)) <= 1e-5
    assert shrinks(oom) == [(3, 8)]
    assert oom.model.train_sizes()[:4] == [16, 16, 16, 16]  # steps 1-3, then the failed try
    assert set(oom.model.train_sizes()[4:]) == {8}
    assert geometry(oom) == (16, 1, 8)


def test_eval_oom_shrinks_only_the_eval_batch(tmp_path):
    kw = dict(eval_data=blobs(24, seed=1), eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=8)
    oom = make_loop(tmp_path, "oom", mlp(eval_limit=2), auto_find_batch_size=True, **kw)
    oom.train()
    ref = make_loop(tmp_path, "ref", mlp(), **kw)
    ref.train()

    evals = [h["eval_loss"] for h in oom.state.log_history if "eval_loss" in h]
    assert len(evals) == 2
    assert evals == pytest.approx(
        [h["eval_loss"] for h in ref.state.log_history if "eval_loss" in h], rel=1e-6
    )
    assert max_diff(weights(oom), weights(ref)) <= 1e-5
    assert oom.model.ooms == 2  # 8 and 4 failed in the first evaluation; the second ran at 2
    assert shrinks(oom, "eval_batch_size") == [(4, 4), (4, 2)]
    assert shrinks(oom) == []
    assert geometry(oom) == (16, 1, None) and oom.plugins.get(RUN).eval_size == 2
    assert set(oom.model.train_sizes()) == {16}
    assert oom.plugins.pm.get_plugin(RUN).state_dict() == {
        "train_micro_batch_size": None,
        "eval_batch_size": 2,
    }


def test_even_one_sample_does_not_fit_is_a_clear_error_and_keeps_the_checkpoint(tmp_path):
    hashes = {}

    class Snapshot:
        name = "snapshot"

        def on_save(self, checkpoint_dir):
            hashes.update(
                {
                    p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in checkpoint_dir.iterdir()
                    if p.is_file()
                }
            )

    def nothing_fits(loop):
        loop.backend.unwrap_model(loop.model).train_limit = 0

    torch.manual_seed(0)
    loop = make_loop(
        tmp_path,
        "out",
        LimitedLM(),
        train_data=tokens(64),
        save_strategy="steps",
        save_steps=2,
        auto_find_batch_size=True,
        plugins=[At(2, nothing_fits), Snapshot()],
    )
    with pytest.raises(TrainingError) as info:
        loop.train()
    msg = str(info.value)
    params = sum(p.numel() for p in loop.model.parameters())
    assert "even a training micro-batch of 1 sample does not fit" in msg
    assert f"{params:,} parameters" in msg and "sequence length 12" in msg
    assert "global_step 2" in msg and "untouched" in msg and str(tmp_path / "out") in msg
    assert shrinks(loop) == [(2, 8), (2, 4), (2, 2), (2, 1)]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]
    saved = out / "checkpoint-2"
    assert {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in saved.iterdir() if p.is_file()
    } == hashes


def test_found_size_is_saved_and_reused_on_resume(tmp_path):
    full = make_loop(
        tmp_path, "full", mlp(train_limit=4), auto_find_batch_size=True, save_strategy="steps", save_steps=4
    )
    full.train()
    ckpt = tmp_path / "full" / "checkpoint-4"
    state = json.loads((ckpt / "loop_state.json").read_text())
    assert (state["train_batch_size"], state["gradient_accumulation_steps"]) == (16, 1)
    assert json.loads((ckpt / "plugins.json").read_text())["auto_batch_size"]["train_micro_batch_size"] == 4

    resumed = make_loop(tmp_path, "resumed", mlp(seed=1, train_limit=4), auto_find_batch_size=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.train(resume_from_checkpoint=str(ckpt))
    assert not [w for w in caught if "geometry" in str(w.message)]  # same data order as before
    assert resumed.model.ooms == 0  # split from the first resumed step: no failed attempt
    assert set(resumed.model.train_sizes()) == {4}
    assert geometry(resumed) == (16, 1, 4)
    assert resumed.state.global_step == 8
    assert max_diff(weights(resumed), weights(full)) <= 1e-5


def test_installed_but_not_turned_on_changes_nothing(tmp_path):
    loop = make_loop(tmp_path, "off", mlp(train_limit=4))
    assert "auto_batch_size" in loop.plugins.info  # installed, loaded through its entry point
    assert RUN not in loop.plugins.info
    assert loop.plugins.provider_order("training_step") == ["builtin"]
    assert loop.plugins.inactive["auto_batch_size"] == "train.auto_find_batch_size = false"
    with pytest.raises(TrainingError, match="OutOfMemoryError"):
        loop.train()
    assert loop.model.train_sizes() == [16]

    with pytest.raises(
        ConfigError, match=r"\[auto_batch_size\] section, but train.auto_find_batch_size is false"
    ):
        make_loop(tmp_path, "section", mlp(), section={"probe": True})


def test_backend_that_cannot_change_accumulation_is_refused_at_start(tmp_path):
    class FixedAccumulation(AccelerateBackend):
        """Declares the capability corelooper-deepspeed's backend declares (its engine fixes GA
        at init): recognised by the flag, not by its module's name."""

        fixed_accumulation = True

    class Provider:
        name = "fixed-backend"

        def create_backend(self, loop):
            return FixedAccumulation()

    with pytest.raises(ConfigError) as info:
        make_loop(tmp_path, "x", mlp(), auto_find_batch_size=True, plugins=[Provider()])
    msg = str(info.value)
    assert "auto_find_batch_size" in msg and "FixedAccumulation" in msg and "fixed_accumulation" in msg
    # a backend of any module without the flag is not refused
    FixedAccumulation.fixed_accumulation = False
    FixedAccumulation.__module__ = "corelooper_deepspeed.backend"
    make_loop(tmp_path, "y", mlp(), auto_find_batch_size=True, plugins=[Provider()])


def test_probe_finds_the_size_before_training_and_leaves_no_trace(tmp_path):
    """Dropout makes the RNG matter: the run equals 4 x 4 only if the probe restored it."""
    probe = make_loop(
        tmp_path, "probe", mlp(dropout=0.3, train_limit=4), auto_find_batch_size=True, section={"probe": True}
    )
    probe.train()
    ref = make_loop(
        tmp_path, "ref", mlp(dropout=0.3), per_device_train_batch_size=4, gradient_accumulation_steps=4
    )
    ref.train()
    sizes = probe.model.train_sizes()
    assert sizes[:3] == [16, 8, 4]  # the probe: two fake OOMs, then one micro-batch that fits
    assert set(sizes[3:]) == {4} and len(sizes[3:]) == 8 * 4  # training never tried 16
    assert probe.model.ooms == 2
    assert max_diff(weights(probe), weights(ref)) <= 1e-5
    assert losses(probe) == pytest.approx(losses(ref), rel=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_where_only_one_rank_runs_out_of_memory(tmp_path):
    """Rank 1 alone hits the fake OOM (first at step 1, again mid-run at step 3 of 4); rank 0 never.

    Both ranks shrink together (16 -> 8 -> 4 micro-batches), nobody hangs, and the weights equal
    those of a run that never ran out of memory (one process, batch 32: the same samples). A third 2-process run with an FSDP-sharded
    model is refused at start-up on both ranks; with the start-up probe, rank 1 alone fails it
    and both ranks train with the size found. Runs ``accelerate.debug_launcher`` (2 real gloo
    processes) in a subprocess bounded by a timeout.
    """
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "auto_batch_two_ranks.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    oom0, oom1 = (json.loads((tmp_path / f"oom.rank{r}.json").read_text()) for r in (0, 1))
    # The reference: one process with batch 32 sees the samples of 2 processes x 16, no OOM.
    ref = make_loop(
        tmp_path, "ref", mlp(), train_data=blobs(128), num_train_epochs=1, per_device_train_batch_size=32
    )
    ref.train()
    assert [oom0["ooms"], oom1["ooms"]] == [0, 2]
    for res in (oom0, oom1):
        assert res["global_step"] == ref.state.global_step == 4
        assert (res["train_batch_size"], res["gradient_accumulation_steps"], res["micro_batch_size"]) == (
            16,
            1,
            4,
        )
        assert res["shrinks"] == [[0, 8], [2, 4]]
    w0, w1 = torch.tensor(oom0["weights"]), torch.tensor(oom1["weights"])
    wr = torch.cat([p.detach().flatten() for p in ref.model.parameters()])
    assert (w0 - w1).abs().max().item() == 0.0  # DDP: ranks hold the same weights
    assert (w0 - wr).abs().max().item() <= 1e-5
    assert oom0["losses"] == pytest.approx(losses(ref), rel=1e-5)
    probe0, probe1 = (json.loads((tmp_path / f"probe.rank{r}.json").read_text()) for r in (0, 1))
    assert [probe0["ooms"], probe1["ooms"]] == [0, 1]  # only rank 1 failed the probe at 16 ...
    for res in (probe0, probe1):  # ... and both ranks probed 8, then trained with 8 x 2
        assert res["shrinks"] == [[0, 8]] and res["micro_batch_size"] == 8
        assert res["train_sizes"] == [16, 8, 8, 8] and res["global_step"] == 1
    for r in (0, 1):  # an FSDP-sharded model is refused on every rank, before any step
        error = json.loads((tmp_path / f"fsdp.rank{r}.json").read_text())["error"]
        assert "sharded over 2 processes" in error and "auto_find_batch_size" in error


@pytest.mark.slow
def test_cli_run_with_probe_from_a_config_file(tmp_path):
    """The real CLI in a subprocess: [train] auto_find_batch_size and [auto_batch_size] probe."""

    def config(name: str, limit: int) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(
            f'[model]\nfactory = "{HERE / "auto_batch_toys.py"}:mlp"\nargs = {{ train_limit = {limit} }}\n'
            f'[data]\ntrain = "{HERE / "auto_batch_toys.py"}:blobs"\n'
            f'[train]\noutput_dir = "{tmp_path / name}"\nper_device_train_batch_size = 16\n'
            "max_steps = 2\nsave_steps = 2\nlogging_steps = 1\nauto_find_batch_size = true\n"
            "[auto_batch_size]\nprobe = true\n"
        )
        return path

    env = {**os.environ, "PYTHONHASHSEED": "0"}
    ok = subprocess.run(
        [sys.executable, "-m", "corelooper", "run", str(config("fits", 4))],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    records = [json.loads(line) for line in (tmp_path / "fits" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_micro_batch_size"] for r in records if "train_micro_batch_size" in r] == [8, 4]
    state = json.loads((tmp_path / "fits" / "checkpoint-2" / "loop_state.json").read_text())
    saved = json.loads((tmp_path / "fits" / "checkpoint-2" / "plugins.json").read_text())
    assert (state["global_step"], saved["auto_batch_size"]["train_micro_batch_size"]) == (2, 4)


def test_cut_keeps_samples_order_and_structure():
    from collections import namedtuple

    from corelooper_auto_batch_size.batches import cut, is_oom

    from corelooper.data.loader import tensor_rows as rows

    Pair = namedtuple("Pair", "x y")
    batch = {
        "input_ids": torch.arange(10).view(5, 2),
        "labels": torch.arange(5),
        "ids": ["a", "b", "c", "d", "e"],  # one entry per sample: cut too
        "scale": torch.tensor(2.0),  # not per sample: shared by every piece
        "pair": Pair(torch.arange(5), torch.zeros(5, 3)),
    }
    pieces = cut(batch, 2)
    assert [rows(p) for p in pieces] == [2, 2, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p in pieces]), batch["input_ids"])
    assert [p["ids"] for p in pieces] == [["a", "b"], ["c", "d"], ["e"]]
    assert all(p["scale"] is batch["scale"] for p in pieces)
    assert isinstance(pieces[2]["pair"], Pair) and pieces[2]["pair"].y.shape == (1, 3)
    assert cut(batch, 5) == [batch]
    tup = (torch.arange(6).view(3, 2), torch.arange(3))
    assert [tuple(t.tolist() for t in p) for p in cut(tup, 2)] == [
        ([[0, 1], [2, 3]], [0, 1]),
        ([[4, 5]], [2]),
    ]
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory")) and is_oom(
        RuntimeError("CUDA error: out of memory")
    )
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))


class MeanLoss:
    """A compute_loss provider that returns a mean (it does not take num_items_in_batch); it
    records d(backpropagated loss)/d(its loss): 1/micro-batches per step under the sum/mean rule."""

    name = "mean_loss"

    def __init__(self):
        self.scales: list[float] = []

    def compute_loss(self, model, batch):
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])
        if loss.requires_grad:
            loss.register_hook(lambda g: self.scales.append(g.item()))
        return loss


def test_the_probe_applies_the_steps_sum_mean_rule_to_a_mean_loss(tmp_path):
    """The probe's forward/backward goes through the dispatcher as the step's does: a mean loss
    is divided by the step's micro-batches there too (it was backpropagated whole)."""
    plugin = MeanLoss()
    loop = make_loop(
        tmp_path,
        "probe-mean",
        mlp(),
        auto_find_batch_size=True,
        section={"probe": True},
        plugins=[plugin],
        max_steps=1,
        gradient_accumulation_steps=2,
    )
    loop.train()
    assert plugin.scales == [0.5, 0.5, 0.5]  # the probe, then the step's two micro-batches


class NextStep:
    """A training_step provider asked after auto batch size (whose per-run object is registered
    later, by corelooper_configure) and before the builtin; it calls the next one itself."""

    name = "next_step"

    def __init__(self):
        self.sizes: list[list[int]] = []

    def training_step(self, loop, micro_batches):
        self.sizes.append([len(b["labels"]) for b in micro_batches])
        return loop.plugins.call_next("training_step", self, loop=loop, micro_batches=micro_batches)[0]


def test_auto_batch_size_retries_the_next_training_step_provider_not_the_builtin_directly(tmp_path):
    nxt = NextStep()
    oom = make_loop(
        tmp_path, "next", mlp(train_limit=4), auto_find_batch_size=True, plugins=[nxt], max_steps=2
    )
    assert oom.plugins.provider_order("training_step") == [RUN, "next_step", "builtin"]
    oom.train()
    assert nxt.sizes == [[16], [8, 8], [4, 4, 4, 4], [4, 4, 4, 4]]  # step 1: two OOMs, then 4 x 4
    assert oom.model.ooms == 2


@pytest.mark.parametrize("probe", [False, True])
def test_a_smaller_micro_batch_also_holds_fewer_inputs_on_the_device(tmp_path, probe):
    """On a GPU the step's inputs take device memory too. When every micro-batch of the step was
    moved before the first forward, halving the micro-batch left all 16 samples' inputs on the
    device, and only the activations shrank: a budget that 4 x 4 fits could look full at every
    size (the H200's real-OOM run went 64 -> 1). The fake OOM here counts both: the rows of the
    inputs alive on the "device" plus the forward's own rows (its activations). A second device
    cannot exist here: a backend whose ``to_device`` copies, as a move does, stands in for it."""
    import weakref

    from auto_batch_toys import OOM, LimitedMLP

    from corelooper.backends.local import LocalBackend

    alive: list = []

    class CopyingBackend(LocalBackend):
        def to_device(self, batch):
            moved = {k: v.clone() for k, v in batch.items()}
            alive.append(weakref.ref(moved["x"]))
            return moved

    class Provider:
        name = "copying-backend"

        def create_backend(self, loop):
            return CopyingBackend(torch.device("cpu"))

    class DeviceBudget(LimitedMLP):
        """Fits while the rows of the inputs on the device plus this forward's rows are <= 10."""

        def _too_big(self, rows: int) -> bool:
            self.sizes.append((self.training, rows))
            inputs = sum(x().shape[0] for x in alive if x() is not None)
            if self.training and inputs + rows > 10:
                self.ooms += 1
                raise OOM(f"CUDA out of memory (FAKE: {inputs} input rows + {rows} activation rows > 10)")
            return False

    torch.manual_seed(0)
    oom = make_loop(
        tmp_path,
        "oom",
        DeviceBudget(),
        auto_find_batch_size=True,
        plugins=[Provider()],
        section={"probe": probe},
    )
    oom.train()
    ref = make_loop(tmp_path, "ref", mlp(), per_device_train_batch_size=4, gradient_accumulation_steps=4)
    ref.train()
    assert shrinks(oom) == [(0, 8), (0, 4)]  # 16 + 16 and 8 + 8 do not fit, 4 + 4 does
    assert oom.model.ooms == 2  # and with the probe, training found nothing left to shrink
    assert geometry(oom) == (16, 1, 4)
    assert oom.state.global_step == ref.state.global_step == 8
    assert max_diff(weights(oom), weights(ref)) <= 1e-5
