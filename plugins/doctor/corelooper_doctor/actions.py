"""What the doctor does when an event calls for more than a timestamp. Each function takes the
``Doctor`` and the event's arguments; none runs on a healthy step except ``window_logs`` (once
per log, on values the loop already synced)."""

from __future__ import annotations

import math
import os

from .settings import PREFIX
from .spikes import append_spike, step_sample_indices


def _indices(loop, windows) -> list[int] | None:
    out: list[int] = []
    for _step, position, n in windows:
        got = step_sample_indices(loop, position, n)
        if got is None:
            return None
        out.extend(got)
    return out if len(out) <= 4096 else None


# -- loss spikes ---------------------------------------------------------------------------------
def per_step_spike(doc, loop, state, optimizer) -> None:
    """Before optimizer.step(): skip a step recorded as skipped (a resume), and with on_spike =
    "skip_batch" read this step's loss (one sync + all-reduce per step: the price of deciding
    before the update) and drop the update of a spiking step."""
    step = state.global_step + 1
    if doc.skipped.should_skip(step):
        optimizer.zero_grad(set_to_none=True)  # skipped before: same data on resume, skip again
        if state.is_world_process_zero:
            doc.say(f"doctor: step {step} skipped again (recorded in {doc.skipped.path}).")
        return
    if not doc.skip_batch or doc._step_loss is None:
        return
    loss = float(loop.backend.reduce_mean(doc._step_loss).item())
    median = doc.spikes.check(loss)
    if median is None:
        return
    record = _spike_record(doc, loop, step, loss, median, [doc.window_steps[-1]], skipped=True)
    optimizer.zero_grad(set_to_none=True)  # optimizer.step() then leaves every weight alone
    doc.skipped_steps[step] = record["sample_indices"]
    doc.skipped.add(record, write=state.is_world_process_zero)
    _report_spike(doc, state, record)


def check_step_losses(doc, loop, state) -> None:
    """spike_per_step (log): the losses of the steps since the last check, read at a log step
    (every rank: one all-reduce of the vector, one read; the loop reads the window loss there
    anyway)."""
    import torch

    steps = [s for s, _ in doc.step_losses]
    values = loop.backend.reduce_mean(torch.stack([v.float() for _, v in doc.step_losses])).tolist()
    doc.step_losses.clear()
    windows = {w[0]: w for w in doc.window_steps}
    for step, loss in zip(steps, values, strict=True):
        median = doc.spikes.check(loss)
        if median is not None:
            doc.spiked_in_window = True
            record = _spike_record(
                doc, loop, step, loss, median, [windows[step]] if step in windows else [], skipped=False
            )
            _report_spike(doc, state, record)


def _spike_record(doc, loop, step, loss, median, windows, skipped: bool) -> dict:
    return {
        "step": step,
        "loss": loss,
        "median": median,
        "factor": doc.cfg["spike_factor"],
        "skipped": skipped,
        "sample_indices": _indices(loop, windows) if windows else None,
    }


def _report_spike(doc, state, record: dict) -> None:
    if not state.is_world_process_zero:
        return
    append_spike(doc.out, record)
    what = "its update was skipped" if record["skipped"] else "logged"
    doc.say(
        f"doctor: loss spike at step {record['step']}: {record['loss']:.4g} > "
        f"{record['factor']} x the rolling median {record['median']:.4g}; {what}"
        + (
            f" (samples {record['sample_indices'][:16]}{'...' if len(record['sample_indices']) > 16 else ''})"
            if record.get("sample_indices")
            else ""
        )
        + "."
    )


def window_logs(doc, loop, state, logs: dict) -> None:
    """on_log (rank 0): time split, host syncs, memory, MFU, and the spike check on the window
    loss (a value the loop already read)."""
    steps = max(state.global_step - doc.last_logged_step, 1)
    doc.last_logged_step = state.global_step
    doc.logged_steps += steps
    if doc.clock is not None:
        _time_split(doc, logs, steps)
    if doc.syncs is not None:
        logs[f"{PREFIX}host_syncs_per_step"] = round(doc.syncs.take() / steps, 3)
    if doc.cfg["memory"]:
        from . import memory

        values = memory.log_values(doc.device)
        logs.update(values)
        doc.memory_peak_gb = max(doc.memory_peak_gb or 0.0, memory.peak_gb(values))
    if doc.peak and "model_tflops_per_second" in logs and "mfu" not in logs:
        logs["mfu"] = round(logs["model_tflops_per_second"] * 1e12 / (doc.peak * doc.world), 6)
    windows = list(doc.window_steps)
    doc.window_steps.clear()
    if doc.spiked_in_window:  # found by the per-step check at this log step
        logs[f"{PREFIX}loss_spike"] = 1
        doc.spiked_in_window = False
    loss = logs.get("loss")
    if doc.per_step or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return
    median = doc.spikes.check(float(loss))
    if median is not None:
        logs[f"{PREFIX}loss_spike"] = 1
        record = _spike_record(doc, loop, state.global_step, loss, median, windows, skipped=False)
        record["window_steps"] = [w[0] for w in windows]
        _report_spike(doc, state, record)


def _time_split(doc, logs: dict, steps: int) -> None:
    from . import timing

    seconds, wall = doc.clock.window()
    logs.update(timing.timing_logs(seconds, wall, doc.hook_timer is not None))
    doc.run_split.add(seconds, wall, steps)
    warning = doc.input_bound.add(seconds["data"], wall, steps)
    if warning:
        doc.say(warning)


def run_summary_line(doc) -> str | None:
    """The doctor's one line at the end of training: the run's time split, host syncs per
    step, the memory peak (the per-window figures are in metrics.jsonl and the loggers)."""
    from . import memory, timing

    parts = []
    split = doc.run_split.shares() if doc.run_split is not None else None
    if split:
        shares, steps = split
        parts.append(
            f"time split of {steps} steps{' (after the first window)' if doc.run_split.wall else ''}: "
            + timing.split_line(shares, doc.hook_timer is not None)
        )
    if doc.syncs is not None:
        parts.append(sync_summary(doc.syncs.taken, doc.logged_steps, doc.syncs.count))
    if doc.memory_peak_gb is not None:
        parts.append(f"memory peak {doc.memory_peak_gb:.3f} GB ({memory.peak_kind(doc.device)})")
    return "doctor: " + "; ".join(parts) + "." if parts else None


def sync_summary(in_windows: int, logged_steps: int, after: int) -> str:
    """Syncs per step over the logged windows; those after the last log (the end-of-run save
    copies every tensor to the host: one sync each) apart, not spread over the steps."""
    line = f"{in_windows / max(logged_steps, 1):.2f} host-device syncs per step"
    return line + (
        f" (and {after} after the last logged step: the end-of-run save and teardown)" if after else ""
    )


# -- memory ------------------------------------------------------------------------------------------
def first_step_breakdown(doc, loop, state) -> None:
    import torch

    from . import memory
    from .throughput_facts import tokens_per_sample

    doc.probe.stop()
    peak = torch.cuda.max_memory_allocated(doc.device) if doc.device.type == "cuda" else None
    model = loop.backend.unwrap_model(loop.model)
    doc.breakdown = memory.breakdown(
        model,
        loop.optimizer,
        doc.device,
        doc.probe.bytes,
        loop.args.per_device_train_batch_size,
        tokens_per_sample(state),
        peak,
    )
    doc.probe = None
    if state.is_world_process_zero:
        doc.write_json("memory.json", doc.breakdown)
        if memory.worth_saying(doc.breakdown) or os.environ.get("CORELOOPER_VERBOSE"):
            doc.say(memory.breakdown_line(doc.breakdown))


def oom_report(doc, loop, state, exception) -> None:
    from . import oom
    from .throughput_facts import layers

    phase = doc.clock.phase if doc.clock is not None else "training"
    phase = {"other": "logging, evaluation or checkpointing", "data": "data loading"}.get(phase, phase)
    vocab = oom.output_rows(loop.backend.unwrap_model(loop.model))
    text = oom.report(
        phase, state.global_step, doc.breakdown, loop.args, doc.world, layers(loop), exception, vocab
    )
    snapshot = oom.dump_cuda_snapshot(doc.out, doc.rank) if doc.device.type == "cuda" else None
    if snapshot:
        text += f" Allocator snapshot: {snapshot} (drag it into https://pytorch.org/memory_viz)."
    doc.write(f"oom-rank{doc.rank}.txt", text + "\n")
    doc.say(text)


# -- non-finite values -----------------------------------------------------------------------------------
def _first_reproduced(model, micro_batches, loss_fn) -> tuple[int, dict]:
    """The first micro-batch whose re-run goes non-finite, with its report (else the last)."""
    from . import nonfinite

    found = (0, {})
    for index, batch in enumerate(micro_batches):
        found = (index, nonfinite.explain(model, batch, loss_fn))
        if found[1]["blame"].get("module") is not None:
            break
    return found


def explain_step(doc, loop, state, micro_batches, sample_indices, loss, grad_norm, action) -> None:
    from . import nonfinite
    from .replay import loss_fn_for, save_case

    step = state.global_step + 1  # the guard fires inside the step, before the counter moves
    model = loop.backend.unwrap_model(loop.model)
    if getattr(loop.backend, "shards_parameters", False):
        report = {
            "blame": {
                "module": None,
                "where": "not re-run: the parameters are sharded "
                "(FSDP/ZeRO-3); replay the saved batch on one process",
            }
        }
        index = 0
    else:
        index, report = _first_reproduced(model, micro_batches, loss_fn_for(loop))
    bad_grads = [
        n for n, p in model.named_parameters() if p.grad is not None and not bool(p.grad.isfinite().all())
    ]
    report.update(
        step=step,
        action=action,
        micro_batch=index,
        rank=doc.rank,
        step_loss=float(loss.detach().float().sum()) if loss is not None else None,
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        parameters_with_nonfinite_grad=bad_grads[:20],
        sample_indices=sample_indices[index] if sample_indices else None,
    )
    text = nonfinite.summary(report, step, index)
    found = report["blame"].get("module") is not None
    if found or doc.rank == 0:
        save_case(doc, loop, step, micro_batches[index], report, text)
        doc.say(text)
