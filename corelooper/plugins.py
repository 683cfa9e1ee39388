"""The plugin manager: builtin defaults, installed plugins, local plugins, per-project mixing.

Registration order decides which provider wins (pluggy calls the last registered first):
builtin (always last to answer, ``trylast``) < installed plugins (entry-point group
``corelooper``; when two provide the same hook, the name that sorts first wins) < local plugins
from ``[plugins] local`` < objects passed to ``Loop(plugins=[...])``. ``tryfirst``/``trylast``
on an implementation override this. ``corelooper plugins`` prints the outcome.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import os
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .config import Config, import_module
from .errors import ConfigError, PluginError

ENTRY_POINT_GROUP = "corelooper"
AUTOLOAD_ENV = "CORELOOPER_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN = "builtin"

# Sections of first-party plugins, so a config naming one that is not installed says what to install.
KNOWN_SECTIONS = {
    "tensorboard": "corelooper-tensorboard",
    "wandb": "corelooper-wandb",
    "early_stopping": "corelooper-early-stopping",
    "auto_batch_size": "corelooper-auto-batch-size",
    "fsdp": "corelooper-fsdp",
    "deepspeed": "corelooper-deepspeed",
    "peft": "corelooper-peft",
    "neftune": "corelooper-neftune",
    "optuna": "corelooper-optuna",
}


@dataclass
class PluginInfo:
    name: str
    plugin: Any
    kind: str  # builtin | installed | local | object
    dist: str | None = None
    version: str | None = None
    hooks: list[str] = field(default_factory=list)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)


def installed_entry_points() -> list[importlib.metadata.EntryPoint]:
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return sorted(eps, key=lambda ep: ep.name)


KNOWN_HOOKS = frozenset((*hookspecs.EVENTS, *hookspecs.PROVIDERS, *hookspecs.DECLARATIONS))


class _Manager(pluggy.PluginManager):
    """As in pytest: a function named like a hook is an implementation, marked or not."""

    def parse_hookimpl_opts(self, plugin, name):
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name in KNOWN_HOOKS and inspect.isroutine(getattr(plugin, name, None)):
            opts = {}
        return opts


class Plugins:
    """A pluggy ``PluginManager`` plus what the CLI and error messages need to know."""

    def __init__(self) -> None:
        self.pm = _Manager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.info: dict[str, PluginInfo] = {}
        self.skipped: dict[str, str] = {}  # installed but not loaded -> why
        self.config: Config | None = None
        """The run's config with plugin-section defaults filled in (a new, read-only Config)."""
        self.hook = self.pm.hook

    # -- registration ------------------------------------------------------------------------
    def register(self, plugin: Any, name: str, kind: str, dist=None, version=None) -> None:
        if self.pm.is_blocked(name):
            self.skipped[name] = "disabled"
            return
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            detail = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
            raise PluginError(
                f"Plugin {name!r} is invalid: {detail}. See `corelooper hooks` for each hook's "
                "arguments (an implementation may take any subset of them, by name)."
            ) from None
        except ValueError as e:
            raise PluginError(f"Plugin {name!r} could not be registered: {e}") from None
        self._check_names(plugin, name)
        hooks = sorted(
            {hook for hook, _ in self._impls(plugin)}, key=_hook_order
        )
        self.info[name] = PluginInfo(name, plugin, kind, dist, version, hooks)

    def _impls(self, plugin):
        """(hook name, HookImpl) for each hook ``plugin`` implements."""
        for hook_caller in self.pm.get_hookcallers(plugin) or []:
            for impl in hook_caller.get_hookimpls():
                if impl.plugin is plugin:
                    yield hook_caller.name, impl

    def _check_names(self, plugin: Any, name: str) -> None:
        """A misspelt hook name would otherwise be silently ignored."""
        for attr in dir(plugin):
            if attr in KNOWN_HOOKS or attr.startswith("_"):
                continue
            obj = getattr(plugin, attr, None)
            if not callable(obj):
                continue
            marked = self.pm.parse_hookimpl_opts(plugin, attr) is not None
            close = difflib.get_close_matches(attr, sorted(KNOWN_HOOKS), n=1, cutoff=0.85)
            if marked or close:
                hint = f" Did you mean {close[0]!r}?" if close else ""
                self.pm.unregister(plugin)
                raise PluginError(
                    f"Plugin {name!r} implements {attr!r}, which is not a corelooper hook."
                    f"{hint} See `corelooper hooks`."
                )

    def block(self, names: Iterable[str]) -> None:
        for n in names:
            self.pm.set_blocked(n)

    # -- queries -------------------------------------------------------------------------------
    def implemented(self, hook_name: str) -> bool:
        return bool(getattr(self.hook, hook_name).get_hookimpls())

    def implemented_by_others(self, hook_name: str) -> bool:
        """Whether a plugin other than the builtin implements ``hook_name``."""
        builtin = self.pm.get_plugin(BUILTIN)
        return any(i.plugin is not builtin for i in getattr(self.hook, hook_name).get_hookimpls())

    def provider_order(self, hook_name: str) -> list[str]:
        """Plugins providing ``hook_name``, in the order they are asked (first answer wins)."""
        impls = getattr(self.hook, hook_name).get_hookimpls()
        names = {id(p): n for n, p in self.pm.list_name_plugin()}
        return [names[id(i.plugin)] for i in reversed(impls) if not (i.hookwrapper or i.wrapper)]

    def provider_impl(self, hook_name: str):
        impls = [i for i in getattr(self.hook, hook_name).get_hookimpls() if not (i.hookwrapper or i.wrapper)]
        return impls[-1] if impls else None

    def declared_sections(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for impl in self.hook.corelooper_config_sections.get_hookimpls():
            name = self.pm.get_name(impl.plugin)
            try:
                sections = impl.function() or {}
            except Exception as e:
                raise PluginError(
                    f"Plugin {name!r} raised in hook 'corelooper_config_sections': "
                    f"{type(e).__name__}: {e}"
                ) from e
            if name in self.info:
                self.info[name].sections = sections
            for section, defaults in sections.items():
                out.setdefault(section, {}).update(defaults)
        return out

    def blame(self, exc: BaseException) -> tuple[str, str] | None:
        """(plugin, hook) whose implementation raised ``exc``, if a non-builtin one did."""
        codes: dict[Any, tuple[str, str]] = {}
        for name, plugin in self.pm.list_name_plugin():
            if name == BUILTIN or plugin is None:
                continue
            for hook, impl in self._impls(plugin):
                code = getattr(impl.function, "__code__", None)
                if code is not None:
                    codes[code] = (name, hook)
        found = None
        tb = exc.__traceback__
        while tb is not None:
            found = codes.get(tb.tb_frame.f_code, found)
            tb = tb.tb_next
        return found


def _hook_order(name: str) -> int:
    order = [*hookspecs.DECLARATIONS, *hookspecs.PROVIDERS, *hookspecs.EVENTS]
    return order.index(name) if name in order else len(order)


def load_plugins(
    config: Config | None = None,
    objects: Iterable[Any] = (),
    blocked: Iterable[str] = (),
    autoload: bool | None = None,
) -> Plugins:
    """Build the plugin manager for one run (or for ``corelooper plugins``)."""
    from . import builtin, console, metrics_log

    plugins = Plugins()
    cfg = config.plugins if config is not None else None
    blocked = set(blocked) | set(cfg.disable if cfg else ())
    if BUILTIN in blocked:
        raise ConfigError("The builtin plugin cannot be disabled; override its hooks instead.")
    plugins.block(blocked)
    version = _version("corelooper")
    plugins.register(builtin, BUILTIN, "builtin", "corelooper", version)
    plugins.register(console, "console", "builtin", "corelooper", version)
    plugins.register(metrics_log, "jsonl", "builtin", "corelooper", version)

    if autoload is None:
        autoload = not os.environ.get(AUTOLOAD_ENV)
    enable = set(cfg.enable) if cfg and cfg.enable is not None else None
    installed = installed_entry_points()
    if enable is not None:
        unknown = enable - {ep.name for ep in installed}
        if unknown:
            names = [ep.name for ep in installed]
            raise ConfigError(
                f"plugins.enable names {sorted(unknown)}, which are not installed plugins. "
                f"Installed: {names or 'none'}. Install the package (e.g. pip install "
                f"{KNOWN_SECTIONS.get(sorted(unknown)[0], 'corelooper-' + sorted(unknown)[0])})."
            )
    reporters: list[str] = []
    for ep in reversed(installed):  # first name registered last -> asked first
        dist = ep.dist.metadata["Name"] if ep.dist else None
        version = ep.dist.version if ep.dist else None
        if not autoload:
            plugins.skipped[ep.name] = f"autoload off ({AUTOLOAD_ENV})"
            continue
        if ep.name in blocked:
            plugins.skipped[ep.name] = "disabled"
            continue
        if enable is not None and ep.name not in enable:
            plugins.skipped[ep.name] = "not in plugins.enable"
            continue
        try:
            obj = ep.load()
        except Exception as e:
            raise PluginError(
                f"Plugin {ep.name!r} (package {dist or '?'} {version or ''}, entry point "
                f"{ep.value!r}) failed to import: {type(e).__name__}: {e}. Fix or uninstall the "
                f"package, or skip it with `-p no:{ep.name}` or [plugins] disable = [{ep.name!r}]."
            ) from e
        if isinstance(obj, type):
            raise PluginError(
                f"Plugin {ep.name!r} (package {dist}): its entry point names the class "
                f"{obj.__name__}; it must name a module or an instance."
            )
        if _unwanted_reporter(obj, ep.name, config, plugins, reporters):
            continue
        plugins.register(obj, ep.name, "installed", dist, version)
    if config is not None and autoload:
        check_report_to(config, [*reporters, *plugins.skipped])

    base = config.source.parent if config is not None and config.source else None
    for ref in cfg.local if cfg else ():
        module = import_module(ref, "plugins.local", base)
        plugins.register(module, ref, "local")
    for obj in objects:
        name = getattr(obj, "name", None) if not isinstance(obj, types.ModuleType) else obj.__name__
        name = name if isinstance(name, str) else f"{type(obj).__name__}-{id(obj):x}"
        plugins.register(obj, name, "object")

    if config is not None:
        declared = plugins.declared_sections()
        check_sections(config, declared, plugins)
        plugins.config = config.with_defaults(declared)  # a new Config: the given one is not changed
        if getattr(config.train, "auto_find_batch_size", False) and "auto_batch_size" not in declared:
            raise ConfigError(
                "train.auto_find_batch_size = true needs the auto_batch_size plugin, which is not "
                "loaded: `pip install corelooper-auto-batch-size` (or do not disable it)."
            )
    return plugins


def _unwanted_reporter(obj, name: str, config: Config | None, plugins: Plugins, reporters: list[str]) -> bool:
    """A logging plugin (``reports = True``, HF's report_to integrations) not in train.report_to."""
    if not getattr(obj, "reports", False):
        return False
    reporters.append(name)
    if config is not None and not config.train.reports_to(name):
        plugins.skipped[name] = "not in train.report_to"
        return True
    return False


def check_report_to(config: Config, known: list[str]) -> None:
    """``train.report_to`` names only installed logging plugins (or "all" / "none"); ``known``
    also holds the installed plugins skipped for this run (disabled, not enabled)."""
    wanted = config.train.report_to
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    unknown = sorted(set(wanted) - {"all", "none"} - set(known))
    if unknown:
        raise ConfigError(
            f"train.report_to names {unknown}, which no installed logging plugin provides "
            f"(installed: {sorted(known) or 'none'}). Install the plugin (e.g. pip install "
            f"corelooper-{unknown[0]}), or use \"all\" / \"none\"."
        )


def check_sections(config: Config, declared: dict[str, dict], plugins: Plugins) -> None:
    for section in config.sections:
        if section in declared:
            continue
        if section in plugins.skipped:
            continue  # installed, but disabled for this run: its section is ignored
        package = KNOWN_SECTIONS.get(section)
        if package:
            raise ConfigError(
                f"The config has a [{section}] section, but no loaded plugin declares it. "
                f"Install it with `pip install {package}` (or remove the section)."
            )
        close = difflib.get_close_matches(section, list(declared) + list(Config.CORE), n=1)
        hint = f" Did you mean [{close[0]}]?" if close else ""
        raise ConfigError(
            f"Unknown config section [{section}]: no loaded plugin declares it.{hint} "
            "Run `corelooper plugins` to see the sections each plugin declares."
        )


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def add_plugin_commands(app) -> None:
    """Let every installed plugin add CLI subcommands (``corelooper_add_commands``).

    Only entry points are loaded (no builtin, no config): plugin modules import torch lazily,
    so ``corelooper --help`` stays fast. A plugin that fails to import here is skipped; the
    error is reported by the command that needs it (``run`` loads plugins strictly).
    """
    if os.environ.get(AUTOLOAD_ENV):
        return
    pm = _Manager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for ep in installed_entry_points():
        try:
            obj = ep.load()
        except Exception:
            continue
        if not isinstance(obj, type) and callable(getattr(obj, "corelooper_add_commands", None)):
            pm.register(obj, name=ep.name)
    pm.hook.corelooper_add_commands(app=app)
