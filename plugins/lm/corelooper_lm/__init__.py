"""corelooper-lm: what language-model training needs and a plain ``nn.Module`` run never does.

* ``corelooper_lm.collators``: ``DataCollatorForCausalLM`` (padding, prompt masking),
  ``pack_sequences`` / ``PackedDataset`` (fixed-length blocks of pre-tokenised text);
* ``corelooper_lm.packing``: leak-free packing plans and the ``SegmentCollator``
  (``position_ids`` restart per sample, flash-attention ``cu_seq_lens``);
* ``corelooper_lm.segment_attention``: ``sdpa`` one segment at a time, no ``T x T`` mask;
* ``corelooper_lm.chunked_ce``: the causal-LM cross-entropy from the final hidden states in
  chunks of tokens, never the full ``[tokens, vocab]`` float32 logits.

* ``corelooper_lm.trained_head``: the LM head and the loss only over the positions that train
  (``labels != -100``): no logits for prompt tokens.

The plugin registers, for a run that asks for something, a ``compute_loss`` provider (an
evaluation that needs the logits, for a metric, gets the model's own logits and the loss computed
from them a slice of rows at a time, not a second float32 log-softmax as large as the logits):

* ``[lm] loss = "chunked"``: the chunked cross-entropy;
* ``[lm] head = "trained"``: the head over trained positions only (refused, with the reason, where
  that would not be the model's own loss); ``"all"``: every position (HF); ``"auto"`` (default):
  ``"trained"`` in runs with an ``[sft]`` section (prompt-masked chat data) where it is exact,
  ``"all"`` elsewhere (and where Liger's fused linear cross-entropy or ``train.torch_compile`` is
  on: selecting the trained rows breaks a compiled graph). Both together: the
  chunked loss over the trained positions.

And an evaluation metric: ``[lm] token_accuracy`` (unset or ``"auto"``: in ``[sft]`` runs) gives every
evaluation ``eval_token_accuracy`` (``metrics.TokenAccuracy``) unless the run has its own metric, and
every training log ``token_accuracy`` (``accuracy.TrainTokenAccuracy``: the logging window's trained
tokens, counted from the logits of the loss that runs). ``[lm] entropy = true`` adds ``entropy`` (and
``eval_entropy``): the mean entropy of the predicted distribution over the same tokens, as TRL logs.

``corelooper lm predict CONFIG`` (``predict_cli``): a checkpoint's model on the evaluation set, one
JSON line per sample (loss, predicted and target token ids; with ``--generate``, the prompt and
the text ``model.generate`` continues it with), where ``corelooper predict`` keeps the model's raw
outputs (an LM's logits over its vocabulary).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from corelooper import hookimpl

__version__ = "0.2.0"

SECTION = "lm"
LOSSES = ("default", "chunked")
HEADS = ("auto", "trained", "all")
ACCURACY = f"{SECTION}.train_token_accuracy"  # the run's TrainTokenAccuracy among its plugins
OURS = ("builtin", f"{SECTION}.run", ACCURACY)  # compute_loss providers whose loss LMLoss counts


@hookimpl
def corelooper_config_sections():
    # token_accuracy unset ("auto"): on in [sft] runs
    return {SECTION: {"loss": "default", "head": "auto", "token_accuracy": None, "entropy": False}}


@hookimpl
def corelooper_configure(config, plugins):
    from corelooper.errors import ConfigError

    cfg = config.section(SECTION)
    loss, head = cfg.get("loss", "default"), cfg.get("head", "auto")
    if loss not in LOSSES:
        raise ConfigError(f"lm.loss = {loss!r}: use one of {', '.join(map(repr, LOSSES))}.")
    if head not in HEADS:
        raise ConfigError(f"lm.head = {head!r}: use one of {', '.join(map(repr, HEADS))}.")
    liger_flce = (
        "liger" in config.sections and config.section("liger").get("fused_linear_cross_entropy") is not False
    )
    if head == "trained" and liger_flce:
        raise ConfigError(
            "lm.head = 'trained' and Liger's fused linear cross-entropy ([liger]) both replace the model's "
            "loss: with both, Liger's kernel would never run. Use lm.head = 'auto' (Liger's kernel), or set "
            "[liger] fused_linear_cross_entropy = false."
        )
    accuracy = cfg.get("token_accuracy")
    if accuracy not in (None, "auto", True, False):
        raise ConfigError(
            f'lm.token_accuracy = {accuracy!r}: use true, false or "auto" (unset: on in [sft] runs).'
        )
    entropy = cfg.get("entropy", False)
    if not isinstance(entropy, bool):
        raise ConfigError(
            f"lm.entropy = {entropy!r}: use true or false (default false: it costs a log-softmax "
            "over the trained logits per micro-batch)."
        )
    accuracy = accuracy is True or (accuracy in (None, "auto") and "sft" in config.sections)
    counter = None
    if accuracy or entropy:
        from .accuracy import TrainTokenAccuracy

        plugins.register(EvalTokenAccuracy(accuracy, entropy), f"{SECTION}.token_accuracy")
        counter = TrainTokenAccuracy(accuracy, entropy)  # token_accuracy / entropy in the training logs
        plugins.register(counter, ACCURACY)
        plugins.register_for_checkpointing(f"{SECTION}.token_accuracy", counter)
    # "auto": "trained?" (only where exact) in [sft] runs; not with Liger's fused loss (it already
    # skips the full logits) nor torch_compile (the row selection breaks the compiled graph: nonzero)
    compiled = bool(
        getattr(config.train, "torch_compile", False) or getattr(config.train, "torch_compile_backend", None)
    )
    if head == "auto":
        head = "trained?" if "sft" in config.sections and not liger_flce and not compiled else "all"
    if loss == "default" and head == "all" and counter is None:
        plugins.set_inactive(
            SECTION, "lm.loss is 'default' and the head covers every position (HF's own loss)"
        )
        return
    plugins.register(LMLoss(chunked=loss == "chunked", head=head, accuracy=counter), f"{SECTION}.run")


@hookimpl
def corelooper_add_commands(app):
    from .predict_cli import register

    register(app)  # corelooper lm predict: one record per sample, --generate


@hookimpl
def predict_records(loop, dataset, options):
    """``corelooper predict`` on a causal LM: one record per sample (``predict.py``)."""
    from .predict_cli import causal_records

    return causal_records(loop, dataset, options)


def others_provide_loss(loop) -> bool:
    """Whether a plugin other than corelooper-lm and the builtin provides ``compute_loss`` (a
    user's weighted loss): corelooper-lm never replaces it."""
    return any(name not in OURS for name in loop.plugins.provider_order("compute_loss"))


def _grad_enabled() -> bool:
    import torch  # imported by then (a loss is being computed); not at import: `--help` loads this module

    return torch.is_grad_enabled()


class EvalTokenAccuracy:
    """``eval_token_accuracy`` in every evaluation (``[lm] token_accuracy``), as TRL's SFT trainer
    reports ``mean_token_accuracy``, but token-weighted over the whole set (TRL averages per-batch
    values); it gives way to the run's own metric (``Loop(compute_metrics=...)``, another plugin's).
    With ``[lm] entropy``, ``eval_entropy`` too."""

    def __init__(self, accuracy: bool = True, entropy: bool = False) -> None:
        self.accuracy, self.entropy = accuracy, entropy

    @hookimpl(trylast=True)
    def eval_metric(self, loop):
        theirs = loop.plugins.call_next("eval_metric", self, loop=loop)[0]
        if theirs is not None or loop.compute_metrics_fn is not None:
            return theirs
        if loop.plugins.implemented_by_others("compute_metrics"):
            return None
        from .metrics import TokenAccuracy

        return TokenAccuracy(name="token_accuracy", entropy=self.entropy, accuracy=self.accuracy)

    eval_metric.corelooper_role = "gives_way"  # the run's own metric first (cli/providers.py)


class LMLoss:
    """The training loss of an HF causal LM: chunked, and/or over the trained positions only.

    ``head``: ``"trained"`` (asked for: refused where not exact), ``"trained?"`` (the default in
    SFT runs: used where exact, else the model's own loss) or ``"all"``.
    """

    def __init__(self, chunked: bool, head: str, accuracy=None):
        self.chunked, self.head = chunked, head
        self.accuracy = accuracy  # a TrainTokenAccuracy: each training micro-batch's logits are counted
        self.checked: str | None = None  # "" once the model passed why_not_exact; else the reason
        self.sliced: str | None = None  # why an evaluation's output layer cannot run in slices

    @hookimpl
    def compute_loss(self, loop, model, batch, num_items_in_batch, return_outputs):
        # It replaces the model's own loss, never another plugin's (a user's weighted loss).
        if others_provide_loss(loop):
            return None
        if return_outputs:  # evaluation with a metric: the loss from the logits in slices
            return self._loss_and_outputs(loop, model, batch, num_items_in_batch, return_outputs)
        from corelooper.data.columns import model_inputs
        from corelooper.outputs import LogitsWanted

        trained = self.head != "all" and self._exact(loop, model)
        # training only: a DeepSpeed engine stays in train mode while it evaluates (under no_grad)
        counter = self.accuracy if model.training and _grad_enabled() else None
        if not (trained or self.chunked):  # the model's own loss (the next provider: the builtin)
            return None if counter is None else self._counted_own_loss(loop, model, batch, num_items_in_batch)
        if isinstance(batch, Mapping):
            batch = model_inputs(loop, batch)
        smoothing = loop.args.label_smoothing_factor if loop.loss_type != "mse" else 0.0
        if trained and not model.training and self.sliced is None and isinstance(batch, Mapping):
            # a loss-only evaluation: the output layer a slice of rows at a time
            loss = self._sliced(model, batch, num_items_in_batch, smoothing, LogitsWanted(None, True))[0]
            if loss is not None:
                return loss
        if self.chunked:
            from .chunked_ce import chunked_causal_lm_loss

            return chunked_causal_lm_loss(
                loop, model, batch, num_items_in_batch, smoothing, trained_only=trained, accuracy=counter
            )
        return self._trained_loss(model, batch, num_items_in_batch, smoothing, counter)

    compute_loss.corelooper_role = "gives_way"  # never another plugin's loss (cli/providers.py)

    def _counted_own_loss(self, loop, model, batch, num_items_in_batch):
        """The next provider's loss (the builtin: the model's own), asked for the outputs too, so
        that its logits are counted for ``token_accuracy``."""
        return self.accuracy.next_loss(self, loop, model, batch, num_items_in_batch)

    def _loss_and_outputs(self, loop, model, batch, num_items_in_batch, wanted):
        """In evaluation, ``(loss, outputs)`` from one forward without labels: the model's own loss
        would add a float32 log-softmax as large as the logits; this one takes a slice of rows at a
        time. A metric that preprocesses each position alone (``LogitsWanted``) gets its
        predictions from the output layer run over a slice of rows at a time (``sliced_head``)."""
        from corelooper.data.columns import model_inputs
        from corelooper.outputs import LogitsWanted

        from .trained_head import causal_targets, loss_from_logits

        if (
            model.training
            or self.head == "all"
            or not isinstance(batch, Mapping)
            or not self._exact(loop, model)
        ):
            return None
        batch = model_inputs(loop, batch)
        if "labels" not in batch and "shift_labels" not in batch:
            return None
        smoothing = loop.args.label_smoothing_factor if loop.loss_type != "mse" else 0.0
        if isinstance(wanted, LogitsWanted) and self.sliced is None:
            loss, answer = self._sliced(model, batch, num_items_in_batch, smoothing, wanted)
            if loss is not None:
                return loss, answer
        outputs = model(
            **{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}, use_cache=False
        )
        logits = (
            outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        )  # return_dict=False: a tuple
        return loss_from_logits(logits, causal_targets(batch), num_items_in_batch, smoothing), outputs

    def _sliced(self, model, batch, num_items_in_batch, smoothing, wanted):
        """``sliced_head.preprocessed_loss``; where the model changes its logits after the output
        layer, the reason is said once and kept (whole logits from then on): ``(None, reason)``."""
        from .sliced_head import preprocessed_loss

        loss, answer = preprocessed_loss(model, batch, num_items_in_batch, smoothing, wanted)
        if loss is None:
            self.sliced = answer
            logging.getLogger("corelooper.lm").warning(
                "corelooper-lm: evaluating with the output layer's logits in one piece, not a slice at a time: %s.",
                answer,
            )
        return loss, answer

    def _exact(self, loop, model) -> bool:
        """Whether the trained-positions head gives this run's loss (checked once per run)."""
        from corelooper.errors import ConfigError

        from .trained_head import why_not_exact

        if self.checked is None:
            reason = why_not_exact(model)
            if reason is None and loop.loss_type != "causal_lm":
                reason = f"this run's loss is {loop.loss_type!r} (train.loss_type), not a causal-LM loss"
            self.checked = reason or ""
            if reason and self.head == "trained":
                raise ConfigError(
                    f"lm.head = 'trained' computes the loss from the logits of the trained positions only, "
                    f"which would not be this model's own loss: {reason}. Use lm.head = 'all'."
                )
        return not self.checked

    @staticmethod
    def _trained_loss(model, batch, num_items_in_batch, smoothing, accuracy=None):
        from corelooper.errors import ConfigError

        from .trained_head import HeadCallError, trained_positions_loss

        try:
            return trained_positions_loss(model, batch, num_items_in_batch, smoothing, accuracy)
        except HeadCallError as e:
            raise ConfigError(
                f"lm.head = 'trained' (the default in [sft] runs) needs the model to call its output layer "
                f"once per forward with the final hidden states, but {e}. Set lm.head = 'all' for this model."
            ) from None
