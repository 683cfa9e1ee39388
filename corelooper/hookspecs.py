"""Every hook corelooper calls, in one place.

Two kinds of hooks:

* **Events** (``on_*``) tell plugins that something happened. They keep the Hugging Face
  ``TrainerCallback`` names and fire at the same points. Every event receives ``loop``, ``state``
  and ``control`` by name, plus its own arguments; an implementation takes any subset of them
  (pluggy's rule), so ``def on_step_end(state, control): ...`` is complete. Events return nothing:
  a plugin changes the run through ``control`` (e.g. ``control.should_training_stop = True``).
* **Providers** (``firstresult=True``) compute something. The builtin plugin implements each one
  with ``trylast=True``, so any other plugin's implementation wins; return ``None`` to let the
  next one answer. Each declares what it returns once, as its return annotation (shown by
  ``corelooper hooks``); ``corelooper.dispatch`` checks every answer against that type, and a wrong
  type is a ``PluginError`` naming the plugin and the hook.
  Hook wrappers on providers are refused at registration (the loop must know which
  implementation answered); a provider that wraps the next one calls
  ``plugins.call_next(hook, self, **kwargs)``. Hook wrappers on events work (not on ``on_exception``,
  called one implementation at a time, like ``corelooper_unconfigure`` and the transforms).

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
      [on_evaluate_begin on_prediction_step... on_log on_evaluate]  (eval_on_start)
      on_epoch_begin
        on_batch_fetched             (each of the step's GA micro-batches, as fetched)
        on_step_begin                (the step's GA micro-batches were fetched; then the
                                      training_step provider runs:)
          on_before_backward, on_after_backward      (each micro-batch)
          on_substep_end             (each micro-batch but the last of the step)
          [on_nonfinite]             (the loss or gradient norm is NaN/Inf: then stop or skip)
        on_pre_optimizer_step        (after gradient clipping)
        on_optimizer_step            (after optimizer.step(), before zero_grad)
        on_step_end                  (state.global_step already incremented)
        [on_log] [on_evaluate_begin ... on_evaluate] [on_save]   (as control asks)
      on_epoch_end
      [on_log] [on_evaluate_begin ... on_evaluate] [on_save]   (epoch strategies)
    [on_log]                         (the last logging window, if not logged yet)
    on_log                           (the run summary: train_runtime, train_loss, ...)
    on_train_end
    on_exception                     (instead of the rest, when anything raises)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # the types of the arguments and answers; dispatch.Returns checks an answer by its type
    from collections.abc import Callable, Iterable
    from pathlib import Path

    import typer
    from torch import Tensor
    from torch.nn import Module
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler as Scheduler
    from torch.utils.data import Dataset

    from .backends.base import Backend
    from .config import Config
    from .loop import Loop
    from .plugins import Plugins
    from .state import Control, LoopState
    from .step import StepResult

    Batch = dict[str, Any]  # one (micro-)batch as a loader yields it
    Batches = Iterable[Batch]
    Collate = Callable[[list], Batch]  # a data collator: examples -> a batch
    Data = Dataset | None  # a dataset, or None where the run has none
    DatasetFn = Callable[[], Dataset]  # builds the dataset when first called
    Loss = Tensor | tuple[Tensor, Any]  # a scalar; (loss, outputs) when return_outputs is true
    Step = StepResult | tuple[Tensor, Tensor | None]  # or an older provider's (loss, grad_norm)
    Evaluation = tuple[dict[str, float], Any, Any]  # (metrics, predictions, label_ids)
    Metrics = dict[str, float]
    EvalMetric = Any  # update(predictions, label_ids), compute() -> Metrics; see eval_metric
    Position = dict[str, Any]  # a checkpoint's loop state (its loop_state.json)
    Records = Iterable[dict[str, Any]]  # one JSON-able record per sample, in dataset order

PROJECT = "corelooper"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


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
def corelooper_configure(config: Config, plugins: Plugins) -> None:
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
def corelooper_unconfigure(config: Config, plugins: Plugins) -> None:
    """The run's Loop ends: close what ``corelooper_configure`` opened (writers, tracker runs).

    pytest's ``pytest_unconfigure``. Called once per ``Loop``, by ``Loop.close()`` (also at the end
    of ``with Loop(...) as loop:``; the CLI closes its Loop after run, eval and predict) or, for a
    script that never closes its Loop, when the Loop is garbage-collected or the interpreter
    exits. Logs written by ``evaluate()``/``predict()`` after ``train()`` still reach an open run.
    """


@hookspec
def corelooper_add_commands(app: typer.Typer) -> None:
    """Add subcommands to the ``corelooper`` command line (datasette's ``register_commands``).

    Called once when the CLI starts, with the typer ``app``: decorate functions with
    ``@app.command()``. Import heavy modules (torch) inside the command, not at module level:
    ``corelooper --help`` loads every installed plugin and must stay fast.
    """


# --------------------------------------------------------------------------------------------
# Transforms: every implementation, in its declared order, each given the previous result
# --------------------------------------------------------------------------------------------


@hookspec
def transform_model(loop: Loop, config: Config, model: Module) -> Module | None:
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
def transform_data(
    loop: Loop, config: Config, model: Module, train_dataset: Data, eval_dataset: Data, data_collator: Collate
) -> dict[str, Any] | None:
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
def create_model(config: Config) -> Module | None:
    """Return the ``torch.nn.Module`` that ``[model]`` describes, or None when this plugin does
    not build it.

    Called once, in ``Loop.__init__``, when no model was passed to ``Loop(model=...)``. The
    builtin calls ``model.factory`` (a ``module:callable``) with ``model.args``; a plugin answers
    for the other ways to name a model (e.g. ``model.name_or_path``, a Hugging Face folder).
    """


@hookspec(firstresult=True)
def create_dataset(config: Config, split: str) -> Dataset | None:
    """Return the dataset ``[data] <split>`` names (``split``: "train", "eval" or "test"), or
    None when this plugin does not read it.

    Called in ``Loop.__init__`` for "train" and "eval" when no dataset was passed, and by
    ``corelooper predict`` for "test". The builtin calls a ``module:callable`` factory with
    ``data.args``; a plugin answers for data files named by path (and ``data.eval_split``).
    """


@hookspec(firstresult=True)
def create_backend(loop: Loop) -> Backend | None:
    """Return the backend that runs the model on the hardware.

    Called once, when the ``Loop`` is constructed (before ``on_init_end``). The builtin returns
    ``corelooper.backends.local.LocalBackend`` for one process on the CPU in full precision (no
    accelerate import: start-up) and ``corelooper.backends.base.AccelerateBackend`` otherwise (several
    processes, bf16/fp16, GPUs); FSDP and DeepSpeed plugins return their own. A
    backend follows the ``corelooper.backends.base.Backend`` protocol (prepare, backward, no_sync,
    clip_grad_norm, reduce, save/load of model and optimizer state).
    """


@hookspec(firstresult=True)
def create_optimizer(loop: Loop, model: Module) -> Optimizer | None:
    """Return the ``torch.optim.Optimizer`` for ``model`` (already on its device).

    Called once per ``train()``, before the backend prepares the model. The builtin builds
    AdamW from ``[train]`` with no weight decay on biases and normalisation weights, by HF's rule
    (`Trainer.get_decay_parameter_names`: `nn.LayerNorm` parameters and names holding `bias`,
    `layernorm`, `rmsnorm`, a `norm` component or a `_norm` suffix).
    """


@hookspec(firstresult=True)
def create_scheduler(loop: Loop, optimizer: Optimizer, num_training_steps: int) -> Scheduler | None:
    """Return a learning-rate scheduler for ``optimizer`` (stepped once per optimizer step).

    ``num_training_steps`` is the total number of optimizer steps of the run. The builtin
    implements ``lr_scheduler_type`` = linear, cosine, constant, constant_with_warmup with
    ``warmup_steps`` (an int, or a float < 1 read as a ratio of the run).
    """


@hookspec(firstresult=True)
def train_dataloader(loop: Loop, dataset: Dataset) -> Batches | None:
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
def eval_dataloader(loop: Loop, dataset: Dataset) -> Batches | None:
    """Return an iterable of evaluation batches for this process (no shuffling, no padding
    duplicates across processes)."""


@hookspec(firstresult=True)
def compute_loss(
    loop: Loop, model: Module, batch: Batch, num_items_in_batch: Tensor | None, return_outputs: bool
) -> Loss | None:
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
def training_step(loop: Loop, micro_batches: list[Batch]) -> Step | None:
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
def evaluation_loop(
    loop: Loop, dataset: Dataset, metric_key_prefix: str, keep_outputs: bool
) -> Evaluation | None:
    """Run the model over ``dataset``; return ``(metrics, predictions, label_ids)``.

    Called by ``Loop.evaluate()`` (``keep_outputs`` false unless metrics need the outputs) and
    ``Loop.predict()`` (true). ``metrics`` has ``{prefix}_loss`` (token-weighted over the whole
    set and all processes) and the prefixed ``compute_metrics``; predictions and labels are in
    dataset order (``None`` when not kept). The builtin is
    ``corelooper.evaluation.run_evaluation``; a plugin may wrap it (auto batch size re-runs it
    with smaller batches after an out-of-memory error).
    """


@hookspec(firstresult=True)
def predict_records(loop: Loop, dataset: Dataset, options: dict[str, Any]) -> Records | None:
    """Return the model's predictions on ``dataset`` as one record per sample (a dict of JSON
    values), in dataset order: what ``corelooper predict`` writes as JSON Lines.

    Called by ``corelooper predict`` on every process, once the checkpoint's weights are loaded
    (``loop.model``); the main process writes the records. ``options`` are the command's:
    ``generate`` (continue each sample's prompt and add the text) and ``max_new_tokens``. A
    plugin that knows its kind of model answers (for a causal LM: each sample's loss, predicted
    tokens and text) and fires ``on_prediction_step`` per batch (the progress bar).
    No answer (None): the command writes what ``evaluation_loop`` returns with
    ``keep_outputs`` (the model's outputs as they are, e.g. a classifier's logits), and refuses
    ``--generate``.
    """


@hookspec(firstresult=True)
def compute_metrics(loop: Loop, predictions: Any, label_ids: Any) -> Metrics | None:
    """Return a dict of metrics (without the ``eval_`` prefix) from the whole evaluation set.

    ``predictions`` and ``label_ids`` are the concatenated model outputs (usually logits) and
    labels, on the CPU, in dataset order. Called at the end of ``evaluate()``/``predict()``
    when a plugin implements it or ``Loop(compute_metrics=...)`` was given.
    """


@hookspec(firstresult=True)
def eval_metric(loop: Loop) -> EvalMetric | None:
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
def resume_config(
    config: Config, plugins: Plugins, directory: Path, world_size: int, dataset: DatasetFn, announce: bool
) -> Config | None:
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
def resume_position(loop: Loop, state: Position, directory: Path) -> Position | None:
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
def on_init_end(loop: Loop, state: LoopState, control: Control) -> None:
    """At the end of ``Loop.__init__``: plugins are configured, model and data transformed
    (``transform_model``, ``transform_data``), the backend created. Read the Loop here; change
    the model or data with the transform hooks, not by assigning to the Loop."""


@hookspec
def on_train_begin(loop: Loop, state: LoopState, control: Control) -> None:
    """At the start of ``train()``: model, optimizer, scheduler and data are ready and any
    checkpoint has been loaded (``state.global_step`` is where training resumes,
    ``state.max_steps`` the run's length). A plugin opens what it writes to here (a logger's
    run, a file) and reads the final model, optimizer and data."""


@hookspec
def on_epoch_begin(loop: Loop, state: LoopState, control: Control) -> None:
    """At the start of each epoch of ``train()``, after the loader was set to the epoch (and, when
    resuming, to the checkpoint's position in it) and before its first batch is fetched.
    ``state.epoch`` is the epoch index as a float (the epochs done so far when resuming mid-epoch).
    A plugin reads the run here (a per-epoch counter starts); nothing to return."""


@hookspec
def on_batch_fetched(loop: Loop, state: LoopState, control: Control, batch: Batch) -> None:
    """After each training micro-batch is fetched from the loader (Composer's
    ``AFTER_DATALOADER``), before ``on_step_begin`` and before it moves to the device.

    ``batch`` is the batch as the collator made it (on the CPU); ``state.global_step`` is the
    steps done before the step it belongs to. A plugin may read it (data statistics, a data
    timer) or change it in place (a dict: a key it adds or replaces is in the batch the step and
    ``compute_loss`` get); the checkpoint's data position counts the loader's batches. Only training
    batches: an evaluation's batches are seen by ``on_prediction_step``."""


@hookspec
def on_step_begin(loop: Loop, state: LoopState, control: Control) -> None:
    """At the start of each optimizer step: its micro-batches were fetched (``on_batch_fetched``,
    each) and the ``training_step`` provider runs next. ``loop.num_micro_batches`` is how many
    were fetched (fewer than ``gradient_accumulation_steps`` at the end of an epoch);
    ``state.global_step`` is the steps done before this one. A plugin reads the run here (a timer
    starts); it changes the step only through a ``training_step`` provider."""


@hookspec
def on_before_backward(loop: Loop, state: LoopState, control: Control, loss: Tensor) -> None:
    """Before ``backward`` on each micro-batch, called by the step (``default_training_step``).

    ``loss`` is the micro-batch's loss as it is differentiated: normalised so that the step's
    micro-batch losses add up to the step's mean loss (``compute_loss``'s rule); a scalar tensor on
    the device, attached to the graph. Read it (detach before keeping it: no host sync per
    micro-batch); changing it in place breaks ``backward``."""


@hookspec
def on_after_backward(loop: Loop, state: LoopState, control: Control, loss: Tensor) -> None:
    """After ``backward`` on each micro-batch; ``loss`` is the one ``on_before_backward`` got.

    The step's gradients are accumulating in ``param.grad`` (not yet clipped, not synchronised
    across processes before the last micro-batch). A plugin may read them, or change them in
    place (they are what the optimizer step uses)."""


@hookspec
def on_substep_end(loop: Loop, state: LoopState, control: Control) -> None:
    """After each micro-batch of an optimizer step except the last (HF's ``on_substep_end``):
    its forward and backward are done, the next micro-batch's come. Gets only ``loop``,
    ``state`` and ``control``; ``state.global_step`` is still the steps done before this one."""


@hookspec
def on_pre_optimizer_step(loop: Loop, state: LoopState, control: Control, optimizer: Optimizer) -> None:
    """After the step's last backward and gradient clipping (``max_grad_norm``), before
    ``optimizer.step()``: ``optimizer`` is the run's optimizer, its parameters' ``grad`` the
    gradients it is about to apply. A plugin may read or change them in place (gradient noise,
    per-layer statistics)."""


@hookspec
def on_optimizer_step(loop: Loop, state: LoopState, control: Control, optimizer: Optimizer) -> None:
    """After ``optimizer.step()``, before the scheduler steps and ``zero_grad`` clears the
    gradients: ``optimizer`` holds the updated parameters and the gradients that were applied
    (weight statistics, EMA of the weights). ``state.global_step`` is not yet incremented."""


@hookspec
def on_step_end(loop: Loop, state: LoopState, control: Control) -> None:
    """At the end of each optimizer step; ``state.global_step`` is already incremented (1 after
    the first step). The builtin flow logic has already set ``control.should_log``,
    ``should_evaluate`` and ``should_save`` from the strategies; a plugin may change them, or set
    ``control.should_training_stop`` to end training after this step."""


@hookspec
def on_log(loop: Loop, state: LoopState, control: Control, logs: dict[str, Any]) -> None:
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
def on_evaluate_begin(loop: Loop, state: LoopState, control: Control, metric_key_prefix: str) -> None:
    """When ``evaluate()`` or ``predict()`` begins, before the ``evaluation_loop`` provider runs
    (Composer's ``EVAL_START``; Lightning's ``on_validation_start``), on every process.

    ``metric_key_prefix`` is the prefix of the metrics to come: "eval" for an evaluation
    (``on_evaluate`` follows), "test" for ``predict()`` (``on_predict`` follows), or the one the
    caller passed. ``loop.is_training`` tells whether it runs inside ``train()``. A plugin starts
    a timer or resets what it collects per evaluation; nothing to return."""


@hookspec
def on_evaluate(loop: Loop, state: LoopState, control: Control, metrics: Metrics) -> None:
    """After an evaluation; ``metrics`` has ``eval_loss`` and the ``eval_``-prefixed metrics.

    Fires on every process (the metrics are already reduced over processes), so a plugin that
    sets ``control`` from them decides the same everywhere; one that writes logs checks
    ``state.is_world_process_zero``."""


@hookspec
def on_prediction_step(loop: Loop, state: LoopState, control: Control, batch: Batch, outputs: Any) -> None:
    """After each batch of ``evaluate()``/``predict()``; ``outputs`` are the model outputs. An
    implementation that takes ``outputs`` makes the evaluation compute them; otherwise a loss-only
    evaluation passes ``None`` (``compute_loss`` was asked for the loss alone)."""


@hookspec
def on_predict(loop: Loop, state: LoopState, control: Control, metrics: Metrics) -> None:
    """At the end of ``predict()``, on every process: ``metrics`` are what the evaluation loop
    computed, ``test_``-prefixed (with the ``metric_key_prefix`` given; no loss without labels).
    Nothing is logged for a prediction; the predictions themselves are ``predict()``'s result."""


@hookspec
def on_save(loop: Loop, state: LoopState, control: Control, checkpoint_dir: Path) -> None:
    """After a checkpoint was written completely and renamed into place at ``checkpoint_dir``
    (a ``pathlib.Path``). Files a plugin wants in the checkpoint belong in its ``state_dict``."""


@hookspec
def on_load_checkpoint(loop: Loop, state: LoopState, control: Control, checkpoint_dir: Path) -> None:
    """When ``train()`` resumes: after the loop restored model, optimizer, scheduler, RNG, loop
    state and plugin states from ``checkpoint_dir`` (a ``pathlib.Path``), before
    ``on_train_begin``. ``state`` is the checkpoint's; a plugin's own state came back through its
    ``load_state_dict``, so this event is for what follows from a resume (a message, a check)."""


@hookspec
def on_epoch_end(loop: Loop, state: LoopState, control: Control) -> None:
    """At the end of each epoch of ``train()`` (its loader is exhausted, or ``max_steps`` or a
    stop ended it). The flow logic has set ``control.should_evaluate`` / ``should_save`` from the
    epoch strategies; a plugin may change them (the evaluation and save follow this event), or
    set ``control.should_training_stop`` to end training after this epoch."""


@hookspec
def on_train_end(loop: Loop, state: LoopState, control: Control) -> None:
    """At the end of ``train()``, also after a preemption (``state.preempted`` is true): flush
    and close what the plugin opened."""


@hookspec
def on_nonfinite(
    loop: Loop,
    state: LoopState,
    control: Control,
    micro_batches: list[Batch],
    sample_indices: list | None,
    loss: Tensor,
    grad_norm: Tensor | None,
    action: str,
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
def on_exception(loop: Loop, state: LoopState, control: Control, exception: BaseException) -> None:
    """When ``train()``, or ``evaluate()``/``predict()`` called alone, is about to raise;
    ``exception`` is what went wrong. Clean up here; the last complete checkpoint is left
    untouched and the exception is re-raised (as a ``PluginError`` naming the plugin and hook
    when a plugin's code raised)."""


# The hooks by kind, in the order they are defined above (docs/hooks.md, `corelooper hooks`).
_SPECS = [(name, obj) for name, obj in list(globals().items()) if hasattr(obj, f"{PROJECT}_spec")]
EVENTS = tuple(name for name, _ in _SPECS if name.startswith("on_"))
PROVIDERS = tuple(name for name, spec in _SPECS if spec.corelooper_spec["firstresult"])
DECLARATIONS = tuple(name for name, _ in _SPECS if name.startswith(f"{PROJECT}_"))
TRANSFORMS = tuple(name for name, _ in _SPECS if name.startswith("transform_"))
