"""corelooper: a small, readable PyTorch training loop whose every part is a pluggy hook."""

from __future__ import annotations

import contextlib
import os

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

    def norm(name: str) -> str:  # as pip compares distribution names: case, "-", "_" and "." alike
        return name.strip().lower().replace("_", "-").replace(".", "-")

    allowed = {norm(n) for n in os.environ.get(PLUGIN_ALLOWLIST_ENV, "").split(",") if n.strip()}
    eps = importlib.metadata.entry_points(group=group)
    if allowed:
        eps = [
            e for e in eps if norm(e.name) in allowed or (e.dist is not None and norm(e.dist.name) in allowed)
        ]
    return sorted(eps, key=lambda ep: ep.name)


AUTOLOAD_ENV = "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"
_LOADED: dict[tuple[str, str], object] = {}  # (entry point, its value) -> the plugin object
_BLOCKED: list[frozenset[str]] = [frozenset()]  # the innermost `blocking(...)` last


@contextlib.contextmanager
def blocking(names, enable=None):
    """While in effect, the installed plugins ``names`` (``-p no:NAME``, ``[plugins] disable``,
    ``Loop(blocked_plugins=...)``), and those ``enable`` leaves out (``[plugins] enable``), are
    never imported, as pytest never imports a blocked name."""
    left_out = {ep.name for ep in installed_entry_points()} - set(enable) if enable is not None else set()
    _BLOCKED.append(_BLOCKED[-1] | frozenset(names) | left_out)
    try:
        yield
    finally:
        _BLOCKED.pop()


def load_installed(ep, autoload: bool | None = None):
    """The one loader of installed plugins (the registry, the ``[train]`` names plugins answer
    to, their CLI commands): the plugin object, imported once per process; None while its name
    is blocked or autoload is off (``CORELOOPER_DISABLE_PLUGIN_AUTOLOAD``, unless ``autoload``
    says otherwise: ``load_plugins(autoload=True)``): never imported then.
    An import error is a ``PluginError`` (exit 3) naming the distribution and the entry point."""
    if ep.name in _BLOCKED[-1] or not (not os.environ.get(AUTOLOAD_ENV) if autoload is None else autoload):
        return None
    if (ep.name, ep.value) not in _LOADED:
        from .errors import PluginError, import_failure

        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
        where = f"Plugin {ep.name!r} (package {dist}, entry point {ep.name} = {ep.value!r})"
        try:
            obj = ep.load()
        except Exception as e:
            raise PluginError(
                f"{where} failed to import: {import_failure(e)}. Fix or uninstall the package, or skip it "
                f"with `-p no:{ep.name}`, [plugins] disable = [{ep.name!r}] or {AUTOLOAD_ENV}=1."
            ) from e
        if isinstance(obj, type):
            raise PluginError(
                f"{where} names the class {obj.__name__}; it must name a module or an instance."
            )
        _LOADED[ep.name, ep.value] = obj
    return _LOADED[ep.name, ep.value]


# The public names, each imported from its module when first asked for.
_LAZY = dict.fromkeys(("Config", "TrainArgs"), "config") | dict.fromkeys(("LoopState", "Control"), "state")
_LAZY |= {"hookimpl": "hookspecs", "Loop": "loop"}


def __getattr__(name: str):
    # Lazy: `corelooper --help` and `import corelooper` must not import torch.
    if name not in _LAZY:
        raise AttributeError(f"module 'corelooper' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
