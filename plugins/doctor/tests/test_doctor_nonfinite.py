"""Non-finite values explained: the module that went non-finite first, its inputs and weights."""

from __future__ import annotations

import json
import math

import torch
from corelooper_doctor.batchio import load_batch
from corelooper_doctor.nonfinite import explain
from doctor_fixtures import _only_named_plugins  # noqa: F401  (autouse)
from doctor_toys import OUTLIER, Classifier, Square, make_loop, relu_sqrt_model, samples


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])


def _batch(outlier: float | None = None):
    data = samples(outlier=outlier)
    rows = [data[i] for i in range(8, 16)]
    return {"x": torch.stack([r["x"] for r in rows]), "labels": torch.stack([r["labels"] for r in rows])}


def test_forward_overflow_blames_the_first_module_with_finite_inputs():
    model = Classifier(Square())
    report = explain(model, _batch(outlier=1e30), _loss)
    blame = report["blame"]
    assert blame["module"] == "body.1" and blame["type"] == "Square"
    assert blame["where"] == "forward output" and blame["inputs_finite"] is True
    # its input is Linear(8,16) of a row of 1e30s: finite, about 1e30 in magnitude
    assert 1e29 < blame["inputs"]["0"]["abs_max"] < 1e32
    assert blame["outputs"]["0"]["inf"] > 0
    assert set(blame["weights"]) == set()  # Square has no weights of its own


def test_backward_only_blames_the_module_whose_input_gradient_goes_infinite():
    model = relu_sqrt_model()
    batch = _batch()
    grads_before = [p.grad for p in model.parameters()]
    report = explain(model, batch, _loss)
    assert math.isfinite(report["loss"]["max"])
    assert report["blame"]["module"] == "body.1.1"  # Sqrt: d sqrt/dx = inf where ReLU gave 0
    assert report["blame"]["where"] == "gradient of its input"
    assert report["blame"]["grad_input"]["inf"] > 0
    assert [p.grad for p in model.parameters()] == grads_before  # the step's .grad untouched


def test_healthy_batch_is_not_blamed_and_rng_is_restored():
    model = Classifier(torch.nn.Dropout(0.5))
    state = torch.get_rng_state()
    report = explain(model, _batch(), _loss)
    assert report["blame"]["module"] is None
    assert torch.equal(torch.get_rng_state(), state)


def test_weights_already_non_finite_are_named():
    model = Classifier(Square())
    with torch.no_grad():
        model.body[2].weight[0, 0] = float("nan")
    report = explain(model, _batch(), _loss)
    assert report["blame"]["where"] == "weights already non-finite"
    assert report["blame"]["parameters"] == ["body.2.weight"]


def test_run_with_an_overflowing_sample_saves_a_replayable_report(tmp_path):
    loop = make_loop(tmp_path, Classifier(Square()), samples(outlier=1e30), on_nonfinite="skip_step")
    loop.train()
    folders = sorted((tmp_path / "run" / "doctor").glob("step-*"))
    assert len(folders) == 1  # one step holds the outlier (64 samples, batch 8, 8 steps)
    report = json.loads((folders[0] / "report.json").read_text())
    assert report["blame"]["module"] == "body.1"
    assert report["action"] == "skip_step"
    batch, info = load_batch(folders[0] / "batch.safetensors")
    assert OUTLIER in (report["sample_indices"] or [])
    assert (batch["x"].abs() == 1e30).all(dim=-1).sum() == 1  # the saved batch holds the outlier
    assert (folders[0] / "model.safetensors").is_file()
    assert "body.1" in (folders[0] / "report.txt").read_text()
    # replayed from the saved files alone, the same module is blamed
    from corelooper_doctor.replay import replay

    again = replay(folders[0], make_loop(tmp_path / "replay", Classifier(Square()), samples()))
    assert again["blame"]["module"] == "body.1"
