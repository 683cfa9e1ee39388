"""Evaluation with a per-position metric: the output layer a slice of rows at a time.

Oracles: the real HF model's own forward on the same batch (its ``loss``, with labels, and its
full ``logits`` through the metric's preprocessing), and ``transformers.Trainer.evaluate`` with
``preprocess_logits_for_metrics`` argmax for the whole ``Loop.evaluate()``. Tolerances as
``test_trained_head.py`` (1e-6, float32).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from corelooper_lm import sliced_head, trained_head
from corelooper_lm.metrics import TokenAccuracy
from corelooper_lm.sliced_head import preprocessed_loss
from test_trained_layer import LAYOUTS, VOCAB, layout, make, segments

from corelooper import Config, Loop, TrainArgs
from corelooper.outputs import PAD, LogitsWanted, Preprocessed

transformers = pytest.importorskip("transformers")
ROWS = 64  # rows per slice in these tests (the fewest the slicing takes)


def top2(logits):
    return logits.topk(2, dim=-1).indices


def head_inputs(monkeypatch, head):
    """The number of rows of each call of ``head``'s own forward (slices included)."""
    rows: list[int] = []
    own = type(head).forward

    def forward(self, x, *args, **kwargs):
        if self is head:
            rows.append(x.shape[:-1].numel())
        return own(self, x, *args, **kwargs)

    monkeypatch.setattr(type(head), "forward", forward)
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("counted_only", [True, False], ids=["counted", "every"])
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_sliced_loss_and_predictions_equal_the_models_own(monkeypatch, family, name, counted_only):
    monkeypatch.setattr(trained_head, "EVAL_CHUNK_BYTES", 4 * VOCAB * ROWS)
    monkeypatch.setattr(sliced_head, "PIECE_POSITIONS", 10**9)  # one forward per batch (pieces: below)
    model = make(family, 2)
    batch = layout(model, name, segments(160, seed=3, turns=3))[0]
    model.eval()
    with torch.no_grad():
        own = model(**batch)
        rows = head_inputs(monkeypatch, model.get_output_embeddings())
        loss, answer = preprocessed_loss(model, batch, None, 0.0, LogitsWanted(top2, counted_only))
    counted = trained_head.causal_targets(batch) != -100
    assert abs(loss.item() - own.loss.item()) <= 1e-6 and own.loss.item() > 1.0
    assert isinstance(answer, Preprocessed) and answer.predictions.shape == (*counted.shape, 2)
    expected = top2(own.logits)
    if counted_only:
        assert torch.equal(answer.predictions[counted], expected[counted])
        assert (answer.predictions[~counted] == PAD).all()
    else:
        assert torch.equal(answer.predictions, expected)
    wanted_rows = int(counted.sum()) if counted_only else counted.numel()
    assert wanted_rows > ROWS  # more than one slice
    assert rows[0] == 1 and max(rows[1:]) == ROWS and sum(rows[1:]) == wanted_rows  # the probe, then slices


def forward_lengths(model) -> list[int]:
    """The positions of each forward of ``model``'s decoder."""
    lengths: list[int] = []
    model.get_decoder().register_forward_pre_hook(
        lambda m, args, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    return lengths


@pytest.mark.slow
@pytest.mark.parametrize(
    "wanted",
    [LogitsWanted(top2, True), LogitsWanted(top2, False), LogitsWanted(None, True)],
    ids=["counted", "every", "loss_only"],
)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_padding_free_row_is_evaluated_in_pieces_of_whole_samples(monkeypatch, family, wanted):
    """Pieces of at most PIECE_POSITIONS positions (a longer sample alone), each a forward of its
    own: the same loss and predictions as one forward over the row, and as the model's own."""
    assert sliced_head.PIECE_POSITIONS == 1024  # what docs/trainer-options.md and the plugin's README say
    model = make(family, 2).eval()
    batch = layout(model, "segments", segments(24, seed=11, turns=3))[0]
    length = batch["input_ids"].shape[1]
    sizes = (batch["cu_seq_lens_q"][1:] - batch["cu_seq_lens_q"][:-1]).tolist()
    limit = 32
    assert max(sizes) > limit and length > 3 * limit  # one sample longer than a piece, several pieces
    lengths = forward_lengths(model)
    with torch.no_grad():
        own = model(**batch)
        monkeypatch.setattr(sliced_head, "PIECE_POSITIONS", 10**9)
        whole, whole_answer = preprocessed_loss(model, batch, None, 0.0, wanted)
        monkeypatch.setattr(sliced_head, "PIECE_POSITIONS", limit)
        del lengths[:]
        loss, answer = preprocessed_loss(model, batch, None, 0.0, wanted)
    assert sum(lengths) == length and len(lengths) > 3
    assert all(n <= limit or n in sizes for n in lengths)  # a longer piece is one sample alone
    assert abs(loss.item() - whole.item()) <= 1e-6 and abs(loss.item() - own.loss.item()) <= 1e-6
    if wanted.preprocess is None:
        assert answer is None and whole_answer is None
    else:
        assert torch.equal(answer.predictions, whole_answer.predictions)


def test_a_row_is_one_forward_with_gradients_or_a_mask(monkeypatch):
    """Pieces only without autograd (in training the activations are kept anyway), and only for
    a padding-free row: a padded batch's mask is not cut."""
    monkeypatch.setattr(sliced_head, "PIECE_POSITIONS", 16)
    model = make("llama", 2)
    lengths = forward_lengths(model)
    row = layout(model, "segments", segments(12, seed=2))[0]
    loss, _ = preprocessed_loss(model, row, None, 0.0, LogitsWanted(None, True))
    assert loss.requires_grad and lengths == [row["input_ids"].shape[1]]
    padded = layout(model, "right_padded", segments(12, seed=2))[0]
    with torch.no_grad():
        del lengths[:]
        preprocessed_loss(model, padded, None, 0.0, LogitsWanted(None, True))
    assert lengths == [padded["input_ids"].shape[1]]


TWO_RANKS = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from corelooper_lm import sliced_head
from corelooper.outputs import LogitsWanted
from test_sliced_head import forward_lengths
from test_trained_layer import layout, make, segments

def rank(r):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=r, world_size=2)
    sliced_head.PIECE_POSITIONS = 16
    model = make("llama", 2).eval()
    lengths = forward_lengths(model)
    batch = layout(model, "segments", segments(8 + 4 * r, seed=r))[0]  # other lengths on each rank
    with torch.no_grad():
        sliced_head.preprocessed_loss(model, batch, None, 0.0, LogitsWanted(None, True))
    assert lengths == [batch["input_ids"].shape[1]] and lengths[0] > 16, lengths
    dist.destroy_process_group()

torch.multiprocessing.start_processes(rank, nprocs=2, start_method="fork")
"""


@pytest.mark.slow
def test_several_processes_evaluate_a_row_in_one_forward(tmp_path):
    """Two real processes (gloo): each runs one forward per batch, however long its row, since a
    sharded model gathers its weights in every forward and the processes' batches differ."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-c", TWO_RANKS, str(Path(__file__).parent), str(port)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_label_smoothing_and_the_steps_item_count():
    model = make("llama", 4).eval()
    batch = layout(model, "right_padded", segments(8, seed=5))[0]
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        loss, _ = preprocessed_loss(model, batch, torch.tensor(77), 0.1, LogitsWanted(top2, True))
    targets = trained_head.causal_targets(batch).reshape(-1)
    ref = (
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), targets, reduction="sum", label_smoothing=0.1
        )
        / 77
    )
    assert abs(loss.item() - ref.item()) <= 1e-6


def test_a_model_that_changes_its_logits_after_the_head_is_named():
    """Gemma 2 soft-caps the logits after the output layer: the slices would lack it."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=5.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    batch = layout(model, "right_padded", segments(6))[0]
    with torch.no_grad():
        loss, reason = preprocessed_loss(model, batch, None, 0.0, LogitsWanted(top2, True))
    assert loss is None and "changes the output layer's logits" in reason


def half_right(model, data):
    """``data`` with every other counted label set to the model's own prediction, so that the
    accuracy is far from 0 (a random model over a vocabulary of 96 predicts almost nothing)."""
    from test_trained_head import stack

    with torch.no_grad():
        predicted = model.eval()(**stack(data)).logits.argmax(-1)
    out = []
    for row, sample in zip(predicted, data, strict=True):
        labels = sample["labels"].clone()
        counted = (labels[1:] != -100).nonzero().flatten()[::2]
        labels[counted + 1] = row[counted]
        out.append({**sample, "labels": labels})
    return out


def hf_accuracy(eval_pred):
    preds, labels = eval_pred
    preds, labels = preds[:, :-1], labels[:, 1:]
    mask = labels != -100
    return {"accuracy": float((preds[mask] == labels[mask]).mean())}


def evaluate_both(tmp_path, model, data, lm, batch=4):
    """HF's Trainer.evaluate (argmax preprocessing, its documented way) and corelooper's."""
    common = dict(
        per_device_eval_batch_size=batch,
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        report_to="none",
    )
    hf = transformers.Trainer(
        model=copy.deepcopy(model),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **common),
        eval_dataset=data,
        compute_metrics=hf_accuracy,
        preprocess_logits_for_metrics=lambda logits, _labels: logits.argmax(-1),
    ).evaluate()
    loop = Loop(
        copy.deepcopy(model),
        Config(train=TrainArgs(output_dir=str(tmp_path / "cl"), **common), sections={"lm": lm}),
        eval_dataset=data,
        compute_metrics=TokenAccuracy(),
        blocked_plugins=["console"],
    )
    return hf, loop


def model_of(family):
    if family == "llama":
        return make("llama", 2)
    torch.manual_seed(0)  # Gemma 2 soft-caps its logits after the output layer
    return transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            final_logit_softcapping=5.0,
            attn_implementation="eager",
        )
    )


def fallback_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "not a slice at a time" in r.getMessage()]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_loss_only_evaluation_runs_the_head_in_slices(tmp_path, caplog, family):
    from test_trained_head import prompt_masked, stack

    model, data = model_of(family), prompt_masked(10, seed=3)
    loop = Loop(
        copy.deepcopy(model),
        Config(
            train=TrainArgs(
                output_dir=str(tmp_path),
                per_device_eval_batch_size=4,
                disable_tqdm=True,
                use_cpu=True,
                report_to=[],
            ),
            sections={"lm": {"head": "trained"}},
        ),
        eval_dataset=data,
        blocked_plugins=["console"],
    )
    calls = head_rows_of(loop.model.get_output_embeddings())
    with caplog.at_level(logging.WARNING, logger="corelooper.lm"):
        got = loop.evaluate()
    with torch.no_grad():
        own = model.eval()(**stack(data)).loss.item()
    assert abs(got["eval_loss"] - own) <= 1e-6 + 1e-9 and own > 1.0
    if family == "gemma2":  # once named, then the trained positions' logits in one piece
        assert len(fallback_warnings(caplog)) == 1 and len(calls) == 4 and min(calls[1:]) > 1
    else:
        assert not fallback_warnings(caplog) and calls == [1, 1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_evaluate_with_token_accuracy_equals_hf_trainer(tmp_path, caplog, family):
    """Loop.evaluate with TokenAccuracy, lm.head = "trained": the sliced head (Llama), or, for a
    model that soft-caps its logits (Gemma 2), the whole logits after one warning."""
    from test_trained_head import prompt_masked, stack

    model = model_of(family)
    data = half_right(model, prompt_masked(10, seed=3))
    hf, loop = evaluate_both(tmp_path, model, data, {"head": "trained"})
    head = loop.model.get_output_embeddings()
    with caplog.at_level(logging.WARNING, logger="corelooper.lm"):
        calls = head_rows_of(head)
        got = loop.evaluate()
    assert (
        got["eval_accuracy"] == pytest.approx(hf["eval_accuracy"], abs=1e-12) and got["eval_accuracy"] > 0.4
    )
    # HF's eval_loss is the mean of per-batch means; corelooper's is token-weighted over the set,
    # which is the model's own loss over all samples in one batch
    with torch.no_grad():
        own = model.eval()(**stack(data)).loss.item()
    assert abs(got["eval_loss"] - own) <= 1e-6
    warned = fallback_warnings(caplog)
    if family == "gemma2":
        assert len(warned) == 1 and "soft-capping" in warned[0]
        assert all(n > 1 for n in calls[1:])  # after the first batch: one call per batch, every position
    else:
        assert not warned and calls == [1, 1, 1]  # the probe: the model never held a batch's logits


def head_rows_of(head):
    rows: list[int] = []
    head.register_forward_hook(lambda _m, _a, out: rows.append(out.shape[:-1].numel()))
    return rows


@pytest.mark.slow
def test_metric_sees_the_same_predictions_with_and_without_the_sliced_head(tmp_path):
    """A metric that records its predictions: the lm plugin's slices give exactly what the core's
    per-batch preprocessing of the whole logits gives (lm.head = "all": the plugin is not there)."""

    class Recorder(TokenAccuracy):
        def __init__(self):
            super().__init__()
            self.seen = []

        def update(self, predictions, label_ids):
            self.seen.append(predictions.clone())
            super().update(predictions, label_ids)

    from test_trained_head import prompt_masked

    model, data, results = make("qwen3", 2), prompt_masked(9, seed=4), {}
    data = half_right(model, data)
    for head in ("all", "trained"):
        metric = Recorder()
        loop = Loop(
            copy.deepcopy(model),
            Config(
                train=TrainArgs(
                    output_dir=str(tmp_path / head),
                    per_device_eval_batch_size=4,
                    disable_tqdm=True,
                    use_cpu=True,
                    report_to=[],
                ),
                sections={"lm": {"head": head}},
            ),
            eval_dataset=data,
            compute_metrics=metric,
            blocked_plugins=["console"],
        )
        results[head] = (loop.evaluate(), metric.seen)
    (ref, ref_seen), (got, seen) = results["all"], results["trained"]
    assert (
        abs(got["eval_loss"] - ref["eval_loss"]) <= 1e-6 + 1e-9
        and got["eval_accuracy"] == ref["eval_accuracy"] > 0.4
    )
    for whole, sliced, sample in zip(ref_seen, seen, range(0, 9, 4), strict=True):
        labels = torch.stack([d["labels"] for d in data[sample : sample + 4]])
        counted = torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1))
        assert torch.equal(sliced[counted], whole[counted]) and (sliced[~counted] == PAD).all()


def test_under_bf16_autocast_the_slices_are_the_models_own_logits():
    """Mixed precision (what GPU users evaluate with): the slices' logits are bf16 as the model's
    are, and the model gets the output layer's own tensor back, so nothing falls back."""
    model = make("llama", 2).eval()
    batch = layout(model, "right_padded", segments(24, seed=6, turns=2))[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        own = model(**batch)
        loss, answer = preprocessed_loss(model, batch, None, 0.0, LogitsWanted(top2, True))
    assert isinstance(answer, Preprocessed) and own.logits.dtype == torch.bfloat16
    assert abs(loss.item() - own.loss.item()) <= 2e-2 * own.loss.item()
    counted = trained_head.causal_targets(batch) != -100
    agree = (answer.predictions[counted][:, 0] == own.logits.argmax(-1)[counted]).float().mean().item()
    assert agree >= 0.9  # bf16 rounding of other row blocks may flip near-ties, not more


def test_a_forward_set_on_the_instance_is_put_back():
    """accelerate's hooks (a device map) set ``module.forward`` on the instance: the sliced head and
    the trimmed layer swap it for one forward and put that one back, not the class's."""
    from accelerate.hooks import ModelHook, add_hook_to_module
    from corelooper_lm.trained_layer import last_decoder_layer

    model = make("llama", 2).eval()
    head, layer = model.get_output_embeddings(), last_decoder_layer(model)
    for module in (head, layer):
        add_hook_to_module(module, ModelHook())
    hooked = (vars(head)["forward"], vars(layer)["forward"])
    batch = layout(model, "segments", segments(8, seed=2))[0]
    with torch.no_grad():
        own = model(**batch)
        loss, answer = preprocessed_loss(model, batch, None, 0.0, LogitsWanted(top2, True))
    assert (vars(head)["forward"], vars(layer)["forward"]) == hooked
    assert isinstance(answer, Preprocessed) and abs(loss.item() - own.loss.item()) <= 1e-6
