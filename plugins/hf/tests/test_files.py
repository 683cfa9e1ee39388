"""Data sets by path ([data] train/eval/eval_split/mixtures) and models by path ([model] name_or_path)."""

from __future__ import annotations

import json

import pytest
from corelooper_hf.files import is_data_ref, json_problem, load_spec, load_split

from corelooper.config import Config
from corelooper.errors import ConfigError, CorelooperError, DataError


def build_model(config):
    """The model the run would build: through the create_model providers of the installed plugins."""
    from corelooper import build
    from corelooper.plugins import load_plugins

    return build.build_model(load_plugins(config), config)


datasets = pytest.importorskip("datasets")
ROWS = [{"text": f"row {i}", "difficulty_score": i / 10} for i in range(20)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))


def write_all_formats(folder):
    folder.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_list(ROWS)
    (folder / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (folder / "d.json").write_text(json.dumps(ROWS))
    ds.to_parquet(str(folder / "d.parquet"))
    ds.to_csv(str(folder / "d.csv"), index=False)
    ds.save_to_disk(str(folder / "saved"))
    for k in range(2):
        ds.select(range(k * 10, k * 10 + 10)).to_parquet(str(folder / f"part-{k}.parquet"))
    return folder


@pytest.mark.parametrize("ref", ["d.jsonl", "d.json", "d.parquet", "d.csv", "saved", "part-*.parquet"])
def test_every_kind_of_source_loads_the_same_rows(tmp_path, ref):
    folder = write_all_formats(tmp_path / "data")
    ds = load_spec(ref, "data.train", base=folder)  # relative to the config's folder
    assert len(ds) == 20 and sorted(ds.column_names) == ["difficulty_score", "text"]
    assert [r["text"] for r in ds] == [r["text"] for r in ROWS]
    assert is_data_ref(ref, folder)


def test_factory_refs_stay_factories():
    assert not is_data_ref("examples.digits.data:train_set")
    assert not is_data_ref("path/to/file.py:train_set")
    assert is_data_ref([{"path": "a.jsonl"}])


def test_eval_split_is_seeded_and_disjoint(tmp_path):
    folder = write_all_formats(tmp_path / "data")
    cfg = Config.from_dict({"data": {"train": str(folder / "d.jsonl"), "eval_split": 0.25}})
    train, held = load_split(cfg, "train"), load_split(cfg, "eval")
    assert (len(train), len(held)) == (15, 5)
    assert not {r["text"] for r in train} & {r["text"] for r in held}
    assert [r["text"] for r in load_split(cfg, "eval")] == [r["text"] for r in held]  # same rows each call


def test_weighted_mixture_draws_by_weight(tmp_path):
    folder = tmp_path / "mix"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": "a"}) + "\n" for _ in range(400)))
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": "b"}) + "\n" for _ in range(400)))
    spec = [{"path": "a.jsonl", "weight": 3}, {"path": "b.jsonl", "weight": 1}]
    ds = load_spec(spec, "data.train", base=folder, seed=0)
    share = sum(r["text"] == "a" for r in ds) / len(ds)
    assert 0.68 < share < 0.82  # 3:1
    with pytest.raises(DataError, match=r"weight must be a number > 0"):
        load_spec([{"path": "a.jsonl", "weight": 0}], "data.train", base=folder)


def test_bad_files_explain_themselves(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 3: not valid JSON"):
        load_spec(str(bad), "data.train")
    assert "line 3" in json_problem(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="is empty"):
        load_spec(str(empty), "data.train")
    with pytest.raises(DataError, match="no such file"):
        load_spec(str(tmp_path / "missing.jsonl"), "data.eval")
    with pytest.raises(DataError, match="no file matches"):
        load_spec(str(tmp_path / "none-*.parquet"), "data.train")
    listy = tmp_path / "list.jsonl"
    listy.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"line 2: a list, not a JSON object"):
        load_spec(str(listy), "data.train")


def test_mixture_with_different_columns_lists_them(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    with pytest.raises(DataError, match=r"same columns .*a\.jsonl: \['text'\]"):
        load_spec(["a.jsonl", "b.jsonl"], "data.train", base=tmp_path)


def test_config_checks_of_model_and_data():
    with pytest.raises(ConfigError, match="not both"):
        Config.from_dict({"model": {"factory": "m:f", "name_or_path": "x"}})
    with pytest.raises(ConfigError, match="data.eval or data.eval_split"):
        Config.from_dict({"data": {"eval": "e.jsonl", "eval_split": 0.1}})
    with pytest.raises(ConfigError, match="model.torch_dtype"):
        Config.from_dict({"model": {"torch_dtype": "fp8"}})


# -- models by path ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_model_by_path_with_dtype_and_attention(llama_dir):
    import torch
    import transformers

    cfg = Config.from_dict(
        {"model": {"name_or_path": str(llama_dir), "torch_dtype": "bfloat16", "attn_implementation": "eager"}}
    )
    model = build_model(cfg)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    assert torch.equal(
        build_model(Config.from_dict({"model": {"name_or_path": str(llama_dir)}})).model.embed_tokens.weight,
        reference.model.embed_tokens.weight,
    )


def test_model_task_and_bad_paths_explain(llama_dir, tmp_path):
    import transformers

    cls = build_model(
        Config.from_dict({"model": {"name_or_path": str(llama_dir), "task": "sequence_classification"}})
    )
    assert isinstance(cls, transformers.LlamaForSequenceClassification)
    with pytest.raises(ConfigError, match="model.task = 'nope'"):
        build_model(Config.from_dict({"model": {"name_or_path": str(llama_dir), "task": "nope"}}))
    with pytest.raises(ConfigError, match=r"model.name_or_path = .*from_pretrained"):
        build_model(Config.from_dict({"model": {"name_or_path": str(tmp_path)}}))  # a folder with no model
    with pytest.raises(CorelooperError, match="model.name_or_path"):
        build_model(Config())
