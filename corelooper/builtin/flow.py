"""When to log, evaluate and save: HF's ``DefaultFlowCallback`` (transformers 5.24), registered as
the builtin policy "flow" (``-p no:flow``: then nothing sets ``control`` from the strategies, as an
HF Trainer without its ``DefaultFlowCallback``; a drop-in HF ``Trainer`` runs HF's own instead).
"""

from __future__ import annotations

from ..hookspecs import hookimpl


@hookimpl(tryfirst=True)
def on_step_end(loop, state, control):
    a = loop.args
    step = state.global_step
    if step == 1 and a.logging_first_step:
        control.should_log = True
    if a.logging_strategy == "steps" and step % state.logging_steps == 0:
        control.should_log = True
    evaluating = a.eval_strategy == "steps" and a.eval_delay <= step
    if evaluating and step % state.eval_steps == 0:
        control.should_evaluate = True
    if a.save_strategy == "steps" and step % state.save_steps == 0:
        control.should_save = True
    if step >= state.max_steps:
        control.should_training_stop = True
        # HF 5.x: one more evaluation at the end when the last step is not an eval step
        if evaluating and step % state.eval_steps != 0:
            control.should_evaluate = True
        if a.save_strategy == "steps":
            control.should_save = True
        # Not in HF (see docs/hooks.md, "Differences from the HF Trainer"): the last, partial
        # logging window is logged rather than dropped, so every step's loss reaches the loggers.
        if a.logging_strategy == "steps":
            control.should_log = True


@hookimpl(tryfirst=True)
def on_epoch_end(loop, state, control):
    a = loop.args
    if a.logging_strategy == "epoch":
        control.should_log = True
    # Not in HF either: training that ends here (a plugin stopped it, the last epoch ended, the
    # data ran out before max_steps) logs its last, partial window, before the epoch's evaluation.
    ending = control.should_training_stop or state.global_step >= state.max_steps
    if a.logging_strategy == "steps" and (ending or state.epoch >= state.num_train_epochs):
        control.should_log = True
    if a.eval_strategy == "epoch" and a.eval_delay <= state.epoch:
        control.should_evaluate = True
    if a.save_strategy == "epoch":
        control.should_save = True
