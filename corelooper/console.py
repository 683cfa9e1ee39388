"""Console output: a rich progress bar on a terminal, plain log lines otherwise.

Registered as the plugin ``console``; ``-p no:console`` silences it.
"""

from __future__ import annotations

import sys

from .hookspecs import hookimpl

_progress = None
_task = None


def _format(logs: dict) -> str:
    parts = []
    for k, v in logs.items():
        if isinstance(v, float):
            v = f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def _print(text: str) -> None:
    if _progress is not None:
        _progress.console.print(text, highlight=False, markup=False)
    else:
        print(text, flush=True)


@hookimpl
def on_train_begin(loop, state):
    global _progress, _task
    if not state.is_world_process_zero:
        return
    _print(
        f"corelooper: training {state.max_steps} steps ({state.num_train_epochs} epochs x "
        f"{state.steps_per_epoch} steps), batch {state.train_batch_size} x "
        f"{state.gradient_accumulation_steps} accumulation x {state.world_size} processes, "
        f"output in {loop.args.output_dir}"
    )
    if loop.args.disable_tqdm or not sys.stdout.isatty():
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    _progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"), transient=False,
    )
    _task = _progress.add_task("train", total=state.max_steps, completed=state.global_step, info="")
    _progress.start()


@hookimpl
def on_step_end(state):
    if _progress is not None:
        _progress.update(_task, completed=state.global_step)


@hookimpl
def on_log(state, logs):
    if _progress is not None and "loss" in logs:
        _progress.update(_task, info=f"loss {logs['loss']:.4g}")
    _print(f"[step {state.global_step}/{state.max_steps}] {_format(logs)}")


@hookimpl
def on_evaluate(state, metrics):
    if not state.is_world_process_zero:
        return
    _print(f"[step {state.global_step}/{state.max_steps}] {_format(metrics)}")


@hookimpl
def on_save(state, checkpoint_dir):
    if state.is_world_process_zero:  # every rank takes part in a save; one reports it
        _print(f"saved {checkpoint_dir}")


def _stop() -> None:
    global _progress
    if _progress is not None:
        _progress.stop()
        _progress = None


@hookimpl
def on_train_end():
    _stop()


@hookimpl
def on_exception():
    _stop()


# Third-party chatter that does not concern the user's run: deprecation notices raised inside
# torch.distributed / DeepSpeed / accelerate / transformers / peft for their own calls, and
# the launchers' banners. `corelooper run --verbose` shows all of it.
_QUIET_MODULES = r"(torch|deepspeed|accelerate|transformers|peft|torchelastic)(\.|$)"
# the launcher's own logs (a failed rank is reported by corelooper, naming it): nothing passes
_LAUNCHER_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")
# the libraries' logs: errors pass
_LIBRARY_LOGGERS = ("DeepSpeed", "deepspeed", "accelerate")


def quiet_third_party(verbose: bool = False) -> None:
    """Filter third-party deprecation warnings and banners (inherited by launched workers)."""
    import logging
    import os
    import warnings

    if verbose:
        os.environ["CORELOOPER_VERBOSE"] = "1"
        return
    if os.environ.get("CORELOOPER_VERBOSE"):
        return
    # transformers' "Writing model shards" bar at every checkpoint (read when it is imported)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=_QUIET_MODULES)
    # torch.distributed's own deprecation notices, attributed to the calling library's line
    warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor|"
                            r"_reduce_scatter_base|_all_gather_base).*")
    # (workers run this too: their CLI gets --verbose passed on.) Filters, not levels: DeepSpeed
    # resets its logger's level when it is imported.
    for name in _LAUNCHER_LOGGERS:
        logging.getLogger(name).addFilter(lambda record: False)
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).addFilter(lambda record: record.levelno >= logging.ERROR)
    if os.environ.get("RANK", "0") != "0":
        # One voice: the ranks run the same code, so rank 0 shows every warning once.
        warnings.simplefilter("ignore")
