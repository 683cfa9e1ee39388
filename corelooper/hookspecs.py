"""Every hook corelooper calls, in one place.

Two kinds of hooks:

* **Events** (``on_*``) tell plugins that something happened. They keep the Hugging Face
  ``TrainerCallback`` names and fire at the same points. Every event receives ``loop``, ``state``
  and ``control`` by name, plus its own arguments; an implementation takes any subset of them
  (pluggy's rule), so ``def on_step_end(state, control): ...`` is complete. Events return nothing:
  a plugin changes the run through ``control`` (e.g. ``control.should_training_stop = True``).
* **Providers** (``firstresult=True``) compute something. The builtin plugin implements each one
  with ``trylast=True``, so any other plugin's implementation wins; return ``None`` to let the
  next one answer. Each declares what it returns (``@returns``, shown by ``corelooper hooks``):
  every answer is checked, and a wrong type is a ``PluginError`` naming the plugin and the hook.
  Hook wrappers on providers are refused at registration (the loop must know which
  implementation answered); a provider that wraps the next one calls
  ``plugins.call_next(hook, self, **kwargs)``. Hook wrappers on events work.

Plugin lifecycle: ``corelooper_config_sections`` (declare keys) -> the config is validated and
made final (a resume's batch geometry is settled here, ``resume_config``: the config is never replaced
afterwards) -> ``corelooper_configure(config, plugins)`` (register per-run objects and
checkpointed state) -> model and data are built -> ``transform_model`` (each in its ``order``) ->
the backend is created (``create_backend``) -> ``transform_data`` (each in its ``order``) ->
``on_init_end`` -> ... -> ``Loop.close()`` -> ``corelooper_unconfigure(config, plugins)`` (close
writers and runs). A plugin registered later, at any time, is configured at registration
(``corelooper_configure`` is historic, as pytest's ``pytest_configure``) and called from the next
event on; one that declares config sections is refused then (its sections come after the config
was validated).

* **Transforms** (``transform_model``, ``transform_data``) change the run's model or data once,
  when the ``Loop`` is built. Every implementation is called, in a declared order (its
  ``order``, see ``corelooper.transforms``; never the order plugins were registered or named in),
  each with the previous one's result; ``None`` keeps it unchanged.

Order of events in ``Loop.train()`` (GA = gradient_accumulation_steps)::

    on_init_end                      (once, when the Loop is constructed)
    [on_load_checkpoint]             (when resuming: after everything was restored)
    on_train_begin
      [on_prediction_step... on_log on_evaluate]  (eval_on_start)
      on_epoch_begin
        on_step_begin                (the step's GA micro-batches were fetched; then the
                                      training_step provider runs:)
          on_before_backward, on_after_backward      (each micro-batch)
          on_substep_end             (each micro-batch but the last of the step)
          [on_nonfinite]             (the loss or gradient norm is NaN/Inf: then stop or skip)
        on_pre_optimizer_step        (after gradient clipping)
        on_optimizer_step            (after optimizer.step(), before zero_grad)
        on_step_end                  (state.global_step already incremented)
        [on_log] [on_prediction_step... on_log on_evaluate] [on_save]   (as control asks)
      on_epoch_end
      [on_log] [on_prediction_step... on_log on_evaluate] [on_save]   (epoch strategies)
    [on_log]                         (the last logging window, if not logged yet)
    on_log                           (the run summary: train_runtime, train_loss, ...)
    on_train_end
    on_exception                     (instead of the rest, when anything raises)
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "corelooper"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def returns(expected: str):
    """Declare, in words, what a provider returns; ``corelooper.dispatch.CHECKS`` checks it."""

    def mark(spec):
        spec.corelooper_returns = expected
        return spec

    return mark


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@hookspec
def corelooper_config_sections() -> dict[str, dict[str, Any]] | None:
    """Declare the config sections this plugin owns, with their keys and defaults.

    Called once per plugin when a config is validated and by ``corelooper plugins``.
    Return ``{"section": {"key": default, ...}}``; a default of ``None`` accepts any type,
    otherwise a value must have the default's type (ints are accepted for floats).
    Keys not declared here are rejected with a "did you mean" hint. The resolved values are
    available as ``loop.config.section("section")``.
    """


@hookspec
def corelooper_settings() -> dict[str, Any] | None:
    """Declare the settings outside this plugin's own section that it answers to.

    Return ``{"train": {key: translate, ...}, "report_to": [name, ...]}`` (either part optional):

    * ``"train"``: ``[train]`` keys (Hugging Face ``TrainingArguments`` names) this plugin
      implements. ``translate(value, train)`` (``train``: the whole ``[train]`` table as written)
      returns None when ``value`` asks nothing of the plugin (HF's default, "off"), else the
      plugin-section values it means, ``{"section": {"key": value}}`` (``{}``: none); it raises
      ``ConfigError`` for a bad value. A key that is not a corelooper ``[train]`` field is
      accepted only because an installed plugin declares it. A key that asks for a plugin while
      no plugin answering to it is loaded (disabled, not in ``[plugins] enable``) is refused
      before training, naming the plugin and the setting.
    * ``"report_to"``: the ``train.report_to`` names of a logger (HF's ``report_to``
      integrations): it is loaded only when ``report_to`` is "all" or names one of them.

    Read from installed plugins when a config is parsed, before any is registered: a plain
    function of the plugin module, with no arguments.
    """


@hookspec(historic=True)
def corelooper_configure(config, plugins) -> None:
    """Set up this plugin for one run: register per-run objects, state and inactivity.

    Called once for every ``Loop`` (and by ``corelooper plugins --config``) after the config is
    validated and before the backend is created, with the run's read-only ``config`` and its
    ``corelooper.plugins.Plugins`` registry; a plugin registered later (``plugins.register``,
    ``loop.plugins.register``) is configured at registration, with the same arguments. As pytest's ``pytest_configure`` registers a reporter
    per session, a plugin that keeps state registers a fresh object here, never a module global::

        def corelooper_configure(config, plugins):
            section = plugins.section_or_inactive(config, "mine")  # None: no [mine] section
            if section is None:
                return
            tracker = Tracker(section)
            plugins.register(tracker, "mine.run")
            plugins.register_for_checkpointing("mine", tracker)

    ``plugins.register_for_checkpointing(name, obj)``: ``obj.state_dict()`` (JSON data) is saved
    in every checkpoint's ``plugins.json`` under ``name``; ``obj.load_state_dict(d)`` restores it.
    ``plugins.set_inactive(name, reason)``: ``corelooper plugins --config`` shows the reason;
    ``plugins.section_or_inactive(config, name)`` returns ``[name]`` with its defaults, or None
    after ``set_inactive`` when the config has no such section.
    """


@hookspec
def corelooper_unconfigure(config, plugins) -> None:
    """The run's Loop ends: close what ``corelooper_configure`` opened (writers, tracker runs).

    pytest's ``pytest_unconfigure``. Called once per ``Loop``, by ``Loop.close()`` (also at the end
    of ``with Loop(...) as loop:``; the CLI closes its Loop after run, eval and predict) or, for a
    script that never closes its Loop, when the Loop is garbage-collected or the interpreter
    exits. Logs written by ``evaluate()``/``predict()`` after ``train()`` still reach an open run.
    """


@hookspec
def corelooper_add_commands(app) -> None:
    """Add subcommands to the ``corelooper`` command line (datasette's ``register_commands``).

    Called once when the CLI starts, with the typer ``app``: decorate functions with
    ``@app.command()``. Import heavy modules (torch) inside the command, not at module level:
    ``corelooper --help`` loads every installed plugin and must stay fast.
    """


# --------------------------------------------------------------------------------------------
# Transforms: every implementation, in its declared order, each given the previous result
# --------------------------------------------------------------------------------------------


@hookspec
def transform_model(loop, config, model):
    """Return the model this run trains instead of ``model`` (or ``None``: unchanged).

    Called once, in ``Loop.__init__``, after the model is built and before the backend is
    created (as TRL wraps a PEFT model before the Trainer creates its Accelerator), so the
    backend, the optimizer and ``on_init_end`` see the transformed model. ``loop`` is the Loop
    being built: ``config``, ``args`` and ``plugins`` are set, ``backend`` is not yet.
    Implementations run in ascending ``order`` (``corelooper.transforms.order``), each with the
    previous one's model: ``MODEL_PATCH`` (100: change the model's own modules, e.g. kernels),
    then ``MODEL_WRAP`` (200: wrap it, e.g. an adapter library's ``get_peft_model``), then those
    that declare none (``DEFAULT_ORDER``, 500); equal orders by plugin name. The result must be a
    ``torch.nn.Module``, else a PluginError names the plugin.
    """


@hookspec
def transform_data(loop, config, model, train_dataset, eval_dataset, data_collator):
    """Return a dict with the parts of the run's data this plugin replaces (or ``None``).

    Keys: ``"train_dataset"``, ``"eval_dataset"``, ``"data_collator"`` (any subset; a value of
    ``None`` sets that part to ``None``). Called once, in ``Loop.__init__``, after
    ``transform_model`` and the backend (``loop.backend`` is set: rank 0 may prepare a cache
    first) and before any loader is built, with the transformed ``model``. Implementations run
    in ascending ``order`` (``corelooper.transforms.order``), each seeing the previous one's
    datasets and collator: ``DATA_TOKENIZE`` (100: rows -> model inputs and their collator,
    e.g. a fine-tuning data plugin), ``DATA_PREPARED`` (200: work on model inputs: filters, curricula),
    then those that declare none (500); equal orders by plugin name.
    """


# --------------------------------------------------------------------------------------------
# Providers (firstresult): the builtin plugin answers last
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
@returns("a torch.nn.Module, or None")
def create_model(config):
    """Return the ``torch.nn.Module`` that ``[model]`` describes, or None when this plugin does
    not build it.

    Called once, in ``Loop.__init__``, when no model was passed to ``Loop(model=...)``. The
    builtin calls ``model.factory`` (a ``module:callable``) with ``model.args``; a plugin answers
    for the other ways to name a model (e.g. ``model.name_or_path``, a Hugging Face folder).
    """


@hookspec(firstresult=True)
@returns("a dataset (map-style: __len__ and __getitem__; or an IterableDataset), or None")
def create_dataset(config, split: str):
    """Return the dataset ``[data] <split>`` names (``split``: "train", "eval" or "test"), or
    None when this plugin does not read it.

    Called in ``Loop.__init__`` for "train" and "eval" when no dataset was passed, and by
    ``corelooper predict`` for "test". The builtin calls a ``module:callable`` factory with
    ``data.args``; a plugin answers for data files named by path (and ``data.eval_split``).
    """


@hookspec(firstresult=True)
@returns("an object with the Backend protocol's methods (corelooper.backends.base.Backend)")
def create_backend(loop):
    """Return the backend that runs the model on the hardware.

    Called once, when the ``Loop`` is constructed (before ``on_init_end``). The builtin returns
    ``corelooper.backends.local.LocalBackend`` for one process on the CPU in full precision (no
    accelerate import: start-up) and ``corelooper.backends.base.AccelerateBackend`` otherwise (several
    processes, bf16/fp16, GPUs); FSDP and DeepSpeed plugins return their own. A
    backend follows the ``corelooper.backends.base.Backend`` protocol (prepare, backward, no_sync,
    clip_grad_norm, reduce, save/load of model and optimizer state).
    """


@hookspec(firstresult=True)
@returns("a torch.optim.Optimizer (or an object with step(), zero_grad() and param_groups)")
def create_optimizer(loop, model):
    """Return the ``torch.optim.Optimizer`` for ``model`` (already on its device).

    Called once per ``train()``, before the backend prepares the model. The builtin builds
    AdamW from ``[train]`` with no weight decay on biases and normalisation weights, by HF's rule
    (`Trainer.get_decay_parameter_names`: `nn.LayerNorm` parameters and names holding `bias`,
    `layernorm`, `rmsnorm`, a `norm` component or a `_norm` suffix).
    """


@hookspec(firstresult=True)
@returns("a learning-rate scheduler (an object with step() and get_last_lr())")
def create_scheduler(loop, optimizer, num_training_steps: int):
    """Return a learning-rate scheduler for ``optimizer`` (stepped once per optimizer step).

    ``num_training_steps`` is the total number of optimizer steps of the run. The builtin
    implements ``lr_scheduler_type`` = linear, cosine, constant, constant_with_warmup with
    ``warmup_steps`` (an int, or a float < 1 read as a ratio of the run).
    """


@hookspec(firstresult=True)
@returns("an iterable of batches")
def train_dataloader(loop, dataset):
    """Return an iterable of training batches for one epoch, for this process.

    The builtin returns a ``corelooper.data.loader.BatchLoader`` for a map-style dataset (a
    seeded, resumable, rank-sharded sampler) and refuses an ``IterableDataset`` (exit 4): a plugin
    loads streams. A loader resumes one of two ways: ``set_epoch(epoch)`` and ``skip(n_batches)``
    (the loop skips what the checkpoint's position says), or its own position, torchdata's
    ``StatefulDataLoader`` protocol: ``state_dict()`` (JSON data) is saved in every checkpoint,
    one file per rank (``data_state_{rank}.json``), and on resume the core calls
    ``load_state_dict(state)`` with this rank's file (rank 0's on a rank the saving run did not
    have), unless ``train.ignore_data_skip`` (then it starts from the beginning, with a warning).
    """


@hookspec(firstresult=True)
@returns("an iterable of batches")
def eval_dataloader(loop, dataset):
    """Return an iterable of evaluation batches for this process (no shuffling, no padding
    duplicates across processes)."""


@hookspec(firstresult=True)
@returns("a scalar torch.Tensor (or (loss, outputs) when return_outputs is true)")
def compute_loss(loop, model, batch, num_items_in_batch, return_outputs: bool):
    """Return the loss of one micro-batch (a scalar tensor), or ``(loss, outputs)`` when
    ``return_outputs`` is true.

    Called for every training micro-batch and every evaluation batch. ``return_outputs`` is
    true when the evaluation needs the outputs (metrics, predictions, an ``on_prediction_step``
    that takes them); a loss-only evaluation asks for the loss alone, as training does. When only
    a metric with ``preprocess_logits`` reads them, it is a ``corelooper.outputs.LogitsWanted``
    (truthy): the provider may answer ``(loss, Preprocessed(predictions))`` (see there).
    ``num_items_in_batch`` is the number of loss-bearing items (tokens with ``label != -100``,
    after the causal shift) in the **whole optimizer step**, summed over its micro-batches and
    over processes. Return ``sum_of_item_losses / num_items_in_batch`` so that the micro-batch
    losses of one step add up to the step's mean loss: that makes gradient accumulation exact.
    An implementation that does not take ``num_items_in_batch`` among its arguments is assumed
    to return a *mean* loss; the loop then divides it by the number of micro-batches.
    """


@hookspec(firstresult=True)
@returns("(loss, grad_norm) with loss a torch.Tensor, or a result with a tensor .loss")
def training_step(loop, micro_batches: list):
    """Run one whole optimizer step over ``micro_batches``; return a ``corelooper.step.StepResult``.

    The HF Trainer's second override point, after ``compute_loss``. ``micro_batches`` are the
    step's batches as fetched (on the CPU). The step returns what it did as a value and writes
    nothing on the Loop: ``StepResult(loss, grad_norm, learning_rate, num_micro_batches)`` —
    ``loss`` the step's loss as a detached tensor (no host sync), ``grad_norm`` the
    clipped-before norm or ``None``, ``learning_rate`` the rate the optimizer step used
    (``None``: no update; the last applied rate is logged), ``num_micro_batches`` the
    micro-batches it ran. An older provider's ``(loss, grad_norm)`` tuple still works (the
    scheduler's current rate is logged then). The builtin is
    ``corelooper.step.default_training_step(loop, micro_batches)``: count ``num_items_in_batch``
    on the host, then for each micro-batch: move it to the device, (``no_sync`` on all but the
    last) ``compute_loss`` -> backward; then clip -> optimizer step -> scheduler -> ``zero_grad``.
    A plugin may replace it (a SAM-style two-pass step), or wrap the next provider by calling
    ``loop.plugins.call_next("training_step", self, loop=loop, micro_batches=...)`` (auto batch
    size retries it with smaller micro-batches).
    """


@hookspec(firstresult=True)
@returns("a tuple (metrics, predictions, label_ids) with metrics a dict")
def evaluation_loop(loop, dataset, metric_key_prefix: str, keep_outputs: bool):
    """Run the model over ``dataset``; return ``(metrics, predictions, label_ids)``.

    Called by ``Loop.evaluate()`` (``keep_outputs`` false unless metrics need the outputs) and
    ``Loop.predict()`` (true). ``metrics`` has ``{prefix}_loss`` (token-weighted over the whole
    set and all processes) and the prefixed ``compute_metrics``; predictions and labels are in
    dataset order (``None`` when not kept). The builtin is
    ``corelooper.evaluation.run_evaluation``; a plugin may wrap it (auto batch size re-runs it
    with smaller batches after an out-of-memory error).
    """


@hookspec(firstresult=True)
@returns("a dict of metrics (or None to let the next provider answer)")
def compute_metrics(loop, predictions, label_ids):
    """Return a dict of metrics (without the ``eval_`` prefix) from the whole evaluation set.

    ``predictions`` and ``label_ids`` are the concatenated model outputs (usually logits) and
    labels, on the CPU, in dataset order. Called at the end of ``evaluate()``/``predict()``
    when a plugin implements it or ``Loop(compute_metrics=...)`` was given.
    """


@hookspec(firstresult=True)
@returns("an object with update(predictions, label_ids) and compute() -> dict (or None)")
def eval_metric(loop):
    """A per-batch metric for ``evaluate()``/``predict()``: no outputs are kept for it.

    Per batch ``update(predictions, label_ids)`` (that batch's model outputs and labels, on the
    device), at the end ``compute()`` -> a dict of metrics (unprefixed); ``reset()`` (optional)
    before each evaluation. With more than one process the core calls ``sync(reduce_sum)``
    before ``compute()``: the metric replaces its state tensors by ``reduce_sum(t)`` (their sum
    over processes). The builtin answers with ``Loop(compute_metrics=obj)`` when ``obj`` has
    ``update`` and ``compute``, and with HF's ``compute_metrics(eval_pred, compute_result)``
    when ``train.batch_eval_metrics`` is true. Replaces ``compute_metrics`` when it answers.

    Optional: ``preprocess_logits(logits) -> tensor``, applied to the logits (the first kept
    output) before ``update``, as HF's ``preprocess_logits_for_metrics``, but it must treat each
    position alone (``argmax(-1)``, top-k, an entropy) so a loss provider may apply it to a slice of
    positions at a time and never hold the whole ``[positions, vocab]`` array (``compute_loss``
    then gets ``return_outputs=corelooper.outputs.LogitsWanted``). ``counted_only = True``:
    ``update`` reads the predictions only where the causal target counts (see ``LogitsWanted``).
    """


@hookspec(firstresult=True)
@returns("a corelooper.config.Config (config itself, or a copy with another batch geometry), or None")
def resume_config(config, plugins, directory, world_size: int, dataset, announce: bool):
    """Return the config to resume checkpoint ``directory`` with on ``world_size`` processes.

    Called by ``Loop.__init__`` for ``train.resume_from_checkpoint`` after the config is
    validated and before any plugin is configured (the config is final from then on), and by
    ``Loop.train(resume_from_checkpoint=...)`` with ``announce=False`` (a config that differs
    from the run's is refused there). ``dataset()`` returns the training data (built from the
    config when first called); ``announce``: this process may print. No answer (None): no
    installed plugin resumes a checkpoint on another world size; the checkpoint is then refused
    when it loads if it was saved on another one (``resume_position``).
    """


@hookspec(firstresult=True)
@returns("a dict (the checkpoint's loop state, its position in this run's micro-batches), or None")
def resume_position(loop, state, directory):
    """Return the checkpoint's loop state (``state``, its ``loop_state.json`` as a dict) with
    ``micro_batches_in_epoch`` rewritten as this run's micro-batches.

    Called while a checkpoint loads, after the weights, optimizer and scheduler were restored
    and before the state is applied and the loader's position is restored (``state["world_size"]``
    is the number of processes that saved it). No answer (None): the position is used as saved;
    a checkpoint saved on another number of processes is then refused (exit 5) unless
    ``train.ignore_data_skip`` restarts the epoch's data.
    """


# --------------------------------------------------------------------------------------------
# Events: never return anything
# --------------------------------------------------------------------------------------------


@hookspec
def on_init_end(loop, state, control) -> None:
    """At the end of ``Loop.__init__``: plugins are configured, model and data transformed
    (``transform_model``, ``transform_data``), the backend created. Read the Loop here; change
    the model or data with the transform hooks, not by assigning to the Loop."""


@hookspec
def on_train_begin(loop, state, control) -> None:
    """At the start of ``train()``: model, optimizer, scheduler and data are ready and any
    checkpoint has been loaded (``state.global_step`` is where training resumes)."""


@hookspec
def on_epoch_begin(loop, state, control) -> None:
    """At the start of each epoch (``state.epoch`` is the epoch index as a float)."""


@hookspec
def on_step_begin(loop, state, control) -> None:
    """At the first micro-batch of each optimizer step, after its micro-batches were fetched."""


@hookspec
def on_before_backward(loop, state, control, loss) -> None:
    """Before ``backward`` on each micro-batch; ``loss`` is the normalised micro-batch loss."""


@hookspec
def on_after_backward(loop, state, control, loss) -> None:
    """After ``backward`` on each micro-batch (gradients of the step are accumulating)."""


@hookspec
def on_substep_end(loop, state, control) -> None:
    """After each micro-batch of an optimizer step except the last (HF semantics)."""


@hookspec
def on_pre_optimizer_step(loop, state, control, optimizer) -> None:
    """After gradient clipping, before ``optimizer.step()``."""


@hookspec
def on_optimizer_step(loop, state, control, optimizer) -> None:
    """After ``optimizer.step()``, before the scheduler step and ``zero_grad``."""


@hookspec
def on_step_end(loop, state, control) -> None:
    """At the end of each optimizer step; ``state.global_step`` is already incremented (1 after
    the first step). The builtin flow logic has already set ``control.should_log``,
    ``should_evaluate`` and ``should_save`` from the strategies; a plugin may change them, or set
    ``control.should_training_stop`` to end training after this step."""


@hookspec
def on_log(loop, state, control, logs: dict) -> None:
    """When the loop logs (every ``logging_steps`` and at the end) and after each evaluation
    (before ``on_evaluate``, as HF). A training log holds ``loss``, ``learning_rate`` (the rate
    that step used), ``grad_norm``, ``epoch``, samples and tokens per second and anything plugins added; an
    evaluation log the ``eval_`` metrics and ``epoch``; both ``num_input_tokens_seen`` unless
    ``include_num_input_tokens_seen = "no"``. The same dict is appended to
    ``state.log_history`` with ``step``. Main process only. To add
    values (e.g. DPO reward margins), update ``logs`` in a ``tryfirst`` implementation: loggers
    then see them, and they are kept in ``log_history``. A key with a namespace, ``name/key``
    (a diagnosis plugin's ``diag/time_share_data``), is a detail: every logger gets it, the
    console prints it only with ``corelooper run --verbose``."""


@hookspec
def on_evaluate(loop, state, control, metrics: dict) -> None:
    """After an evaluation; ``metrics`` has ``eval_loss`` and the ``eval_``-prefixed metrics.

    Fires on every process (the metrics are already reduced over processes), so a plugin that
    sets ``control`` from them decides the same everywhere; one that writes logs checks
    ``state.is_world_process_zero``."""


@hookspec
def on_prediction_step(loop, state, control, batch, outputs) -> None:
    """After each batch of ``evaluate()``/``predict()``; ``outputs`` are the model outputs. An
    implementation that takes ``outputs`` makes the evaluation compute them; otherwise a loss-only
    evaluation passes ``None`` (``compute_loss`` was asked for the loss alone)."""


@hookspec
def on_predict(loop, state, control, metrics: dict) -> None:
    """After ``predict()``; ``metrics`` are ``test_``-prefixed (empty without labels)."""


@hookspec
def on_save(loop, state, control, checkpoint_dir) -> None:
    """After a checkpoint was written completely and renamed into place at ``checkpoint_dir``
    (a ``pathlib.Path``). Files a plugin wants in the checkpoint belong in its ``state_dict``."""


@hookspec
def on_load_checkpoint(loop, state, control, checkpoint_dir) -> None:
    """After the loop restored model, optimizer, scheduler, RNG, loop state and plugin states
    from ``checkpoint_dir``, before training resumes."""


@hookspec
def on_epoch_end(loop, state, control) -> None:
    """At the end of each epoch; ``control.should_evaluate``/``should_save`` reflect the epoch
    strategies and may be changed."""


@hookspec
def on_train_end(loop, state, control) -> None:
    """At the end of ``train()``, also after a preemption (``state.preempted`` is true): flush
    and close what the plugin opened."""


@hookspec
def on_nonfinite(
    loop, state, control, micro_batches: list, sample_indices, loss, grad_norm, action: str
) -> None:
    """The step's loss or gradient norm is not finite (the non-finite guard, ``train.on_nonfinite``).

    Fires before the loop acts, with the step's ``micro_batches`` (on the device),
    ``sample_indices`` (per micro-batch, the dataset indices of its rows, or ``None`` when the
    loader cannot tell), the step's ``loss`` and ``grad_norm`` tensors, and ``action``:
    ``"stop"`` or ``"skip_step"``. The
    gradients of the step are still in place (not yet zeroed). Diagnosis plugins
    re-run a micro-batch here to name the module that went non-finite.
    """


@hookspec
def on_exception(loop, state, control, exception: BaseException) -> None:
    """When ``train()``, or ``evaluate()``/``predict()`` called alone, is about to raise;
    ``exception`` is what went wrong. Clean up here; the last complete checkpoint is left
    untouched and the exception is re-raised (as a ``PluginError`` naming the plugin and hook
    when a plugin's code raised)."""


EVENTS = tuple(name for name, obj in list(globals().items()) if name.startswith("on_") and callable(obj))
PROVIDERS = (
    "create_model",
    "create_dataset",
    "create_backend",
    "create_optimizer",
    "create_scheduler",
    "train_dataloader",
    "eval_dataloader",
    "compute_loss",
    "training_step",
    "evaluation_loop",
    "compute_metrics",
    "eval_metric",
    "resume_config",
    "resume_position",
)
DECLARATIONS = (
    "corelooper_config_sections",
    "corelooper_settings",
    "corelooper_configure",
    "corelooper_unconfigure",
    "corelooper_add_commands",
)
TRANSFORMS = ("transform_model", "transform_data")
