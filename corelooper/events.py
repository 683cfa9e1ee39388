"""Dispatching event hooks for one ``Loop``.

An event that no plugin implements is not dispatched at all (a pluggy call costs ~1 µs even
then, and some events fire per micro-batch). The "who implements it" cache is dropped at every
(un)registration: a plugin registered at any time is called from the next event on.

The implementations are called in pluggy's order, each with the arguments it names, as pluggy's
executor does but without its bookkeeping (~1 µs per implementation: 20 plugins on a 1 ms step
would cost 7%). Through pluggy itself: an event with a hook wrapper, and every event while a
hook-call monitor is installed (``corelooper_testing``'s recorder, a diagnosis plugin's timer).
"""

from __future__ import annotations

from typing import Any

from pluggy import HookCallError


class Events:
    """``fire(name, **kwargs)`` calls ``name`` with ``loop``, ``state`` and ``control`` added."""

    def __init__(self, plugins, **always: Any) -> None:
        self.plugins = plugins
        self.always = always
        self._callers: dict[str, tuple[Any, list | None]] = {}
        self._version = plugins.version

    def _lookup(self, name: str) -> tuple[Any, list | None]:
        """(caller or None, implementations in call order, or None when pluggy must run them)."""
        if self._version != self.plugins.version:
            self._callers.clear()
            self._version = self.plugins.version
        if name not in self._callers:
            caller = getattr(self.plugins.hook, name)
            impls = caller.get_hookimpls()
            if not impls:
                self._callers[name] = (None, None)
            elif any(i.hookwrapper or i.wrapper for i in impls):
                self._callers[name] = (caller, None)
            else:  # pluggy calls the list from its end
                self._callers[name] = (caller, [(i.function, tuple(i.argnames)) for i in reversed(impls)])
        return self._callers[name]

    def fire(self, name: str, **kwargs: Any) -> None:
        caller, impls = self._lookup(name)
        if caller is None:
            return
        kwargs.update(self.always)
        if impls is None or self.plugins.pm.monitors:
            caller(**kwargs)
            return
        try:
            for function, argnames in impls:
                if len(argnames) == 1:  # most event hooks take one argument: no list to build
                    function(kwargs[argnames[0]])
                else:
                    function(*[kwargs[a] for a in argnames])
        except KeyError:
            missing = [a for a in argnames if a not in kwargs]
            if missing:  # as pluggy says it (a KeyError inside the hook itself is raised as is)
                raise HookCallError(f"hook call must provide argument {missing[0]!r}") from None
            raise
