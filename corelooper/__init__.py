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

# Which installed plugins count (read by the registry and by the `[train]` names plugins declare).
PLUGIN_ALLOWLIST_ENV = "CORELOOPER_PLUGIN_ALLOWLIST"


def installed_entry_points(group: str = "corelooper") -> list:
    """The installed plugins: the entry points of ``group``, by name. When
    ``CORELOOPER_PLUGIN_ALLOWLIST`` is set (entry-point or distribution names, comma-separated),
    only those it names: any other is as if it were not installed, never imported, in this process
    and in the ones it starts (``corelooper run --nproc``, a test suite's CLI runs)."""
    import importlib.metadata
    import os

    def norm(name: str) -> str:  # as pip compares distribution names: case, "-", "_" and "." alike
        return name.strip().lower().replace("_", "-").replace(".", "-")

    allowed = {norm(n) for n in os.environ.get(PLUGIN_ALLOWLIST_ENV, "").split(",") if n.strip()}
    eps = importlib.metadata.entry_points(group=group)
    if allowed:
        eps = [
            e for e in eps if norm(e.name) in allowed or (e.dist is not None and norm(e.dist.name) in allowed)
        ]
    return sorted(eps, key=lambda ep: ep.name)


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
