"""What the drop-in ``Trainer`` takes from HF: ``TrainingArguments`` as corelooper's ``[train]``, and
which subclass overrides it can honour.

A ``TrainingArguments`` becomes corelooper's ``TrainArgs`` through the core's table of HF names
(``corelooper.hf.args``): a value corelooper cannot honour is refused there, in one paragraph.
The names the drop-in implements itself, HF's way, are left out of that table's reach:
``report_to`` (HF's integration callbacks run through the bridge), ``label_names``,
``prediction_loss_only``, ``average_tokens_across_devices`` (``Trainer.compute_loss``),
``restore_callback_states_from_checkpoint`` (the bridge), ``disable_tqdm`` (HF's progress
callback).
"""

from __future__ import annotations

from typing import Any

from corelooper.errors import ConfigError

# HF names the drop-in Trainer honours itself, HF's way: not given to the core.
HONOURED_BY_THE_DROP_IN = frozenset(
    {
        "report_to",
        "label_names",
        "prediction_loss_only",
        "average_tokens_across_devices",
        "restore_callback_states_from_checkpoint",
        "disable_tqdm",
    }
)

# The overridable methods the drop-in calls where HF calls them (a subclass's override runs).
HONOURED_OVERRIDES = frozenset(
    {
        "__init__",
        "compute_loss",
        "training_step",
        "prediction_step",
        "evaluation_loop",
        "get_train_dataloader",
        "get_eval_dataloader",
        "get_test_dataloader",
        "create_optimizer",
        "create_scheduler",
        "create_optimizer_and_scheduler",
        "get_decay_parameter_names",
        "evaluate",
        "predict",
        "log",
        "train",
        "save_model",
        "save_state",
        "add_callback",
        "pop_callback",
        "remove_callback",
        "is_world_process_zero",
        "is_local_process_zero",
        "hyperparameter_search",
        "_prepare_inputs",
        "floating_point_ops",
        "store_flos",
        "call_model_init",
        "export_config",
    }
)

# Where to do it in corelooper instead, for the HF methods a subclass may override that the drop-in
# never calls (an override would be silently ignored: refused instead).
INSTEAD = {
    "_inner_training_loop": "the loop is corelooper's: change a step with training_step (or a "
    "corelooper training_step provider), the flow with a TrainerCallback or corelooper plugin setting "
    "`control`",
    "_maybe_log_save_evaluate": "override log() or evaluate(), or set `control.should_log / "
    "should_evaluate / should_save` in a TrainerCallback's on_step_end",
    "_save_checkpoint": "checkpoints are corelooper's: add files through a corelooper plugin's "
    "state_dict (plugins.register_for_checkpointing) or react in a TrainerCallback's on_save",
    "_load_from_checkpoint": "checkpoints are corelooper's: restore extra state in a corelooper "
    "plugin's load_state_dict or its on_load_checkpoint event",
    "_load_best_model": "the best checkpoint is loaded by corelooper's best_metric policy "
    "(load_best_model_at_end); react to it in on_train_end",
    "_evaluate": "override evaluate()",
    "_save": "override save_model()",
    "_get_train_sampler": "override get_train_dataloader(), or set train_sampling_strategy",
    "_get_eval_sampler": "override get_eval_dataloader()",
    "get_batch_samples": "override training_step() (it gets each micro-batch and num_items_in_batch)",
    "_get_num_items_in_batch": "override compute_loss() (it gets num_items_in_batch) or set "
    "loss_is_scaled_for_ga",
    "create_accelerator_and_postprocess": "the hardware is corelooper's backend: return your own "
    "from a corelooper create_backend plugin",
    "push_to_hub": "upload args.output_dir after training (`hf upload REPO DIR`) or in an on_save callback",
    "init_hf_repo": "upload args.output_dir after training (`hf upload REPO DIR`)",
    "create_model_card": "write the card after training",
}


def train_args(args) -> Any:
    """corelooper's ``TrainArgs`` for a ``transformers.TrainingArguments``."""
    from corelooper import TrainArgs

    values = {k: v for k, v in args.to_dict().items() if k not in HONOURED_BY_THE_DROP_IN}
    values["report_to"] = "none"  # HF's integrations run as callbacks; corelooper's loggers stay off
    # HF 5 writes a fresh run over output_dir (it has no overwrite_output_dir): so does the drop-in,
    # with a warning naming what it replaces (Trainer.train).
    values["overwrite_output_dir"] = True
    try:
        return TrainArgs(**values)
    except ConfigError as e:
        raise ConfigError(
            f"corelooper_hf.Trainer cannot honour these TrainingArguments: {e} "
            "(TrainingArguments names are corelooper's [train] keys.)"
        ) from None


def refuse_unhonoured_overrides(cls: type) -> None:
    """A subclass that overrides an HF ``Trainer`` method the drop-in never calls is refused,
    naming the method and the corelooper way; never silently ignored."""
    from .trainer import Trainer

    for klass in cls.__mro__:
        if klass is Trainer or not issubclass(klass, Trainer):
            continue
        for name in vars(klass):
            if name in HONOURED_OVERRIDES or not callable(vars(klass)[name]):
                continue
            if name in INSTEAD:
                raise ConfigError(
                    f"{klass.__name__}.{name} overrides a transformers.Trainer method that "
                    f"corelooper_hf.Trainer never calls, so it would be silently ignored: {INSTEAD[name]}. "
                    "(docs/moving-from-hf.md lists what a drop-in subclass can override.)"
                )
