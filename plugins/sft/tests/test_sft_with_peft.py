"""corelooper-sft and corelooper-peft in one run: the order of their work is declared (PEFT's
``transform_model`` wraps the model before the backend; SFT's ``transform_data`` tokenises for
the wrapped model), never decided by the names the plugins are installed under."""

from __future__ import annotations

import types

import corelooper_hf
import corelooper_peft
import corelooper_sft
import pytest
import torch
from sft_fixtures import _datasets_cache, model_dir  # noqa: F401 (fixtures)
from test_sft_loop import config

from corelooper import Loop
from corelooper.config import Config
from corelooper.plugins import AUTOLOAD_ENV
from corelooper.transforms import DATA_PREPARED, order

peft = pytest.importorskip("peft")


def renamed(module: types.ModuleType, name: str) -> types.ModuleType:
    """``module``'s hooks under another plugin name (what another entry-point name would give)."""
    copy = types.ModuleType(name)
    copy.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    return copy


class SeenModel:
    """A data transform after tokenisation: records the model the data transforms were given."""

    name = "seen_model"

    def __init__(self) -> None:
        self.models: list = []

    @order(DATA_PREPARED)
    def transform_data(self, model, train_dataset):
        self.models.append(model)
        return {"train_dataset": train_dataset}


def run(tmp_path, model_dir, names: tuple[str, str], first: str, monkeypatch):  # noqa: F811
    monkeypatch.setenv(AUTOLOAD_ENV, "1")  # only the plugins passed here, under these names
    sft, peft_plugin = renamed(corelooper_sft, names[0]), renamed(corelooper_peft, names[1])
    seen = SeenModel()
    cfg = config(tmp_path, model_dir, {"packing": True, "max_length": 256}, max_steps=2, logging_steps=1)
    lora = {"method": "lora", "config": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}
    cfg = Config.from_dict({**cfg.to_dict(), "peft": lora})
    plugins = [sft, peft_plugin] if first == "sft" else [peft_plugin, sft]
    loop = Loop(config=cfg, plugins=[corelooper_hf, *plugins, seen])  # corelooper-hf loads the model folder
    loop.train()
    return loop, seen


@pytest.mark.parametrize(
    "names,first", [(("sft", "peft"), "peft"), (("zz_sft", "aa_peft"), "sft"), (("aa_sft", "zz_peft"), "sft")]
)
def test_sft_and_peft_compose_the_same_whatever_their_names(
    tmp_path,
    model_dir,
    monkeypatch,  # noqa: F811
    names,
    first,
):
    ref, ref_seen = run(tmp_path / "ref", model_dir, ("sft", "peft"), "sft", monkeypatch)
    loop, seen = run(tmp_path / "other", model_dir, names, first, monkeypatch)
    for lp, s in ((ref, ref_seen), (loop, seen)):
        assert isinstance(lp.backend.unwrap_model(lp.model), peft.PeftModel)
        # SFT tokenised for the wrapped model: PEFT's transform_model ran before any data transform
        assert len(s.models) == 1 and isinstance(s.models[0], peft.PeftModel)
        assert s.models[0].config._attn_implementation == "corelooper_segment_sdpa"
    assert len(loop.train_dataset) == len(ref.train_dataset) < 24  # packed, the same rows
    losses = [
        [h["loss"] for h in lp.state.log_history if "loss" in h and "train_runtime" not in h]
        for lp in (ref, loop)
    ]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    got = dict(loop.backend.unwrap_model(loop.model).named_parameters())
    for name, p in ref.backend.unwrap_model(ref.model).named_parameters():
        assert torch.equal(p, got[name]), name
