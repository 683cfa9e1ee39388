"""The plugin manager: builtin defaults, installed plugins, local plugins, per-project mixing.

Registration order decides which provider wins (pluggy calls the last registered first):
builtin (always last to answer, ``trylast``) < installed plugins (entry-point group
``corelooper``; when two provide the same hook, the name that sorts first wins) < local plugins
from ``[plugins] local`` < objects passed to ``Loop(plugins=[...])``. ``tryfirst``/``trylast``
on an implementation override this. ``corelooper plugins`` prints the outcome.
"""

from __future__ import annotations

import difflib
import inspect
import os
import traceback
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import AUTOLOAD_ENV, __version__, hookspecs, installed_entry_points, load_installed
from .config import Config, PluginsConfig, import_module
from .dispatch import CHECKS, refuse_wrappers, wrong_result
from .errors import ConfigError, CorelooperError, PluginError
from .hf.args import PLUGIN_OPTIONS, settings_of

ENTRY_POINT_GROUP = "corelooper"
BUILTIN = "builtin"


@dataclass
class PluginInfo:
    name: str
    plugin: Any
    kind: str  # builtin | installed | local | object
    dist: str | None = None
    version: str | None = None
    hooks: list[str] = field(default_factory=list)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)


HOOK_ORDER = (*hookspecs.DECLARATIONS, *hookspecs.TRANSFORMS, *hookspecs.PROVIDERS, *hookspecs.EVENTS)
KNOWN_HOOKS = frozenset(HOOK_ORDER)


class HookManager(pluggy.PluginManager):
    """As in pytest: a function named like a hook is an implementation, marked or not, when the
    plugin defines it (a function a plugin module imports is none)."""

    monitors: tuple = ()  # (before, after) pairs, the latest last

    def parse_hookimpl_opts(self, plugin, name):
        opts = super().parse_hookimpl_opts(plugin, name)
        function = getattr(plugin, name, None)
        if opts is None and name in KNOWN_HOOKS and inspect.isroutine(function):
            module = isinstance(plugin, types.ModuleType)
            opts = None if module and getattr(function, "__module__", None) != plugin.__name__ else {}
        return opts

    def add_hookcall_monitoring(self, before, after):
        """pluggy's, and kept in ``monitors`` for ``Plugins.call``'s direct calls (``monitored``)."""
        undo, pair = super().add_hookcall_monitoring(before, after), (before, after)
        self.monitors = (*self.monitors, pair)

        def undo_both() -> None:
            undo()
            self.monitors = tuple(m for m in self.monitors if m is not pair)

        return undo_both

    def monitored(self, hook_name: str, impls: list, kwargs: dict, call) -> Any:
        """``call()`` seen by the monitors as pluggy's executor shows them a call: the latest
        monitor's ``before`` first and its ``after`` last, with pluggy's ``Result``."""
        for before, _ in reversed(self.monitors):
            before(hook_name, impls, kwargs)
        outcome = pluggy.Result.from_call(call)
        for _, after in self.monitors:
            after(outcome, hook_name, impls, kwargs)
        return outcome.get_result()


class Plugins:
    """A pluggy ``PluginManager`` plus what the CLI and error messages need to know."""

    def __init__(self) -> None:
        self.pm = HookManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.info: dict[str, PluginInfo] = {}
        self.skipped: dict[str, str] = {}  # installed but not loaded -> why
        self.inactive: dict[str, str] = {}  # loaded, but does nothing for this config -> why
        self.stateful: dict[str, Any] = {}  # name -> object saved in checkpoints (plugins.json)
        self.unloaded: dict[str, Any] = {}  # installed, not loaded for this run: name -> entry point
        self.hook = self.pm.hook
        self.version = 0  # bumped by every (un)registration: the loop's event cache checks it
        self._provider_cache: dict[str, tuple[int, list]] = {}
        self.config = None  # the run's validated config, set by load_plugins
        self._configuring = False
        self._configured = False  # corelooper_configure ran: later plugins are configured at once
        self._unconfigured = False

    def get(self, name: str) -> Any:
        """The plugin object registered as ``name`` (e.g. a per-run ``"NAME.run"``), or None."""
        return self.pm.get_plugin(name)

    # -- registration ------------------------------------------------------------------------
    def register(self, plugin: Any, name: str, kind: str | None = None, dist=None, version=None) -> None:
        """Register ``plugin`` under ``name``; it is called from the next event on. Objects
        registered from ``corelooper_configure`` are of kind ``run`` (one per Loop)."""
        kind = kind or ("run" if self._configuring else "object")
        if self.pm.is_blocked(name) or self.pm.is_blocked(name.split(".")[0]):
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
        try:
            self._check_names(plugin, name)
            refuse_wrappers(name, self._impls(plugin))
        except PluginError:
            self.pm.unregister(plugin)
            raise
        implemented = {hook for hook, _ in self._impls(plugin)}
        hooks = [hook for hook in HOOK_ORDER if hook in implemented] + sorted(implemented - KNOWN_HOOKS)
        self.info[name] = PluginInfo(name, plugin, kind, dist, version, hooks)
        self.version += 1
        if self._configured:  # historic, as pytest_configure: a late plugin is configured now
            self._configure_late(plugin, name)

    def _configure_late(self, plugin: Any, name: str) -> None:
        """Configure a plugin registered after the run was configured; refuse one whose config
        sections come too late (the config was validated and its defaults merged without them)."""
        impls = dict(self._impls(plugin))
        if "corelooper_config_sections" in impls and self.call_blamed(
            "corelooper_config_sections", impls["corelooper_config_sections"], {}
        ):
            self.unregister(name)
            raise PluginError(
                f"Plugin {name!r} declares config sections (corelooper_config_sections) but was "
                "registered after the config was validated: pass it to Loop(plugins=[...]) or install "
                "it as an entry point, so that its sections are checked and their defaults filled in."
            )
        if "corelooper_configure" in impls:
            _configure_one(self, impls["corelooper_configure"], self.config)

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.info.pop(name, None)
        self.stateful.pop(name, None)
        self.version += 1

    def register_for_checkpointing(self, name: str, obj: Any) -> None:
        """Save ``obj.state_dict()`` (JSON data) in every checkpoint under ``name``; restore it
        with ``obj.load_state_dict(...)`` on resume (as accelerate's register_for_checkpointing)."""
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise PluginError(
                    f"register_for_checkpointing({name!r}, ...): {type(obj).__name__} has no "
                    f"{method}() method; both state_dict() and load_state_dict() are needed."
                )
        if name in self.stateful and self.stateful[name] is not obj:
            raise PluginError(f"register_for_checkpointing: the name {name!r} is already taken.")
        self.stateful[name] = obj

    def set_inactive(self, name: str, reason: str) -> None:
        """Record that plugin ``name`` does nothing for this config (``corelooper plugins``)."""
        self.inactive[name] = reason

    def section_or_inactive(self, config: Config, name: str, reason: str | None = None) -> dict | None:
        """The section ``[name]`` with its defaults, or None after ``set_inactive`` when the config
        has no such section: the opening of most ``corelooper_configure`` implementations."""
        if name in config.sections:
            return config.section(name)
        self.set_inactive(name, reason or f"no [{name}] section")
        return None

    def unconfigure(self) -> None:
        """``corelooper_unconfigure`` once, when the run's Loop ends (``Loop.close()``, or the
        Loop's finalizer): plugins close writers and runs. Later calls do nothing."""
        if not self._configured or self._unconfigured:
            return
        self._unconfigured = True
        errors = []
        for impl in reversed(self.hook.corelooper_unconfigure.get_hookimpls()):
            try:  # every plugin gets to close its things, even after another one failed
                self.call("corelooper_unconfigure", [impl], {"config": self.config, "plugins": self})
            except Exception as e:
                errors.append(f"{impl.plugin_name!r}: {type(e).__name__}: {e}")
        if errors:
            raise PluginError(f"corelooper_unconfigure failed in plugin {'; '.join(errors)}.")

    def _impls(self, plugin):
        """(hook name, HookImpl) for each hook ``plugin`` implements."""
        for hook_caller in self.pm.get_hookcallers(plugin) or []:
            for impl in hook_caller.get_hookimpls():
                if impl.plugin is plugin:
                    yield hook_caller.name, impl

    def _check_names(self, plugin: Any, name: str) -> None:
        """A misspelt hook name would otherwise be silently ignored."""
        for attr in dir(plugin):
            if attr in KNOWN_HOOKS or attr.startswith("_") or not callable(getattr(plugin, attr, None)):
                continue
            marked = self.pm.parse_hookimpl_opts(plugin, attr) is not None
            close = difflib.get_close_matches(attr, sorted(KNOWN_HOOKS), n=1, cutoff=0.85)
            if marked or close:
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise PluginError(
                    f"Plugin {name!r} implements {attr!r}, which is not a corelooper hook."
                    f"{hint} See `corelooper hooks`."
                )

    # -- queries -------------------------------------------------------------------------------
    def provider_order(self, hook_name: str) -> list[str]:
        """Plugins providing ``hook_name``, in the order they are asked (first answer wins)."""
        return [impl.plugin_name for impl in self._providers(hook_name)]

    def implemented_by_others(self, hook_name: str) -> bool:
        """Whether a plugin other than the builtin provides ``hook_name``."""
        return any(name != BUILTIN for name in self.provider_order(hook_name))

    def only_builtin(self, hook_name: str) -> bool:
        """Whether the builtin plugin is the only provider of ``hook_name``."""
        return self.provider_order(hook_name) == [BUILTIN]

    def call_provider(self, hook_name: str, /, **kwargs) -> tuple[Any, Any]:
        """The one way to call a provider (the loop, the builtin, plugins): as pluggy's
        firstresult does, each answer checked against what the hookspec declares (a wrong type
        raises a PluginError naming the plugin); also returns the implementation that answered
        (the loop reads its signature: does it take ``num_items_in_batch``?)."""
        return self._dispatch(hook_name, self._providers(hook_name), kwargs)

    def call_next(self, hook_name: str, after: Any, /, **kwargs) -> tuple[Any, Any]:
        """As ``call_provider``, asking only the providers after plugin object ``after`` (a
        provider that wraps the next one: auto batch size retries the next ``training_step``)."""
        return self._dispatch(hook_name, self.after(hook_name, after), kwargs)

    def after(self, hook_name: str, plugin: Any) -> list:
        """The providers of ``hook_name`` asked after plugin object ``plugin``."""
        impls = self._providers(hook_name)
        mine = next((n for n, impl in enumerate(impls) if impl.plugin is plugin), None)
        if mine is None:
            raise PluginError(f"call_next({hook_name!r}, {plugin!r}): that object provides no {hook_name!r}.")
        return impls[mine + 1 :]

    def call(self, hook_name: str, impls: list, kwargs: dict[str, Any], firstresult: bool = False) -> Any:
        """The one way corelooper calls hook implementations (providers one by one, transforms in
        their order, configure, unconfigure and on_exception each on its own; ``Events`` for the
        rest). Wrappers (refused but on events) are run by pluggy's own ``HookCaller``; the other
        calls are made directly, in pluggy's order, with pluggy's ``HookCallError`` for a missing
        argument (pluggy's bookkeeping is ~1 µs per implementation, and providers run per
        micro-batch: benchmarks/README.md), shown to hook-call monitors (a recorder, a timer) as
        pluggy shows them a call."""
        if any(impl.wrapper or impl.hookwrapper for impl in impls):  # on an event: all of them
            return getattr(self.hook, hook_name)(**kwargs)  # pluggy's caller runs the wrappers
        if self.pm.monitors:
            return self.pm.monitored(
                hook_name, impls, kwargs, lambda: self.direct(impls, kwargs, firstresult)
            )
        return self.direct(impls, kwargs, firstresult)

    @staticmethod
    def direct(impls: list, kwargs: dict[str, Any], firstresult: bool) -> Any:
        """What pluggy's executor does for implementations that wrap nothing, without its bookkeeping."""
        results = []
        for impl in reversed(impls):  # pluggy calls the list from its end
            try:
                args = [kwargs[name] for name in impl.argnames]
            except KeyError as e:
                raise pluggy.HookCallError(f"hook call must provide argument {e.args[0]!r}") from None
            if (result := impl.function(*args)) is not None:
                if firstresult:
                    return result
                results.append(result)
        return None if firstresult else results

    def call_blamed(self, hook_name: str, impl, kwargs: dict[str, Any]) -> Any:
        """``call`` of one implementation outside a run's loop (declarations, configure,
        transforms): an exception is a ``PluginError`` naming the plugin and the hook."""
        try:
            return self.call(hook_name, [impl], kwargs, True)
        except CorelooperError:  # said already (a config error; a missing data file: DataError, exit 4)
            raise
        except Exception as e:
            raise self.raised(impl.plugin_name, hook_name, e) from e

    def raised(self, name: str, hook: str, e: BaseException, when: str = "") -> PluginError:
        """The error of plugin ``name``'s ``hook`` that raised ``e`` (a per-run object "NAME.run"
        is disabled through its plugin NAME)."""
        base = name.rsplit(".", 1)[0] if getattr(self.info.get(name), "kind", None) == "run" else name
        return PluginError(
            f"Plugin {name!r} raised in hook {hook!r}{when}: {type(e).__name__}: {e}. Fix the plugin, "
            f"or disable it with `-p no:{base}`."
        )

    def _dispatch(self, hook_name: str, impls: list, kwargs: dict) -> tuple[Any, Any]:
        check = CHECKS.get(hook_name)
        for impl in impls:
            result = self.call(hook_name, [impl], kwargs, True)
            if result is not None:
                if check is not None and not check(result, kwargs):
                    raise wrong_result(self, hook_name, impl, result)
                return result, impl
        return None, None

    def _providers(self, hook_name: str) -> list:
        """The implementations of a provider in the order asked (cached until the next
        (un)registration: some providers are called per micro-batch)."""
        version, impls = self._provider_cache.get(hook_name, (None, None))
        if version == self.version:
            return impls
        impls = list(reversed(getattr(self.hook, hook_name).get_hookimpls()))  # tryfirst, last registered
        self._provider_cache[hook_name] = (self.version, impls)
        return impls

    def declared_sections(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for impl in self.hook.corelooper_config_sections.get_hookimpls():
            name = impl.plugin_name
            sections = self.call_blamed("corelooper_config_sections", impl, {}) or {}
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
        for frame, _ in traceback.walk_tb(exc.__traceback__):
            found = codes.get(frame.f_code, found)
        return found


def load_plugins(
    config: Config | None = None,
    objects: Iterable[Any] = (),
    blocked: Iterable[str] = (),
    autoload: bool | None = None,
    settle: Callable[[Config, Plugins], Config] | None = None,
) -> Plugins:
    """Build the plugin manager for one run (or for ``corelooper plugins``). ``settle(config,
    plugins)``: the Loop makes the validated config final (a resume's batch geometry) before
    any plugin is configured."""
    from .builtin import best_metric, flow
    from .builtin import providers as builtin
    from .builtin.console import Console
    from .builtin.metrics_log import MetricsLog
    from .builtin.preemption import PreemptionPlugin

    plugins = Plugins()
    cfg = config.plugins if config is not None else PluginsConfig()
    objects = list(objects)
    # Policies of the core, each a plugin of its own that `-p no:NAME` switches off; the
    # stateful ones are new objects for every run.
    policies = {
        "flow": flow,
        "console": Console(),
        "jsonl": MetricsLog(),
        "preemption": PreemptionPlugin(),
        "best_metric": best_metric,
    }
    blocked = set(blocked) | set(cfg.disable)
    if BUILTIN in blocked:
        raise ConfigError("The builtin plugin cannot be disabled; override its hooks instead.")
    known = [*policies, *(ep.name for ep in installed_entry_points())]
    check_blocked(blocked, known + list(cfg.local) + [_object_name(o) for o in objects])
    for name in blocked:
        plugins.pm.set_blocked(name)
    for name, obj in {BUILTIN: builtin, **policies}.items():
        plugins.register(obj, name, "builtin", "corelooper", __version__)

    if autoload is None:
        autoload = not os.environ.get(AUTOLOAD_ENV)
    _register_installed(plugins, cfg, blocked, autoload, config)
    base = config.source.parent if config is not None and config.source else None
    for ref in cfg.local:
        plugins.register(import_module(ref, "plugins.local", base, PluginError), ref, "local")
    for obj in objects:
        plugins.register(obj, _object_name(obj), "object")

    if config is not None:
        check_settings(config, plugins, policies)
        declared = plugins.declared_sections()
        check_sections(config, declared, plugins)
        config = config.with_defaults(declared) or config
        if settle is not None:
            config = settle(config, plugins)
        plugins.config = config
        configure(plugins, config)
    return plugins


def _object_name(obj: Any) -> str:
    name = getattr(obj, "name", None) if not isinstance(obj, types.ModuleType) else obj.__name__
    return name if isinstance(name, str) else f"{type(obj).__name__}-{id(obj):x}"


def check_blocked(blocked: Iterable[str], known: list[str]) -> None:
    """``-p no:NAME`` / ``[plugins] disable`` name a plugin there is (a typo would leave the
    plugin running); a per-run object ``NAME.run`` counts as its plugin ``NAME``."""
    for name in sorted(blocked):
        if name in known or name.split(".")[0] in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"-p no:{name} / [plugins] disable names {name!r}, which is not an installed plugin nor a "
            f"builtin policy.{hint} Known: {', '.join(sorted(set(known)))}. See `corelooper plugins`."
        )


def _register_installed(
    plugins: Plugins, cfg: PluginsConfig, blocked: set[str], autoload: bool, config: Config | None
) -> None:
    """Installed plugins (entry points), minus the disabled ones and the logging plugins (they
    declare ``report_to`` names, HF's report_to integrations) that ``train.report_to`` leaves
    out; the first name is asked first."""
    installed = installed_entry_points()
    enable = None if cfg.enable is None else set(cfg.enable)
    unknown = sorted(enable - {ep.name for ep in installed}) if enable is not None else []
    if unknown:
        raise ConfigError(
            f"plugins.enable names {unknown}, which are not installed plugins. "
            f"Installed: {[ep.name for ep in installed] or 'none'}. Install the plugin's package "
            f"(first-party ones are named like corelooper-{unknown[0].replace('_', '-')})."
        )
    reporters: list[str] = []
    for ep in reversed(installed):  # first name registered last -> asked first
        if not autoload:
            plugins.skipped[ep.name] = f"autoload off ({AUTOLOAD_ENV})"
        elif ep.name in blocked:
            plugins.skipped[ep.name] = "disabled"
        elif enable is not None and ep.name not in enable:
            plugins.skipped[ep.name] = "not in plugins.enable"
        else:
            dist, version = (ep.dist.metadata["Name"], ep.dist.version) if ep.dist else (None, None)
            obj = load_installed(ep, autoload=True)  # None: blocked around this call (the CLI's -p no:NAME)
            names = list(settings_of(obj, ep.name).get("report_to", ()))  # (settings of None: none)
            reporters.extend(names)
            if obj is not None and (config is None or not names or any(map(config.train.reports_to, names))):
                plugins.register(obj, ep.name, "installed", dist, version)
                continue
            plugins.skipped[ep.name] = "not in train.report_to" if obj is not None else "disabled"
        plugins.unloaded[ep.name] = ep
    if config is not None and autoload:
        check_report_to(config, [*reporters, *plugins.skipped])


def check_settings(config: Config, plugins: Plugins, policies: dict[str, Any]) -> None:
    """A ``[train]`` setting that asks for a plugin (``corelooper_settings``) while no plugin
    answering to it is loaded is refused: the run would silently go without the feature."""
    answered = {key for name in plugins.info for key in settings_of(plugins.get(name), name).get("train", {})}
    train = {
        **config.train.plugin_values,
        **{f: getattr(config.train, f) for f in config.train.__dataclass_fields__},
    }
    unloaded = {n: obj for n, obj in policies.items() if n not in plugins.info}
    for name, ep in plugins.unloaded.items():  # imported for this run, then left out: no new import
        if plugins.skipped.get(name) == "not in train.report_to":
            unloaded[name] = load_installed(ep)
    judged = set(answered)  # keys whose plugin's settings were read
    for name, obj in sorted(unloaded.items()):
        for key, translate in settings_of(obj, name).get("train", {}).items():
            judged.add(key)
            if key in answered or key not in train or translate(train[key], train) is None:
                continue
            why = plugins.skipped.get(name, "disabled")
            raise ConfigError(
                f"train.{key} = {train[key]!r} needs the plugin {name!r}, which answers to it but is not "
                f"loaded for this run ({why}: -p no:{name}, [plugins] disable / enable, or report_to). "
                f"Load the plugin, or remove train.{key}."
            )
    _refuse_unanswered(train, judged, {n: why for n, why in plugins.skipped.items() if n not in unloaded})


def _refuse_unanswered(train: dict[str, Any], judged: set[str], unread: dict[str, str]) -> None:
    """An HF option that plugins answer to (``PLUGIN_OPTIONS``), set to other than HF's default,
    while no loaded plugin answers to it: refused, naming the installed plugins left unimported
    (blocked, not enabled, autoload off), whose settings are not read."""
    for key, defaults in PLUGIN_OPTIONS.items():
        value = train.get(key, defaults[0])
        if key in judged or any(type(value) is type(d) and value == d or value is d for d in defaults):
            continue
        names = "; ".join(f"{n!r} ({why})" for n, why in sorted(unread.items()))
        raise ConfigError(
            f"train.{key} = {value!r} needs a plugin that answers to it, and none is loaded for this run. "
            f"Installed but left out (-p no:NAME, [plugins] disable / enable, or autoload off), so never "
            f"imported: {names}. Load the one that answers to it, or remove train.{key}."
        )


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
            f'corelooper-{unknown[0]}), or use "all" / "none".'
        )


def configure(plugins: Plugins, config: Config) -> None:
    """``corelooper_configure`` of every plugin registered so far, once: per-run objects that
    they register are configured too, and so is any plugin registered later (pytest's historic
    ``pytest_configure``)."""
    done: set[int] = set()
    impls = plugins.hook.corelooper_configure.get_hookimpls
    while todo := [impl for impl in reversed(impls()) if id(impl) not in done]:
        for impl in todo:
            done.add(id(impl))
            _configure_one(plugins, impl, config)
    plugins._configured = True


def _configure_one(plugins: Plugins, impl, config: Config) -> None:
    configuring, plugins._configuring = plugins._configuring, True
    try:
        plugins.call_blamed("corelooper_configure", impl, {"config": config, "plugins": plugins})
    finally:
        plugins._configuring = configuring


def check_sections(config: Config, declared: dict[str, dict], plugins: Plugins) -> None:
    for section in config.sections:
        if section in declared or section in plugins.skipped:  # skipped: installed, disabled for this run
            continue
        close = difflib.get_close_matches(section, list(declared) + list(Config.CORE), n=1)
        hint = (
            f" Did you mean [{close[0]}]?"
            if close
            else f" If a plugin package provides it, install it (`pip install "
            f"corelooper-{section.replace('_', '-')}` for a first-party one), or remove the section."
        )
        raise ConfigError(
            f"Unknown config section [{section}]: no loaded plugin declares it.{hint} "
            "Run `corelooper plugins` to see the sections each plugin declares."
        )
