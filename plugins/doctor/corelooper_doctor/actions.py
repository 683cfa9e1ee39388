"""What the doctor does when an event calls for more than a timestamp. Each function takes the
``Doctor`` and the event's arguments; none runs on a healthy step except ``window_logs`` (once
per log, on values the loop already synced)."""

from __future__ import annotations

import math

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
    """Before optimizer.step(): read this step's loss (one sync + all-reduce: the user asked)
    and, with on_spike = "skip_batch", drop the update of a spiking or recorded step."""
    step = state.global_step + 1
    if doc.skipped.should_skip(step):
        optimizer.zero_grad(set_to_none=True)  # skipped before: same data on resume, skip again
        if state.is_world_process_zero:
            doc.say(f"doctor: step {step} skipped again (recorded in {doc.skipped.path}).")
        return
    if not doc.per_step or doc._step_loss is None:
        return
    loss = float(loop.backend.reduce_mean(doc._step_loss).item())
    median = doc.spikes.check(loss)
    if median is None:
        return
    skip = doc.cfg["on_spike"] == "skip_batch"
    record = {"step": step, "loss": loss, "median": median, "factor": doc.cfg["spike_factor"],
              "skipped": skip, "sample_indices": _indices(loop, [doc.window_steps[-1]])}
    if skip:
        optimizer.zero_grad(set_to_none=True)  # optimizer.step() then leaves every weight alone
        doc.skipped_steps[step] = record["sample_indices"]
        doc.skipped.add(record, write=state.is_world_process_zero)
    _report_spike(doc, state, record)


def _report_spike(doc, state, record: dict) -> None:
    if not state.is_world_process_zero:
        return
    append_spike(doc.out, record)
    what = "its update was skipped" if record["skipped"] else "logged"
    doc.say(f"doctor: loss spike at step {record['step']}: {record['loss']:.4g} > "
            f"{record['factor']} x the rolling median {record['median']:.4g}; {what}"
            + (f" (samples {record['sample_indices'][:16]}{'...' if len(record['sample_indices']) > 16 else ''})"
               if record.get("sample_indices") else "") + ".")


def window_logs(doc, loop, state, logs: dict) -> None:
    """on_log (rank 0): time split, memory, MFU, and the spike check on the window loss."""
    from . import memory, timing

    if doc.clock is not None:
        shares = doc.clock.window()
        logs.update(timing.timing_logs(shares))
        warning = timing.input_bound_warning(shares, doc.cfg["input_bound_share"])
        first = doc.windows_logged == 0  # start-up (first batches, warm-up) is not the data's fault
        doc.windows_logged += 1
        if warning and not first and not doc.warned_input:
            doc.warned_input = True
            doc.say(warning)
    if doc.cfg["memory"]:
        logs.update(memory.log_values(doc.device))
    if doc.peak and "model_tflops_per_second" in logs and "mfu" not in logs:
        logs["mfu"] = round(logs["model_tflops_per_second"] * 1e12 / (doc.peak * doc.world), 6)
    windows = list(doc.window_steps)
    doc.window_steps.clear()
    loss = logs.get("loss")
    if doc.per_step or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return
    median = doc.spikes.check(float(loss))
    if median is not None:
        logs["loss_spike"] = 1
        record = {"step": state.global_step, "loss": loss, "median": median,
                  "factor": doc.cfg["spike_factor"], "skipped": False,
                  "window_steps": [w[0] for w in windows], "sample_indices": _indices(loop, windows)}
        _report_spike(doc, state, record)


# -- memory ------------------------------------------------------------------------------------------
def first_step_breakdown(doc, loop, state) -> None:
    import torch

    from . import memory
    from .throughput_facts import tokens_per_sample

    doc.probe.stop()
    peak = torch.cuda.max_memory_allocated(doc.device) if doc.device.type == "cuda" else None
    model = loop.backend.unwrap_model(loop.model)
    doc.breakdown = memory.breakdown(
        model, loop.optimizer, doc.device, doc.probe.bytes, loop.args.per_device_train_batch_size,
        tokens_per_sample(state), peak)
    doc.probe = None
    if state.is_world_process_zero:
        doc.write_json("memory.json", doc.breakdown)
        doc.say(memory.breakdown_line(doc.breakdown))


def oom_report(doc, loop, state, exception) -> None:
    from . import oom
    from .throughput_facts import layers

    phase = doc.clock.phase if doc.clock is not None else "training"
    phase = {"other": "logging, evaluation or checkpointing", "data": "data loading"}.get(phase, phase)
    text = oom.report(phase, state.global_step, doc.breakdown, loop.args, doc.world,
                      layers(loop), exception)
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
        report = {"blame": {"module": None, "where": "not re-run: the parameters are sharded "
                            "(FSDP/ZeRO-3); replay the saved batch on one process"}}
        index = 0
    else:
        index, report = _first_reproduced(model, micro_batches, loss_fn_for(loop))
    bad_grads = [n for n, p in model.named_parameters()
                 if p.grad is not None and not bool(p.grad.isfinite().all())]
    report.update(step=step, action=action, micro_batch=index, rank=doc.rank,
                  step_loss=float(loss.detach().float().sum()) if loss is not None else None,
                  grad_norm=float(grad_norm) if grad_norm is not None else None,
                  parameters_with_nonfinite_grad=bad_grads[:20],
                  sample_indices=sample_indices[index] if sample_indices else None)
    text = nonfinite.summary(report, step, index)
    found = report["blame"].get("module") is not None
    if found or doc.rank == 0:
        save_case(doc, loop, step, micro_batches[index], report, text)
        doc.say(text)
