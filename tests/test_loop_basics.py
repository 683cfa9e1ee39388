"""The loop's contract: seeds, step counting, logging, evaluation, schedulers, AdamW groups."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import toys
from torch import nn

from corelooper import hookimpl
from corelooper.config import Config
from corelooper.loop import Loop

TOYS = Path(toys.__file__).resolve()


def blobs_config(tmp_path: Path, name: str, **train) -> Config:
    return Config.from_dict(
        {
            "model": {"factory": f"{TOYS}:mlp", "args": {"hidden": 16}},
            "data": {"train": f"{TOYS}:blobs_train", "eval": f"{TOYS}:blobs_eval"},
            "train": {
                "output_dir": str(tmp_path / name),
                "save_strategy": "no",
                "disable_tqdm": True,
                "num_train_epochs": 2,
                "per_device_train_batch_size": 8,
                "logging_steps": 1,
                "learning_rate": 1e-2,
                **train,
            },
        }
    )


def jsonl_losses(output_dir: str) -> list[float]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [rec["loss"] for rec in map(json.loads, lines) if "loss" in rec]


def test_same_seed_same_losses_other_seed_other_losses(tmp_path):
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        cfg = blobs_config(tmp_path, name, seed=seed)
        Loop(config=cfg, blocked_plugins=["console"]).train()
        runs[name] = jsonl_losses(cfg.train.output_dir)
    assert len(runs["a"]) == 16
    assert runs["a"] == runs["b"]  # bit-identical, read back from metrics.jsonl
    assert runs["a"] != runs["c"]


def test_max_steps_wins_over_epochs(train_args):
    data = toys.Blobs(64)
    loop = Loop(toys.mlp(), train_args(num_train_epochs=100, max_steps=5), train_dataset=data)
    assert loop.train().global_step == 5
    assert loop.state.epoch == pytest.approx(5 / 8)
    loop = Loop(
        toys.mlp(),
        train_args(num_train_epochs=1.5, output_dir=loop.args.output_dir + "2"),
        train_dataset=data,
    )
    assert loop.train().global_step == 12  # 8 steps per epoch x 1.5
    # max_steps beyond one epoch keeps going into the next epochs
    loop = Loop(
        toys.mlp(),
        train_args(num_train_epochs=1, max_steps=11, output_dir=loop.args.output_dir + "3"),
        train_dataset=data,
    )
    assert loop.train().global_step == 11 and loop.state.epoch == pytest.approx(11 / 8)


def test_evaluate_returns_eval_loss_and_prefixed_metrics(train_args):
    model = toys.mlp()
    data = toys.Blobs(23, seed=4)  # batches of 5: the last has 3 samples
    loop = Loop(
        model, train_args(per_device_eval_batch_size=5), eval_dataset=data, compute_metrics=toys.accuracy
    )
    metrics = loop.evaluate()
    with torch.no_grad():
        logits = model(data.x)
    assert set(metrics) == {"eval_loss", "eval_accuracy"}
    assert metrics["eval_loss"] == pytest.approx(F.cross_entropy(logits, data.y).item(), abs=1e-6)
    assert metrics["eval_accuracy"] == pytest.approx((logits.argmax(-1) == data.y).float().mean().item())
    assert loop.evaluate(metric_key_prefix="test").keys() == {"test_loss", "test_accuracy"}
    assert loop.state.log_history[0]["eval_loss"] == metrics["eval_loss"]

    preds, labels, pm = loop.predict(data)
    assert torch.allclose(preds, logits, atol=1e-6) and torch.equal(labels, data.y)
    assert pm["test_loss"] == metrics["eval_loss"]


class StepRecorder:
    """Each optimizer step's loss (sum of its normalised micro-batch losses), grad norm and LR."""

    name = "step_recorder"

    def __init__(self):
        self.losses, self.norms, self.lrs, self._loss = [], [], [], 0.0

    def on_before_backward(self, loss):
        self._loss += loss.item()

    def on_pre_optimizer_step(self, loop, optimizer):
        grads = [p.grad.flatten() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.norms.append(torch.cat(grads).norm().item())
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_step_end(self):
        self.losses.append(self._loss)
        self._loss = 0.0


def test_logging_window_averages_and_fields(train_args):
    rec = StepRecorder()
    args = train_args(
        logging_steps=3,
        max_steps=7,
        max_grad_norm=1e6,
        per_device_train_batch_size=8,
        lr_scheduler_type="linear",
        warmup_steps=2,
        learning_rate=0.1,
    )
    loop = Loop(toys.mlp(), args, train_dataset=toys.Blobs(64), plugins=[rec])
    loop.train()
    logs = [h for h in loop.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [3, 6, 7]  # every logging_steps, and the last step
    windows = [rec.losses[0:3], rec.losses[3:6], rec.losses[6:7]]
    for h, window in zip(logs, windows, strict=True):
        assert h["loss"] == pytest.approx(sum(window) / len(window), abs=2e-6)
        step = h["step"]
        assert h["grad_norm"] == pytest.approx(rec.norms[step - 1], rel=1e-5)
        # the LR this step used (as HF logs it since PR #36973): linear warmup 2, decay to 0 at 7
        done = step - 1  # scheduler steps before this step
        expected_lr = 0.1 * (done / 2 if done < 2 else max(0.0, (7 - done) / 5))
        assert h["learning_rate"] == pytest.approx(expected_lr)
        assert h["learning_rate"] == pytest.approx(rec.lrs[step - 1])
        assert h["epoch"] == pytest.approx(step / 8, abs=1e-4)
        assert h["samples_per_second"] > 0
    assert rec.lrs[:3] == pytest.approx([0.0, 0.05, 0.1])  # warmup, then decay
    summary = loop.state.log_history[-1]
    # the mean over all 7 steps (as HF), not the mean of the 3 unequal windows
    assert summary["train_loss"] == pytest.approx(sum(rec.losses) / 7, abs=2e-6)
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second"} <= set(summary)


def test_token_inputs_log_tokens_per_second(train_args):
    loop = Loop(
        toys.tiny_lm(),
        train_args(max_steps=2, logging_steps=2, per_device_train_batch_size=4),
        train_dataset=toys.lm_samples(8),
    )
    loop.train()
    (log,) = [h for h in loop.state.log_history if "loss" in h]
    assert log["tokens_per_second"] > 0
    assert loop.state.num_input_tokens_seen == 8 * toys.SEQ_LEN


def reference_lambda(kind: str, warmup: int, total: int):
    """HF's formulas (transformers.optimization), written out."""

    def f(step: int) -> float:
        if kind == "constant":
            return 1.0
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant_with_warmup":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine, half a cycle

    return f


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize(("warmup", "warmup_steps"), [(3, 3), (0.2, 4), (0, 0)])
def test_schedulers_match_hf_formulas(train_args, kind, warmup, warmup_steps):
    total, lr = 20, 0.1
    loop = Loop(toys.mlp(), train_args(lr_scheduler_type=kind, warmup_steps=warmup, learning_rate=lr))
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=lr)
    sched = loop.hook.create_scheduler(loop=loop, optimizer=opt, num_training_steps=total)
    got = []
    for _ in range(total + 1):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ref = reference_lambda(kind, warmup_steps, total)
    assert got == pytest.approx([lr * ref(s) for s in range(total + 1)], abs=1e-12)

    from transformers import get_scheduler

    hf_opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=lr)
    hf = get_scheduler(kind, hf_opt, num_warmup_steps=warmup_steps, num_training_steps=total)
    hf_lrs = []
    for _ in range(total + 1):
        hf_lrs.append(hf_opt.param_groups[0]["lr"])
        hf_opt.step()
        hf.step()
    assert got == pytest.approx(hf_lrs, abs=1e-12)


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = RMSNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3, bias=False)


def test_adamw_has_no_weight_decay_on_biases_and_norm_weights_by_hfs_rule(train_args):
    """HF's get_decay_parameter_names: nn.LayerNorm parameters and names with bias/norm words;
    a norm layer of another type is told by its name only (``rms``, ``bn``: decayed, as in HF)."""
    model = Mixed()
    loop = Loop(model, train_args(weight_decay=0.1))
    opt = loop.hook.create_optimizer(loop=loop, model=model)
    assert isinstance(opt, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    by_decay = {}
    for group in opt.param_groups:
        by_decay.setdefault(group["weight_decay"], set()).update(names[id(p)] for p in group["params"])
    assert by_decay[0.1] == {"embed.weight", "proj.weight", "head.weight", "rms.weight", "bn.weight"}
    assert by_decay[0.0] == {"proj.bias", "ln.weight", "ln.bias", "bn.bias"}
    assert opt.defaults["lr"] == loop.args.learning_rate


def test_config_built_in_python_trains_like_the_toml_file(tmp_path):
    cfg = blobs_config(tmp_path, "py", max_steps=4)
    path = tmp_path / "config.toml"
    cfg.write(path)
    from_file = Config.load(path)
    assert from_file.to_dict() == cfg.to_dict()
    Loop(config=cfg, blocked_plugins=["console"]).train()
    from_file = from_file.replace("train", output_dir=str(tmp_path / "toml"))
    Loop(config=from_file, blocked_plugins=["console"]).train()
    assert jsonl_losses(str(tmp_path / "py")) == jsonl_losses(str(tmp_path / "toml"))
    # and the resolved config written to output_dir is this config
    assert Config.load(tmp_path / "py" / "config.toml").to_dict() == cfg.to_dict()


def test_clipping_happens_before_on_pre_optimizer_step_and_grads_are_freed(train_args):
    rec = StepRecorder()
    freed = []

    class AfterStep:
        name = "after_step"

        def on_step_end(self, loop):
            freed.append(all(p.grad is None for p in loop.model.parameters()))

    args = train_args(max_steps=3, max_grad_norm=0.01, logging_steps=1, per_device_train_batch_size=8)
    loop = Loop(toys.mlp(), args, train_dataset=toys.Blobs(64), plugins=[rec, AfterStep()])
    loop.train()
    assert rec.norms == pytest.approx([0.01] * 3, rel=1e-4)  # clipped before the hook saw them
    logged = [h["grad_norm"] for h in loop.state.log_history if "grad_norm" in h]
    assert len(logged) == 3 and min(logged) > 0.05  # the norm before clipping is what is logged
    assert freed == [True] * 3  # zero_grad(set_to_none=True)


def test_bf16_mixed_precision_through_the_backend(train_args):
    model = toys.mlp()
    dtypes = []
    model.net[0].register_forward_hook(lambda mod, inputs, output: dtypes.append(output.dtype))
    loop = Loop(
        model,
        train_args(max_steps=3, mixed_precision="bf16", per_device_train_batch_size=16),
        train_dataset=toys.Blobs(64),
        blocked_plugins=["console"],
    )
    loop.train()
    assert dtypes == [torch.bfloat16] * 3  # autocast: matmuls in bf16
    assert next(loop.model.parameters()).dtype == torch.float32  # master weights stay fp32
    losses = [h["loss"] for h in loop.state.log_history if "loss" in h]
    assert all(math.isfinite(x) for x in losses) and len(losses) == 3


def test_fp16_on_cpu_is_a_clear_config_error(train_args):
    from corelooper.errors import ConfigError

    with pytest.raises(ConfigError, match=r'train.mixed_precision = "fp16" needs a CUDA device'):
        Loop(toys.mlp(), train_args(mixed_precision="fp16"))


def test_control_should_evaluate_from_a_plugin(train_args):
    evaluated = []

    class AskEval:
        name = "ask_eval"

        def on_step_end(self, state, control):
            if state.global_step == 2:
                control.should_evaluate = True

        def on_evaluate(self, state, metrics):
            evaluated.append((state.global_step, sorted(metrics)))

    loop = Loop(
        toys.mlp(),
        train_args(max_steps=4, per_device_train_batch_size=16),
        train_dataset=toys.Blobs(64),
        eval_dataset=toys.Blobs(8),
        plugins=[AskEval()],
    )
    loop.train()
    assert evaluated == [(2, ["eval_loss"])]


def test_metrics_jsonl_is_written_line_by_line_and_closed_at_the_end(tmp_path):
    """The jsonl plugin keeps its file open during training (no open/close per log): every
    record is on disk as soon as it is logged, the file is closed at on_train_end, and a later
    evaluate() appends to it again."""
    cfg = blobs_config(tmp_path, "run", num_train_epochs=1)
    path = Path(cfg.train.output_dir) / "metrics.jsonl"
    seen_on_disk = []

    class ReadBack:
        name = "read_back"

        @hookimpl(trylast=True)  # after the jsonl plugin has written this record
        def on_log(self, state, logs):
            seen_on_disk.append(len(path.read_text().splitlines()))

    loop = Loop(config=cfg, plugins=[ReadBack()], blocked_plugins=["console"])
    loop.train()
    assert seen_on_disk == list(range(1, len(seen_on_disk) + 1))  # each line there when logged
    assert loop.plugins.get("jsonl").file is None  # closed at on_train_end
    loop.evaluate()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[-1]["event"] == "eval" and len(records) == len(seen_on_disk)
    assert [r["event"] for r in records].count("log") == 9  # 8 steps and the run summary


class SlowEvaluation:
    """An evaluation that takes 1,000 s on the loop's clock, so a window that counted it would log
    under 1 sample/s."""

    def __init__(self, clock):
        self.clock = clock

    @hookimpl
    def on_evaluate(self):
        self.clock.now += 1000.0


class ManualClock:
    """The loop's ``time.perf_counter``, read off a counter: each read moves it ``tick`` seconds,
    so the rates below come from counted reads, not from this machine's speed."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


def test_the_window_rate_leaves_out_evaluation_saving_and_steps_before_a_resume(tmp_path, monkeypatch):
    """samples_per_second is the window's training speed: an evaluation or a save in the window is
    not training time, and after a resume the checkpointed window's samples were not timed here."""
    import time
    import types

    from corelooper import logwindow
    from corelooper import loop as loop_module

    clock = ManualClock(tick=0.001)
    fake_time = types.SimpleNamespace(
        perf_counter=clock.perf_counter, time=time.time, monotonic=time.monotonic, sleep=time.sleep
    )
    monkeypatch.setattr(logwindow, "time", fake_time)
    monkeypatch.setattr(loop_module, "time", fake_time)
    config = blobs_config(
        tmp_path,
        "run",
        logging_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        max_steps=8,
        save_strategy="steps",
        save_steps=2,
    )
    with Loop(config=config, plugins=[SlowEvaluation(clock)]) as loop:
        loop.train()
        rates = [h["samples_per_second"] for h in loop.state.log_history if "loss" in h]
    assert len(rates) == 2 and min(rates) > 1.0, (
        rates
    )  # 8 samples per step: far over 1/s unless 1,000 s counted
    clock.tick = 0.0  # the clock moves only when told
    window = logwindow.LogWindow("cpu")
    window.load_state_dict({"loss": 1.0, "steps": 3, "samples": 10**9, "tokens": 0})  # a resumed window
    window.add(torch.tensor(1.0), 8, 0)
    clock.now += 1.0  # one second of training in this process
    logs = window.logs(types.SimpleNamespace(reduce_mean=lambda t: t), None, 0.1, 1.0)
    assert logs["samples_per_second"] == 8.0  # not 10**9 + 8


class WithWeights(torch.utils.data.Dataset):
    """Blobs with a ``weight`` column the MLP's forward does not take."""

    def __init__(self):
        self.blobs = toys.Blobs(16)

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, i):
        return {**self.blobs[i], "weight": torch.tensor(1.0)}


class WeightedLoss:
    """A compute_loss plugin for training (it reads the batch's ``weight`` column itself); the
    builtin loss evaluates, as in examples/sft_chat."""

    @hookimpl
    def compute_loss(self, loop, model, batch, num_items_in_batch, return_outputs):
        if not model.training:
            return None
        logits = model(batch["x"])
        loss = (F.cross_entropy(logits, batch["labels"], reduction="none") * batch["weight"]).mean()
        return (loss, logits) if return_outputs else loss


def test_a_dropped_column_is_a_warning_unless_a_loss_plugin_reads_the_batch(train_args, caplog, tmp_path):
    """The model's forward does not take ``weight``: said as a warning (a user's column the model
    never sees); with a compute_loss plugin, which sees every column, a note at INFO (as HF logs it),
    not a warning in the middle of the first evaluation."""
    import logging

    for plugins, level in (([], logging.WARNING), ([WeightedLoss()], logging.INFO)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="corelooper"):
            args = train_args(
                max_steps=2, per_device_train_batch_size=8, output_dir=str(tmp_path / str(level))
            )
            loop = Loop(
                toys.mlp(), args, train_dataset=WithWeights(), eval_dataset=WithWeights(), plugins=plugins
            )
            loop.train()
            loop.evaluate()
        notes = [r for r in caplog.records if "are not arguments of MLP.forward" in r.getMessage()]
        assert [r.levelno for r in notes] == [level], [(r.levelname, r.getMessage()) for r in notes]
