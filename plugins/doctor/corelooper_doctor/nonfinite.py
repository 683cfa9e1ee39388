"""Which module went non-finite first: HF's ``DebugUnderflowOverflow`` idea, run once on the
failing micro-batch only (so healthy steps pay nothing).

``explain(model, batch, loss_fn)`` re-runs one micro-batch with a forward hook on every module
and tensor hooks on every module's inputs and outputs for the backward pass; gradients are
computed with ``torch.autograd.grad`` so the step's own ``.grad`` are left untouched, and the RNG
state is restored afterwards. The first module, in execution order, whose output is not finite
while its inputs were is blamed; when the forward is finite, the first module in backward order
whose input gradient (or weight gradient) is not finite while its output gradient was.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch


def tensors_in(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in nested tuples/lists/dicts/ModelOutputs."""
    if torch.is_tensor(obj):
        return [(prefix or "0", obj)]
    if isinstance(obj, dict) or hasattr(obj, "items") and hasattr(obj, "keys"):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    else:
        return []
    out = []
    for k, v in items:
        out.extend(tensors_in(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def stats(t: torch.Tensor) -> dict[str, Any]:
    """min / max / abs-max of the finite values, and how many are nan / inf."""
    t = t.detach()
    if not t.is_floating_point():
        return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
    finite = torch.isfinite(t)
    vals = t[finite].float()
    out = {
        "dtype": str(t.dtype).replace("torch.", ""),
        "shape": list(t.shape),
        "nan": int(torch.isnan(t).sum()),
        "inf": int(torch.isinf(t).sum()),
    }
    if vals.numel():
        out.update(min=vals.min().item(), max=vals.max().item(), abs_max=vals.abs().max().item())
    return out


def all_finite(ts: list[tuple[str, torch.Tensor]]) -> bool:
    return all(bool(torch.isfinite(t).all()) for _, t in ts if t.is_floating_point())


@contextmanager
def rng_kept():
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class Tracer:
    """Forward hooks on every module; records the first non-finite output and gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.forward_blame: dict | None = None
        self.backward_events: list[tuple[str, str, bool, torch.Tensor]] = []
        self.handles = [
            m.register_forward_hook(self._hook(name or "(model)"), with_kwargs=True)
            for name, m in model.named_modules()
        ]

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            inputs = tensors_in(list(args) + [kwargs])
            outputs = tensors_in(output)
            if self.forward_blame is None and not all_finite(outputs):
                self.forward_blame = describe(name, module, inputs, outputs, all_finite(inputs))
            for path, t in outputs:
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name, "output", path))
            for path, t in inputs:
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(self._grad_hook(name, "input", path))

        return hook

    def _grad_hook(self, name: str, kind: str, path: str):
        def hook(grad):
            self.backward_events.append((name, kind, bool(torch.isfinite(grad).all()), grad.detach()))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def describe(name: str, module, inputs, outputs, inputs_finite: bool) -> dict:
    return {
        "module": name,
        "type": type(module).__name__,
        "inputs_finite": inputs_finite,
        "inputs": {p: stats(t) for p, t in inputs if t.is_floating_point()},
        "weights": {n: stats(p) for n, p in module.named_parameters(recurse=False)},
        "outputs": {p: stats(t) for p, t in outputs if t.is_floating_point()},
    }


def backward_blame(tracer: Tracer, named_grads: list[tuple[str, torch.Tensor | None]]) -> dict | None:
    """The first module in backward order whose output gradient was finite but whose input
    gradient was not; failing that, the module owning the first non-finite weight gradient."""
    seen_output_bad: set[str] = set()
    for name, kind, finite, grad in tracer.backward_events:
        if finite:
            continue
        if kind == "output":
            seen_output_bad.add(name)
            continue
        if name not in seen_output_bad:
            module = tracer.model.get_submodule("" if name == "(model)" else name)
            return {
                "module": name,
                "type": type(module).__name__,
                "where": "gradient of its input",
                "grad_input": stats(grad),
                "weights": {n: stats(p) for n, p in module.named_parameters(recurse=False)},
            }
    for pname, g in named_grads:
        if g is not None and not bool(torch.isfinite(g).all()):
            owner = pname.rsplit(".", 1)[0] if "." in pname else "(model)"
            module = tracer.model.get_submodule("" if owner == "(model)" else owner)
            return {
                "module": owner,
                "type": type(module).__name__,
                "where": f"gradient of its weight {pname}",
                "grad_weight": stats(g),
                "weights": {n: stats(p) for n, p in module.named_parameters(recurse=False)},
            }
    return None


def explain(model: torch.nn.Module, batch, loss_fn) -> dict:
    """Re-run ``loss_fn(model, batch)`` (forward + gradients) and say what went non-finite."""
    report: dict[str, Any] = {"batch": {p: stats(t) for p, t in tensors_in(batch)}}
    bad_params = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad_params:
        report["blame"] = {
            "module": bad_params[0].rsplit(".", 1)[0],
            "where": "weights already non-finite",
            "parameters": bad_params[:10],
        }
        return report
    if not all_finite(tensors_in(batch)):
        report["blame"] = {"module": "(input batch)", "where": "the batch itself holds non-finite values"}
        return report
    tracer = Tracer(model)
    try:
        with rng_kept(), torch.enable_grad():
            loss = loss_fn(model, batch)
            report["loss"] = stats(loss.reshape(-1))
            if tracer.forward_blame is not None:
                report["blame"] = {**tracer.forward_blame, "where": "forward output"}
                return report
            if not bool(torch.isfinite(loss).all()):
                report["blame"] = {
                    "module": "(loss)",
                    "where": "the loss computation, after finite model outputs",
                }
                return report
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
            blame = backward_blame(tracer, [(n, g) for (n, _), g in zip(named, grads, strict=True)])
        report["blame"] = blame or {
            "module": None,
            "where": "not reproduced: this micro-batch is finite when run again",
        }
        return report
    finally:
        tracer.remove()


def summary(report: dict, step: int, micro_batch: int | None) -> str:
    """One paragraph for people."""
    blame = report.get("blame") or {}
    module, where = blame.get("module"), blame.get("where", "")
    if module is None:
        return (
            f"doctor: step {step}: the non-finite value was not reproduced by re-running the "
            f"step's micro-batches one by one ({where}); it may come from the accumulated "
            "gradients, from randomness (dropout), or from another rank."
        )
    parts = [
        f"doctor: step {step}, micro-batch {micro_batch}: first non-finite value in "
        f"{module!r} ({blame.get('type', '?')}), {where}."
    ]
    for label, key in (("inputs", "inputs"), ("weights", "weights")):
        for name, s in list((blame.get(key) or {}).items())[:3]:
            if "abs_max" in s:
                parts.append(
                    f"{label} {name}: min {s['min']:.3g}, max {s['max']:.3g}, "
                    f"abs-max {s['abs_max']:.3g} ({s['dtype']})."
                )
    for key in ("outputs", "grad_input", "grad_weight"):
        s = blame.get(key)
        items = s.items() if key == "outputs" and s else ([(key, s)] if s else [])
        for name, st in list(items)[:2]:
            parts.append(f"{name}: {st.get('nan', 0)} nan, {st.get('inf', 0)} inf of {st.get('shape')}.")
    return " ".join(parts)
