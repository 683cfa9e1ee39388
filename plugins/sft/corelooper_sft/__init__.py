"""corelooper-sft: supervised fine-tuning from chat files, with TRL's ``SFTConfig`` names.

Inert unless the config has an ``[sft]`` section. Then, when the loop is built (its
``transform_data``, after any ``transform_model`` such as corelooper-peft's), the training and evaluation data sets are tokenized (chat template, prompt/completion, text, or
already tokenized rows; formats detected per row), masked (``assistant_only_loss``,
``completion_only_loss``), cut to ``max_length`` (``overlong = "truncate"`` or ``"drop"``,
counted and reported once), optionally packed (``packing``, ``packing_strategy`` = ``bfd``,
``bfd_split``, ``wrapped``) or batched padding-free, and the loop's collator is set to the one
that matches. Packed and padding-free batches never leak attention between samples
(``corelooper_lm.packing``); with ``sdpa`` attention on the CPU (``segment_attention``: unset,
"auto", is the CPU only; ``true`` everywhere) the model's attention becomes corelooper's
segment-wise sdpa (``corelooper_lm.segment_attention``: each sample attends to itself, no ``T x T``
mask); on a GPU sdpa gets the 4-D block mask, and with flash attention the varlen kernel keeps the
samples apart. Numeric extra columns (``difficulty_score``) reach the batch.

This module imports neither torch nor transformers nor datasets: ``corelooper --help`` loads it.
"""

from __future__ import annotations

__version__ = "0.2.0"

from corelooper import hookimpl
from corelooper.errors import ConfigError
from corelooper.transforms import DATA_TOKENIZE, order

SECTION = "sft"
DEFAULTS = {
    "dataset_text_field": "text",
    "max_length": 1024,
    "packing": False,
    "packing_strategy": "bfd",
    "padding_free": None,  # "auto": the faster exact layout for the model and hardware (setup.padding_free_for)
    "assistant_only_loss": False,
    "completion_only_loss": None,
    "chat_template_path": None,
    "eos_token": None,
    "pad_token": None,
    "truncation_mode": "keep_start",
    "overlong": "truncate",
    "pad_to_multiple_of": None,
    "eval_packing": None,
    "segment_attention": None,  # "auto": segment-wise sdpa on the CPU, the block mask on a GPU (setup.segments_for)
    "append_eos": False,  # the EOS appended, trained, to every sample not ending with it (eos.py)
    "weight_column": None,  # a numeric column: its value multiplies the sample's token losses (weighting.py)
}


@hookimpl
def corelooper_config_sections():
    return {SECTION: dict(DEFAULTS)}


@hookimpl
def corelooper_configure(config, plugins):
    if plugins.section_or_inactive(config, SECTION) is None:  # `corelooper plugins --config` says why
        return
    from .weighting import NAME, SampleWeightedLoss, check_column

    column = check_column(config.section(SECTION).get("weight_column"))
    if column is not None and config.train.label_smoothing_factor:
        raise ConfigError(
            f"[sft] weight_column = {column!r} with train.label_smoothing_factor = "
            f"{config.train.label_smoothing_factor}: the per-sample weighted loss is the plain token "
            "cross-entropy, so the smoothing would be silently lost. Set one of them, not both."
        )
    if column is not None:
        plugins.register(SampleWeightedLoss(column), NAME)


@hookimpl
@order(DATA_TOKENIZE)
def transform_data(loop, config, model, train_dataset, eval_dataset, data_collator):
    if SECTION not in config.sections:
        return None
    from .setup import prepare_data

    data = {"train_dataset": train_dataset, "eval_dataset": eval_dataset, "data_collator": data_collator}
    return prepare_data(loop, model, data, config.section(SECTION))


@hookimpl
def corelooper_add_commands(app):
    from .preview import register

    register(app)
