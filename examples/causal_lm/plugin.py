"""The causal-LM example's plugin: saves the tokenizer next to the final model, so that
``AutoTokenizer.from_pretrained(output_dir)`` and ``AutoModelForCausalLM.from_pretrained(output_dir)``
both work. (Perplexity, ``eval_perplexity = exp(eval_loss)``, is logged by the core for causal LMs.)
"""

from __future__ import annotations

from pathlib import Path

from corelooper import hookimpl


def hf_tokenizer(data_args: dict):
    from transformers import PreTrainedTokenizerFast

    from .data import SPECIALS, tokenizer

    tok = tokenizer(
        tuple(data_args.get("packages", ("json", "email"))),
        data_args.get("vocab_size", 1024),
        data_args.get("eval_every", 8),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIALS[0], bos_token=SPECIALS[0], pad_token=SPECIALS[1]
    )


@hookimpl
def on_train_end(loop, state):
    if state.is_world_process_zero:
        hf_tokenizer(loop.config.data.args).save_pretrained(Path(loop.args.output_dir))
