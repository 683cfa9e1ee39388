"""The HF Trainer divergences of issue 27, each compared with the real ``transformers.Trainer``
(5.24) on the same inputs, as tests/test_hf_oracle.py does: Adafactor, the logged epoch, the
gradient norm without clipping, the no-decay parameter names, and HF ``TrainingArguments``
passed as they are."""

from __future__ import annotations

import copy

import pytest
import torch
import toys
from torch import nn

transformers = pytest.importorskip("transformers")
from test_hf_oracle import Regression, cl_loop, hf_trainer, regression_data  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from corelooper import TrainArgs  # noqa: E402
from corelooper.errors import ConfigError  # noqa: E402


def _train_logs(history):
    return [h for h in history if "loss" in h]


def test_adafactor_is_hfs_adafactor_over_8_steps(tmp_path):
    """optim = "adafactor": transformers' Adafactor(scale_parameter=False, relative_step=False)
    with the run's learning rate and weight decay, as HF builds it: the same losses and weights
    (torch.optim.Adafactor, built before, differed by 0.15 in the loss after 8 steps)."""
    data = toys.lm_samples(32, seed=3)
    hf_model = toys.tiny_llama(seed=1)
    cl_model, initial = copy.deepcopy(hf_model), copy.deepcopy(hf_model)
    kw = dict(
        per_device_train_batch_size=4,
        max_steps=8,
        learning_rate=1e-2,
        weight_decay=0.1,
        optim="adafactor",
        logging_steps=1,
        save_strategy="no",
        max_grad_norm=1.0,
    )
    hf = hf_trainer(hf_model, tmp_path / "hf", data, **kw)
    hf.train()
    loop = cl_loop(cl_model, tmp_path / "cl", data, **kw)
    loop.train()
    assert type(loop.optimizer.optimizer if hasattr(loop.optimizer, "optimizer") else loop.optimizer) is type(
        hf.optimizer.optimizer
    )
    hf_logs, cl_logs = _train_logs(hf.state.log_history), _train_logs(loop.state.log_history)
    assert len(hf_logs) == len(cl_logs) == 8
    for h, c in zip(hf_logs, cl_logs, strict=True):
        assert c["loss"] == pytest.approx(h["loss"], abs=1e-5), (h, c)
        assert c["grad_norm"] == pytest.approx(h["grad_norm"], rel=1e-5), (h, c)
    hf_params = dict(hf_model.named_parameters())
    moved = max((p - hf_params[n]).abs().max().item() for n, p in initial.named_parameters())
    assert moved > 1e-3  # it trained
    for name, p in loop.backend.unwrap_model(loop.model).named_parameters():
        assert torch.allclose(p.detach(), hf_params[name].detach(), atol=1e-6), name


@pytest.mark.parametrize(
    ("samples", "batch", "ga", "epochs"),
    [
        (10, 2, 2, 1),  # 5 micro-batches an epoch, GA 2: HF logs 0.4, 0.8, 1.0
        (10, 2, 2, 2),
        (7, 2, 3, 2),
        (9, 1, 4, 1),
        (12, 4, 2, 2),  # even: the same either way
    ],
)
def test_logged_epoch_counts_micro_batches_as_hf(tmp_path, samples, batch, ga, epochs):
    data = regression_data(samples)
    hf_model = Regression()
    cl_model = copy.deepcopy(hf_model)
    kw = dict(
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga,
        num_train_epochs=epochs,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        optim="adamw_torch",
    )
    hf = hf_trainer(hf_model, tmp_path / "hf", data, **kw)
    hf.train()
    loop = cl_loop(cl_model, tmp_path / "cl", data, **kw)
    loop.train()
    hf_epochs = [h["epoch"] for h in _train_logs(hf.state.log_history)]
    cl_epochs = [h["epoch"] for h in _train_logs(loop.state.log_history)]
    assert cl_epochs == pytest.approx(hf_epochs, abs=1e-4)  # corelooper rounds to 4 digits
    if (samples, batch, ga) == (10, 2, 2):
        assert cl_epochs[:3] == [0.4, 0.8, 1.0]
    hf_summary, cl_summary = hf.state.log_history[-1], loop.state.log_history[-1]
    assert "train_loss" in hf_summary and "train_loss" in cl_summary
    assert cl_summary["epoch"] == pytest.approx(hf_summary["epoch"]) == epochs


def test_max_grad_norm_none_is_refused_never_clipped_at_1():
    with pytest.raises(ConfigError) as info:
        TrainArgs(max_grad_norm=None)
    text = str(info.value)
    assert text.startswith("train.max_grad_norm = None") and "Use 0 for no clipping" in text
    with pytest.raises(ConfigError, match=r"train.max_grad_norm = None"):
        TrainArgs.from_hf({"max_grad_norm": None})


def test_max_grad_norm_0_logs_the_grad_norm_as_hf(tmp_path):
    """HF 5.24 logs grad_norm without clipping too (it computes the norm unclipped)."""
    data = toys.lm_samples(16, seed=5)
    hf_model = toys.tiny_llama(seed=1)
    cl_model = copy.deepcopy(hf_model)
    kw = dict(
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        max_grad_norm=0.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
    )
    hf = hf_trainer(hf_model, tmp_path / "hf", data, **kw)
    hf.train()
    for policy in ("stop", "ignore"):
        loop = cl_loop(copy.deepcopy(cl_model), tmp_path / f"cl-{policy}", data, on_nonfinite=policy, **kw)
        loop.train()
        hf_logs, cl_logs = _train_logs(hf.state.log_history), _train_logs(loop.state.log_history)
        assert len(hf_logs) == len(cl_logs) == 4
        for h, c in zip(hf_logs, cl_logs, strict=True):
            assert "grad_norm" in h and "grad_norm" in c, (h, c)
            assert c["grad_norm"] == pytest.approx(h["grad_norm"], rel=1e-6), (h, c)
            assert c["loss"] == pytest.approx(h["loss"], abs=1e-6)
        assert max(h["grad_norm"] for h in hf_logs) > 1.0  # a clip at 1.0 would have changed the run


class _RMSNorm(nn.Module):  # a custom norm layer, as many model repositories write one
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


class _Odd(nn.Module):
    """Module and parameter names where a type or substring rule and HF's rule disagree."""

    def __init__(self):
        super().__init__()
        self.query_bias_proj = nn.Linear(4, 4)
        self.final_layernorm_scale = nn.Parameter(torch.ones(4))
        self.ln = nn.RMSNorm(4)
        self.ln_f = nn.LayerNorm(4)
        self.block = nn.ModuleDict(
            {
                "input_layernorm": _RMSNorm(4),
                "attn_norm": _RMSNorm(4),
                "norm": nn.GroupNorm(2, 4),
                "normalizer": nn.Linear(4, 4),
                "q_norm_proj": nn.Linear(4, 4),
            }
        )
        self.bn = nn.BatchNorm1d(4)
        self.RMSNorm_gain = nn.Parameter(torch.ones(4))
        self.norm = nn.Linear(4, 4)
        self.embed = nn.Embedding(10, 4)


def test_no_decay_parameter_names_are_hfs():
    from corelooper.hf.optimizers import no_decay_parameter_names, parameter_groups

    model = _Odd()
    names = {n for n, _ in model.named_parameters()}
    hf_decay = set(Trainer.get_decay_parameter_names(None, model))  # self is not used
    assert names - no_decay_parameter_names(model) == hf_decay
    # the names of the issue, on both sides of the rule
    assert {"ln.weight", "bn.weight", "block.normalizer.weight", "embed.weight"} <= hf_decay
    assert (
        not {
            "query_bias_proj.weight",
            "final_layernorm_scale",
            "ln_f.weight",
            "block.attn_norm.weight",
            "norm.weight",
            "RMSNorm_gain",
        }
        & hf_decay
    )
    groups = parameter_groups(model, weight_decay=0.1)
    by_id = {id(p): n for n, p in model.named_parameters()}
    decayed = {by_id[id(p)] for g in groups if g["weight_decay"] for p in g["params"]}
    assert decayed == hf_decay


def test_trainargs_takes_training_arguments_as_they_are(tmp_path):
    """An HF script's TrainingArguments (or its to_dict()) moves over as it is."""
    hf_default = TrainingArguments(output_dir=str(tmp_path / "a"))
    ours = TrainArgs(**hf_default.to_dict())
    assert ours.output_dir == str(tmp_path / "a") and ours.learning_rate == hf_default.learning_rate
    assert ours.optim == "adamw_torch_fused" and not ours.reports_to("tensorboard")  # report_to=[]
    assert any("logging_nan_inf_filter" in n for n in ours.notes)
    assert TrainArgs.from_hf(hf_default) == ours

    hf = TrainingArguments(
        output_dir=str(tmp_path / "b"),
        bf16=True,
        eval_strategy="steps",
        eval_steps=5,
        optim="adafactor",
        lr_scheduler_type="cosine",
        lr_scheduler_kwargs='{"num_cycles": 2}',
        report_to="none",
        max_grad_norm=0.3,
        gradient_accumulation_steps=4,
        warmup_steps=0.1,
        seed=7,
        use_cpu=True,
        per_device_train_batch_size=2,
        weight_decay=0.01,
        logging_steps=3,
        save_total_limit=2,
    )
    args = TrainArgs.from_hf(hf)
    assert (args.mixed_precision, args.eval_strategy, args.eval_steps, args.optim) == (
        "bf16",
        "steps",
        5,
        "adafactor",
    )
    assert args.lr_scheduler_type == "cosine" and args.lr_scheduler_kwargs == {"num_cycles": 2}
    assert (args.max_grad_norm, args.gradient_accumulation_steps, args.warmup_steps, args.seed) == (
        0.3,
        4,
        0.1,
        7,
    )
    assert (
        args.per_device_train_batch_size,
        args.weight_decay,
        args.logging_steps,
        args.save_total_limit,
    ) == (2, 0.01, 3, 2)
    assert TrainArgs(**hf.to_dict()) == args
    assert TrainArgs.from_hf(hf, output_dir=str(tmp_path / "c")).output_dir == str(tmp_path / "c")
    # JSON text for a dict field, as HF reads it; a value corelooper does not do is still refused
    assert TrainArgs(lr_scheduler_kwargs='{"num_cycles": 3}').lr_scheduler_kwargs == {"num_cycles": 3}
    with pytest.raises(ConfigError, match=r"train.push_to_hub = True: Hub upload is not built in"):
        TrainArgs.from_hf(TrainingArguments(output_dir=str(tmp_path / "d"), push_to_hub=True))
    with pytest.raises(ConfigError, match=r"train.accelerator_config = .*create_backend"):
        TrainArgs.from_hf({**hf.to_dict(), "accelerator_config": {"split_batches": True}})


class _MeanLossLM(toys.TinyLM):
    """Takes labels, returns its own mean loss, takes no num_items_in_batch (no loss kwargs)."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = super().forward(input_ids, attention_mask)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        return {"loss": loss, "logits": logits}


def test_token_share_weighting_for_models_without_loss_kwargs_is_the_documented_difference(tmp_path):
    """docs/hooks.md: corelooper weighs such a model's mean by its batch's share of the step's
    tokens (GA equals the big batch); HF divides by gradient_accumulation_steps (it does not)."""
    data = toys.lm_samples(16, seed=4)
    torch.manual_seed(2)
    base = _MeanLossLM()
    kw = dict(
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        max_grad_norm=0.0,
        optim="adamw_torch",
    )
    runs = {}
    for name, batch, ga in (("big", 8, 1), ("ga", 2, 4)):
        hf = hf_trainer(
            copy.deepcopy(base),
            tmp_path / f"hf-{name}",
            data,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=ga,
            **kw,
        )
        hf.train()
        loop = cl_loop(
            copy.deepcopy(base),
            tmp_path / f"cl-{name}",
            data,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=ga,
            **kw,
        )
        loop.train()
        runs[name] = (
            [h["loss"] for h in _train_logs(hf.state.log_history)],
            [h["loss"] for h in _train_logs(loop.state.log_history)],
        )
    (hf_big, cl_big), (hf_ga, cl_ga) = runs["big"], runs["ga"]
    assert cl_big == pytest.approx(hf_big, abs=1e-6)  # one micro-batch: the same
    assert cl_ga == pytest.approx(cl_big, abs=1e-5)  # corelooper: GA is the big batch
    assert max(abs(a - b) for a, b in zip(hf_ga, hf_big, strict=True)) > 1e-3  # HF: it is not
