"""Save a failing micro-batch with its report, and replay it later:
``corelooper doctor RUN_DIR --replay step-N`` (or ``replay(step_dir, loop)`` from Python)."""

from __future__ import annotations

import json
from pathlib import Path


def loss_fn_for(loop):
    """The run's own loss (its compute_loss provider), normalised per micro-batch."""
    from corelooper.data.loader import count_loss_items

    def loss_fn(model, batch):
        n = count_loss_items(batch, loop.loss_type if loop.loss_type != "auto" else "cross_entropy")
        n = max(int(n), 1)
        return loop.plugins.call_provider(
            "compute_loss", loop=loop, model=model, batch=batch, num_items_in_batch=n, return_outputs=False
        )[0]

    return loss_fn


def _suffix(doc) -> str:
    return "" if doc.world == 1 else f"-rank{doc.rank}"


def save_case(doc, loop, step: int, batch, report: dict, text: str) -> Path:
    from .batchio import save_batch

    folder = Path(doc.out) / "doctor" / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    sfx = _suffix(doc)
    save_batch(
        batch,
        folder / f"batch{sfx}.safetensors",
        {
            "step": step,
            "micro_batch": report.get("micro_batch"),
            "sample_indices": report.get("sample_indices"),
        },
    )
    (folder / f"report{sfx}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (folder / f"report{sfx}.txt").write_text(text + "\n")
    if (
        doc.cfg["save_weights_on_nonfinite"]
        and doc.rank == 0
        and not getattr(loop.backend, "shards_parameters", False)
    ):
        from corelooper.checkpoints.checkpoint import save_weights

        save_weights(
            loop.backend.model_state_dict(loop.model),
            folder,
            loop.args.save_max_shard_size,
            loop.backend.unwrap_model(loop.model),
        )
    return folder


def replay(step_dir: Path, loop) -> dict:
    """Load the saved weights (if any) into ``loop``'s model and re-explain the saved batch."""
    from safetensors.torch import load_file

    from .batchio import load_batch
    from .nonfinite import explain

    step_dir = Path(step_dir)
    model = loop.backend.unwrap_model(loop.model)
    loop.prepare_for_evaluation()  # a Loop that has not trained: what train() sets up
    weights = step_dir / "model.safetensors"
    if weights.is_file():
        model.load_state_dict(load_file(str(weights)), strict=False)
    batches = sorted(step_dir.glob("batch*.safetensors"))
    batch, info = load_batch(batches[0])
    batch = loop.backend.to_device(batch)
    report = explain(model, batch, loss_fn_for(loop))
    report.update(step=info.get("step"), micro_batch=info.get("micro_batch"), replayed_from=str(batches[0]))
    return report
