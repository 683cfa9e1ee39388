"""corelooper: a small, readable PyTorch training loop whose every part is a pluggy hook."""

from __future__ import annotations

__version__ = "0.2.0"

__all__ = [
    "Config",
    "Control",
    "Loop",
    "LoopState",
    "TrainArgs",
    "hookimpl",
    "__version__",
]


def __getattr__(name: str):
    # Lazy: `corelooper --help` and `import corelooper` must not import torch.
    if name == "hookimpl":
        from .hookspecs import hookimpl

        return hookimpl
    if name in ("Config", "TrainArgs"):
        from . import config

        return getattr(config, name)
    if name in ("LoopState", "Control"):
        from . import state

        return getattr(state, name)
    if name == "Loop":
        from .loop import Loop

        return Loop
    raise AttributeError(f"module 'corelooper' has no attribute {name!r}")
