"""Wiring the ``[sft]`` section into a run: tokenizer, data sets, collator (its ``transform_data``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from corelooper.errors import ConfigError

from .pipeline import SFTCollator, prepare

logger = logging.getLogger("corelooper.sft")

CHOICES = {
    "packing_strategy": ("bfd", "bfd_split", "wrapped"),
    "truncation_mode": ("keep_start", "keep_end"),
    "overlong": ("truncate", "drop"),
}


def check(cfg: dict[str, Any]) -> None:
    for key, options in CHOICES.items():
        if cfg[key] not in options:
            raise ConfigError(f"sft.{key} = {cfg[key]!r}: use one of {', '.join(map(repr, options))}.")
    if cfg["max_length"] is not None and cfg["max_length"] < 0:
        raise ConfigError(f"sft.max_length must be >= 0 (0: no limit), got {cfg['max_length']}.")
    if cfg["padding_free"] not in (None, "auto", True, False):
        raise ConfigError(
            f'sft.padding_free must be true, false or "auto" (unset), got {cfg["padding_free"]!r}.'
        )
    if cfg["segment_attention"] not in (None, "auto", True, False):
        raise ConfigError(
            f'sft.segment_attention must be true, false or "auto" (unset), got {cfg["segment_attention"]!r}.'
        )
    if cfg["packing"] and cfg["padding_free"] is True:
        raise ConfigError(
            "Set sft.packing or sft.padding_free, not both (packed rows are already padding-free)."
        )
    if not isinstance(cfg["append_eos"], bool):
        raise ConfigError(f"sft.append_eos must be true or false, got {cfg['append_eos']!r}.")
    if cfg["completion_only_loss"] not in (None, True, False):
        raise ConfigError(
            f"sft.completion_only_loss must be true, false or unset, got {cfg['completion_only_loss']!r}."
        )


def segments_for(cfg: dict[str, Any], device_type: str) -> bool:
    """``sft.segment_attention`` as set, or, unset ("auto"), on the CPU only. There one sdpa call
    per sample beats the ``T x T`` block mask (benchmarks/README.md); on an H200 without flash
    attention the block mask with sdpa's fused kernels trained packed rows 26x faster than one
    call per sample (benchmarks/results/gpu-2026-12-04.json), so a GPU keeps the mask."""
    value = cfg["segment_attention"]
    return value if value in (True, False) else device_type == "cpu"


def padding_free_for(cfg: dict[str, Any], model, device_type: str) -> tuple[bool, str]:
    """``sft.padding_free`` as set, or, unset ("auto"), the faster of the two exact layouts (the
    same samples in every step, the same loss) for this model on this hardware, with the reason.

    Padding-free where it is exact and known to be faster: flash attention (its varlen kernel
    keeps samples apart), or on the CPU an ``sdpa`` model that calls transformers' attention
    interface, switched to segment-wise sdpa (benchmarks/README.md: half the time of padded
    batches on long-tailed chat data). Padded otherwise (TRL's default): on a GPU with ``sdpa``
    one batched kernel over a padded block has not been measured slower."""
    if cfg["padding_free"] in (True, False):
        return cfg["padding_free"], "set"
    if cfg["packing"]:
        return False, "packed rows are padding-free already"
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if attn.startswith("flash_attention"):
        return True, f"{attn}: its varlen kernel keeps the samples apart"
    if (
        device_type == "cpu"
        and attn == "sdpa"
        and segments_for(cfg, device_type)
        and getattr(type(base), "_supports_attention_backend", False)
    ):
        return True, "sdpa on the CPU: one row per batch with segment-wise attention computes no padding"
    return False, f"{attn or 'this attention'} on {device_type}: padded batches"


def find_tokenizer(config, model=None):
    """``[model] tokenizer`` / ``name_or_path``, else the folder the model was loaded from."""
    from corelooper_hf.model import load_tokenizer

    tok = load_tokenizer(config)
    source = getattr(getattr(model, "config", None), "_name_or_path", None) if model is not None else None
    if tok is None and source and Path(source).is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    if tok is None:
        raise ConfigError(
            "[sft] needs a tokenizer: set model.name_or_path (a Hugging Face model folder with its "
            "tokenizer) or model.tokenizer (a tokenizer folder)."
        )
    return tok


def configure_tokenizer(tok, cfg: dict[str, Any], config) -> str | None:
    """Apply ``eos_token``/``pad_token``; return the chat template to use (file or tokenizer's)."""
    for key in ("eos_token", "pad_token"):
        value = cfg[key]
        if value is not None:
            if value not in tok.get_vocab():
                raise ConfigError(f"sft.{key} = {value!r} is not a token of the tokenizer's vocabulary.")
            setattr(tok, key, value)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # as TRL
    path = cfg["chat_template_path"]
    if not path:
        return None
    file = Path(path)
    if not file.is_absolute() and not file.exists() and config.source is not None:
        file = config.source.parent / file
    if not file.is_file():
        raise ConfigError(f"sft.chat_template_path = {path!r}: no such file.")
    return file.read_text(encoding="utf-8")


def mode(cfg: dict[str, Any], split: str) -> str:
    packing = cfg["packing"] if split == "train" or cfg["eval_packing"] is None else cfg["eval_packing"]
    if packing:
        return "packed"
    return "padding_free" if cfg["padding_free"] else "padded"


def attention_of(model) -> tuple[str | None, Any]:
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    params = list(model.parameters()) if model is not None else []
    return attn, (params[0].dtype if params else None)


def prepare_split(dataset, tok, cfg, split: str, where: str, template):
    split_cfg = {**cfg, "packing": mode(cfg, split) == "packed"}
    return prepare(dataset, tok, split_cfg, where, template)


def prepare_data(loop, model, data: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's datasets tokenized (and packed) for ``model``, with the collator that batches
    them: the parts of ``data`` (``train_dataset``, ``eval_dataset``, ``data_collator``) it replaces."""
    check(cfg)
    free, why = padding_free_for(cfg, model, loop.backend.device.type)
    if cfg["padding_free"] not in (True, False) and free:
        logger.info(
            "sft.padding_free (unset: auto) -> padding-free batches, the same samples per step (%s)", why
        )
    cfg = {**cfg, "padding_free": free}
    config = loop.config
    tok = find_tokenizer(config, model)
    template = configure_tokenizer(tok, cfg, config)
    backend = loop.backend
    if not backend.is_main_process:  # rank 0 tokenizes first and fills the datasets cache
        backend.wait_for_everyone()
    names = {"train": config.data.train or "train_dataset", "eval": config.data.eval or "eval_dataset"}
    out: dict[str, Any] = {}
    for split in ("train", "eval"):
        if data[f"{split}_dataset"] is not None:
            out[f"{split}_dataset"] = prepare_split(
                data[f"{split}_dataset"], tok, cfg, split, f"data.{split} ({names[split]})", template
            )
    if backend.is_main_process:
        backend.wait_for_everyone()
    if cfg["weight_column"] and "train_dataset" in out:
        from .weighting import check_weights

        rows = out["train_dataset"]
        check_weights(getattr(rows, "rows", rows).ds, cfg["weight_column"], f"data.train ({names['train']})")
    collator = data["data_collator"]
    if (
        (cfg["packing"] or cfg["padding_free"])
        and segments_for(cfg, backend.device.type)
        and collator is None
    ):
        from corelooper_lm.segment_attention import use_segment_attention

        use_segment_attention(model)  # sdpa -> one sdpa per segment: no T x T mask per row
    attn, dtype = attention_of(model)
    if collator is None:
        out["data_collator"] = SplitCollator(cfg, tok.pad_token_id, attn, dtype)
    if cfg["packing"] or cfg["padding_free"]:
        model_config = getattr(model, "config", None)
        if model_config is not None and hasattr(model_config, "use_cache"):
            model_config.use_cache = False  # with a KV cache, Llama attends across packed samples
    return out


class SplitCollator:
    """One collator for training and evaluation batches: a packed item is a list of pieces, a
    padded or padding-free item a dict, so the item's type says which layout it is."""

    def __init__(self, cfg: dict[str, Any], pad_token_id: int, attn: str | None, dtype):
        multiple = cfg["pad_to_multiple_of"]
        self.packed = SFTCollator("packed", pad_token_id, attn, dtype, multiple)
        self.other = SFTCollator(
            "padding_free" if cfg["padding_free"] else "padded", pad_token_id, attn, dtype, multiple
        )

    def __call__(self, items: list):
        return (self.packed if isinstance(items[0], list) else self.other)(items)
