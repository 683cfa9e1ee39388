"""Models and tokenizers named in ``[model]``: a factory, or a Hugging Face folder by path.

``[model] factory = "pkg.mod:build"`` calls a function (with ``[model] args``);
``[model] name_or_path = "path/to/model"`` loads ``AutoModelForCausalLM`` (or the auto class
``task`` names) with ``torch_dtype``, ``attn_implementation`` and ``trust_remote_code`` (off
unless set: remote code runs arbitrary Python). ``load_tokenizer`` reads the tokenizer from
``[model] tokenizer`` or the model's folder.
"""

from __future__ import annotations

import functools
import os
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
    kwargs = {**pretrained_kwargs(m), **m.args}
    if Path(where).exists():
        kwargs.setdefault("local_files_only", True)
    elif _looks_like_path(where) or (offline() and not in_hub_cache(where)):  # said before transformers loads
        raise ConfigError(missing_folder(m.name_or_path, config))
    elif offline():  # a hub name in the local cache: read from there
        kwargs["local_files_only"] = True
    cls = auto_class(m.task)
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


# offline as the user set it (``offline()`` sets HF_HUB_OFFLINE itself where the hub does not answer)
_OFFLINE_SETTING = any(
    os.environ.get(k, "") not in ("", "0") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
)


def offline() -> bool:
    """Whether hub names cannot be downloaded: HF_HUB_OFFLINE, or the hub does not answer. Then
    every hub call of this process (and of those it starts) reads the local cache only, at once:
    the hub client would otherwise retry each file for about a minute ("Retrying in 8s", 22 lines)
    before it says the same, even with ``local_files_only`` (transformers' adapter lookup)."""
    if _OFFLINE_SETTING:
        return True
    if hub_reachable():
        return False
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    return True


@functools.cache
def hub_reachable() -> bool:
    """Whether the hub answers a TCP connection within 5 s (asked once per process): a machine
    without a network fails in milliseconds; a proxy is trusted to reach it."""
    import socket
    import threading
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    address = (url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443))
    answered: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection(address, timeout=5).close()
            answered.append(True)
        except OSError:
            answered.append(False)

    thread = threading.Thread(target=connect, daemon=True)  # a name lookup has no timeout of its own
    thread.start()
    thread.join(5)
    return answered == [True]


def in_hub_cache(name: str) -> bool:
    """Whether the local Hugging Face cache holds the hub model ``name`` (its config.json)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # not a valid hub name
        return False


def missing_folder(ref: str, config: Config, error: Exception | None = None) -> str:
    """Say that the folder does not exist, where it was looked for, and what a hub name needs."""
    places = list(dict.fromkeys(str(p) for p in (Path.cwd(), _base(config)) if p is not None))
    text = f"model.name_or_path = {ref!r}: the folder does not exist (looked in {' and '.join(places)})."
    if _looks_like_path(ref):
        return text
    if error is not None and not offline():
        first = (str(error).strip().splitlines() or [""])[0]
        return (
            f"{text} As a Hugging Face hub name it failed too ({type(error).__name__}: {first}). Check the "
            "name (and HF_TOKEN for a gated or private model)."
        )
    from huggingface_hub.constants import HF_HUB_CACHE

    why = "offline (HF_HUB_OFFLINE is set)" if _OFFLINE_SETTING else "offline (the hub does not answer)"
    return (
        f"{text} This machine is {why}, so hub names cannot be downloaded, and the local Hugging Face "
        f"cache ({HF_HUB_CACHE}) holds no model of that name. Check the name, or download the model where "
        "there is a network (`hf download NAME --local-dir DIR`) and set model.name_or_path to DIR."
    )


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
            local_files_only=Path(where).exists() or offline(),
        )
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        raise ConfigError(
            f"{key} = {where!r}: AutoTokenizer.from_pretrained failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''} The folder needs tokenizer.json (or the "
            "files of a slow tokenizer) and tokenizer_config.json."
        ) from None
