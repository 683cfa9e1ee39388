"""corelooper-lm: what language-model training needs and a plain ``nn.Module`` run never does.

* ``corelooper_lm.collators``: ``DataCollatorForCausalLM`` (padding, prompt masking),
  ``pack_sequences`` / ``PackedDataset`` (fixed-length blocks of pre-tokenised text);
* ``corelooper_lm.packing``: leak-free packing plans and the ``SegmentCollator``
  (``position_ids`` restart per sample, flash-attention ``cu_seq_lens``);
* ``corelooper_lm.segment_attention``: ``sdpa`` one segment at a time, no ``T x T`` mask;
* ``corelooper_lm.chunked_ce``: the causal-LM cross-entropy from the final hidden states in
  chunks of tokens, never the full ``[tokens, vocab]`` float32 logits.

The plugin itself is inert unless the config has an ``[lm]`` section that asks for something:
``[lm] loss = "chunked"`` registers, for that run, a ``compute_loss`` provider that trains with
the chunked cross-entropy (evaluation keeps the model's own logits).
"""

from __future__ import annotations

from collections.abc import Mapping

from corelooper import hookimpl

__version__ = "0.2.0"

SECTION = "lm"
LOSSES = ("default", "chunked")


@hookimpl
def corelooper_config_sections():
    return {SECTION: {"loss": "default"}}


@hookimpl
def corelooper_configure(config, plugins):
    from corelooper.errors import ConfigError

    section = plugins.section_or_inactive(config, SECTION)
    loss = section["loss"] if section is not None else "default"
    if loss not in LOSSES:
        raise ConfigError(f"lm.loss = {loss!r}: use one of {', '.join(map(repr, LOSSES))}.")
    if loss == "default":
        plugins.set_inactive(SECTION, "lm.loss is 'default' (nothing to change)")
        return
    plugins.register(ChunkedLoss(), f"{SECTION}.run")


class ChunkedLoss:
    """The training loss of an HF causal LM through ``chunked_ce`` (``[lm] loss = "chunked"``)."""

    @hookimpl
    def compute_loss(self, loop, model, batch, num_items_in_batch, return_outputs):
        if return_outputs:  # evaluation and prediction need the logits themselves
            return None
        from corelooper.data.columns import model_inputs

        from .chunked_ce import chunked_causal_lm_loss

        if isinstance(batch, Mapping):
            batch = model_inputs(loop, batch)
        smoothing = loop.args.label_smoothing_factor if loop.loss_type != "mse" else 0.0
        return chunked_causal_lm_loss(loop, model, batch, num_items_in_batch, smoothing)
