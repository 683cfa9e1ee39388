"""``corelooper predict`` on a causal LM (corelooper-lm answers ``predict_records``), and its older
``corelooper lm predict``, on an [sft] run's evaluation set, through the real CLI: one record per
sample, its loss the model's own loss on that sample, and with ``--generate`` the text HF's
``model.generate`` gives for the chat template's prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sft_fixtures import CHATS, _datasets_cache, model_dir  # noqa: F401 (fixtures)

from corelooper.config import dumps_toml

BIN = Path(sys.executable).parent


def write_config(tmp_path, model_dir) -> tuple[Path, list[dict]]:
    rows = [json.loads(json.dumps(c)) for c in CHATS] * 2
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {"train": str(data), "eval": str(data)},
        "train": {"output_dir": str(tmp_path / "run"), "per_device_eval_batch_size": 4, "use_cpu": True},
        "sft": {"assistant_only_loss": True, "max_length": 0, "padding_free": False},
    }
    path = tmp_path / "config.toml"
    path.write_text(dumps_toml(cfg))
    return path, rows


def lm_predict(
    config: Path, *args: str, env_dir: Path, command=("lm", "predict")
) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_CACHE": str(env_dir / "cache")}
    return subprocess.run(
        [str(BIN / "corelooper"), *command, str(config), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.fixture(scope="module")
def generated(tmp_path_factory, model_dir):
    """``generated(command)``: that command's run with ``--generate`` on the padded evaluation set,
    made once in the module ((rows, output file, completed process)); the one-process
    ``corelooper predict`` run is also the reference of the two-process test."""
    runs = {}

    def get(command: str):
        if command not in runs:
            tmp = tmp_path_factory.mktemp(command.replace(" ", "_"))
            config, rows = write_config(tmp, model_dir)
            out = tmp / "preds.jsonl"
            args = ["--checkpoint", str(model_dir), "-o", str(out), "--generate", "--max-new-tokens", "6"]
            runs[command] = rows, out, lm_predict(config, *args, env_dir=tmp, command=command.split())
        return runs[command]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("command", ["predict", "lm predict"])
def test_one_record_per_sample_with_its_loss_and_the_generated_text(generated, model_dir, command):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows, out, ran = generated(command)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    said = "predictions written to" if command == "predict" else "6 samples written to"
    assert ran.stdout.strip().splitlines() == [
        f"{said} {out}" + ("" if command == "predict" else ", one record each")
    ]
    assert "Traceback" not in ran.stderr and "WARNING" not in ran.stderr.upper(), ran.stderr
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["index"] for r in records] == list(range(6))

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    for row, rec in zip(rows, records, strict=True):
        messages = row["messages"]
        # the prompt: the conversation up to the first assistant turn, as the chat template renders it
        first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
        prompt = tok.apply_chat_template(messages[:first], add_generation_prompt=True, tokenize=False)
        assert rec["prompt"] == prompt
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            want = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )[0, ids.shape[1] :]
        assert rec["generated_ids"] == want.tolist()
        assert rec["generated"] == tok.decode(want, skip_special_tokens=True)
        # the loss: the model's own mean over the sample's trained tokens (assistant turns only)
        full = tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        input_ids = torch.tensor([full["input_ids"]])
        labels = torch.where(torch.tensor([full["assistant_masks"]]) == 1, input_ids, -100)
        with torch.no_grad():
            own = model(input_ids=input_ids, labels=labels)
        assert rec["loss"] == pytest.approx(own.loss.item(), rel=1e-4)
        assert rec["tokens"] == int((labels[0, 1:] != -100).sum())
        assert rec["label_ids"] == labels[0, 1:][labels[0, 1:] != -100].tolist()
        predicted = own.logits[0, :-1].argmax(-1)[labels[0, 1:] != -100]
        assert rec["predicted_ids"] == predicted.tolist()
        assert rec["target"] == tok.decode(rec["label_ids"])


def test_bad_options_are_one_paragraph(tmp_path, model_dir):
    config, _ = write_config(tmp_path, model_dir)
    ran = lm_predict(
        config, "--checkpoint", str(model_dir), "-o", str(tmp_path / "p.safetensors"), env_dir=tmp_path
    )
    assert (
        ran.returncode == 2
        and "corelooper lm predict writes JSON Lines, a file ending in .jsonl" in ran.stderr
    )
    assert "Traceback" not in ran.stderr
    args = ("--checkpoint", str(model_dir), "-o", str(tmp_path / "p.safetensors"))
    ran = lm_predict(config, *args, env_dir=tmp_path, command=["predict"])
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    assert (
        "one record per sample (predict_records), written as JSON Lines: use a file ending in .jsonl"
        in ran.stderr
    )
    args = ("--checkpoint", str(model_dir), "--generate", "--max-new-tokens", "0")
    ran = lm_predict(config, *args, env_dir=tmp_path, command=["predict"])
    assert ran.returncode == 2 and "--max-new-tokens 0: generating needs at least 1" in ran.stderr, ran.stderr
    assert not (tmp_path / "p.safetensors").exists()


def test_a_packed_evaluation_set_gives_the_same_records_sample_by_sample(tmp_path, model_dir):
    """Packed rows hold several samples: the records are still one per sample, the same as padded."""
    from corelooper_lm.predict import records

    from corelooper import Loop
    from corelooper.config import Config

    config, rows = write_config(tmp_path, model_dir)
    got = {}
    for name, sft in (("padded", {}), ("packed", {"packing": True, "max_length": 256})):
        cfg = Config.load(config, [f"train.output_dir={json.dumps(str(tmp_path / name))}"])
        cfg = Config.from_dict({**cfg.to_dict(), "sft": {**cfg.section("sft"), **sft}})
        with Loop(config=cfg) as loop:
            assert isinstance(loop.eval_dataset[0], list) == (name == "packed")
            got[name] = list(records(loop.model, loop.eval_dataset, 3, 1))
    assert len(got["packed"]) == len(rows) == 6
    for a, b in zip(got["padded"], got["packed"], strict=True):
        assert a["predicted_ids"] == b["predicted_ids"] and a["label_ids"] == b["label_ids"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.distributed
def test_two_processes_write_the_records_one_process_writes(tmp_path, model_dir, generated):
    """`corelooper predict` under torchrun with 2 processes on a causal LM: every process runs the records' forwards
    (a sharded model gathers in lockstep), the main process writes them: the same file as one (the
    one-process run of the test above; --generate adds fields to its records and changes none)."""
    config, _ = write_config(tmp_path, model_dir)
    _, one_out, one_ran = generated("predict")
    assert one_ran.returncode == 0, one_ran.stdout[-2000:] + one_ran.stderr[-3000:]
    assert one_ran.stdout.count("predictions written to") == 1  # one process speaks
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out = tmp_path / "preds2.jsonl"
    args = [str(config), "--checkpoint", str(model_dir), "-o", str(out)]
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    ran = subprocess.run(
        [*torchrun, "-m", "corelooper", "predict", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    assert ran.stdout.count("predictions written to") == 1  # one process speaks
    files = {
        n: [json.loads(x) for x in f.read_text(encoding="utf-8").splitlines()]
        for n, f in ((1, one_out), (2, out))
    }
    assert len(files[2]) == 6 and [r["index"] for r in files[2]] == list(range(6))
    for one, two in zip(files[1], files[2], strict=True):
        assert one["predicted_ids"] == two["predicted_ids"] and one["label_ids"] == two["label_ids"]
        assert one["loss"] == pytest.approx(two["loss"], rel=1e-5)
