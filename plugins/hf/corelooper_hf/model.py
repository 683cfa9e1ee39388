"""Models and tokenizers named in ``[model]``: a factory, or a Hugging Face folder by path.

``[model] factory = "pkg.mod:build"`` calls a function (with ``[model] args``);
``[model] name_or_path = "path/to/model"`` loads ``AutoModelForCausalLM`` (or the auto class
``task`` names) with ``torch_dtype``, ``attn_implementation`` and ``trust_remote_code`` (off
unless set: remote code runs arbitrary Python). ``load_tokenizer`` reads the tokenizer from
``[model] tokenizer`` or the model's folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corelooper.config import Config
from corelooper.errors import ConfigError

# ``task`` -> transformers auto class (the auto class's own name is accepted too).
TASKS = {
    "causal_lm": "AutoModelForCausalLM",
    "seq2seq_lm": "AutoModelForSeq2SeqLM",
    "masked_lm": "AutoModelForMaskedLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "token_classification": "AutoModelForTokenClassification",
    "question_answering": "AutoModelForQuestionAnswering",
    "image_classification": "AutoModelForImageClassification",
    "base": "AutoModel",
}


def _base(config: Config) -> Path | None:
    return config.source.parent if config.source else None


def resolve_path(ref: str, config: Config) -> str:
    """A local path as written, else relative to the config's folder; other strings unchanged
    (a hub id, for a machine that can download)."""
    path = Path(ref).expanduser()
    base = _base(config)
    if not path.is_absolute() and not path.exists() and base is not None and (base / path).exists():
        path = base / path
    return str(path) if path.exists() else ref


def auto_class(task: str):
    import transformers

    name = TASKS.get(task, task)
    cls = getattr(transformers, name, None) if name.startswith("AutoModel") else None
    if cls is None:
        raise ConfigError(
            f"model.task = {task!r} is not known. Use one of {', '.join(TASKS)}, or the name of a "
            "transformers auto class (e.g. 'AutoModelForCausalLM')."
        )
    return cls


def pretrained_kwargs(m) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": m.trust_remote_code}
    if m.torch_dtype is not None:
        import torch

        kwargs["dtype"] = "auto" if m.torch_dtype == "auto" else getattr(torch, m.torch_dtype)
    if m.attn_implementation is not None:
        kwargs["attn_implementation"] = m.attn_implementation
    return kwargs


def load_pretrained(config: Config):
    """``from_pretrained`` of ``[model] name_or_path``; every failure names the key and the path."""
    m = config.model
    where = resolve_path(m.name_or_path, config)
    cls = auto_class(m.task)
    kwargs = {**pretrained_kwargs(m), **m.args}
    if Path(where).exists():
        kwargs.setdefault("local_files_only", True)
    elif _looks_like_path(where):  # not a hub name: transformers would only say it cannot connect
        raise ConfigError(missing_folder(m.name_or_path, config))
    try:
        return cls.from_pretrained(where, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        if not Path(where).exists():
            raise ConfigError(missing_folder(m.name_or_path, config, e)) from None
        raise ConfigError(
            f"model.name_or_path = {m.name_or_path!r}: {cls.__name__}.from_pretrained({where!r}) "
            f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} Check that the "
            "folder holds config.json and the weights (model.safetensors), and model.task / "
            "model.attn_implementation / model.torch_dtype."
        ) from None


def _looks_like_path(ref: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything else naming a folder is a path."""
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or "\\" in ref or ref.endswith("/")


def missing_folder(ref: str, config: Config, error: Exception | None = None) -> str:
    """Say that the folder does not exist, where it was looked for, and what a hub name needs."""
    import os

    places = list(dict.fromkeys(str(p) for p in (Path.cwd(), _base(config)) if p is not None))
    offline = any(os.environ.get(k, "") not in ("", "0") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    text = f"model.name_or_path = {ref!r}: the folder does not exist (looked in {' and '.join(places)})."
    if not _looks_like_path(ref):
        why = (
            "offline (HF_HUB_OFFLINE is set), so"
            if offline
            else (f"as a Hugging Face hub name it failed ({type(error).__name__}), and offline")
        )
        text += (
            f" {why} hub names cannot be downloaded: download the model once "
            "(`hf download NAME --local-dir DIR`) and set model.name_or_path to DIR."
        )
    return text


def tokenizer_path(config: Config) -> str | None:
    m = config.model
    ref = m.tokenizer or m.name_or_path
    return resolve_path(ref, config) if ref else None


def load_tokenizer(config: Config):
    """``AutoTokenizer`` from ``[model] tokenizer`` (else ``name_or_path``); None when neither."""
    where = tokenizer_path(config)
    if where is None:
        return None
    from transformers import AutoTokenizer

    key = "model.tokenizer" if config.model.tokenizer else "model.name_or_path"
    try:
        return AutoTokenizer.from_pretrained(
            where,
            trust_remote_code=config.model.trust_remote_code,
            local_files_only=Path(where).exists(),
        )
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        raise ConfigError(
            f"{key} = {where!r}: AutoTokenizer.from_pretrained failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''} The folder needs tokenizer.json (or the "
            "files of a slow tokenizer) and tokenizer_config.json."
        ) from None
