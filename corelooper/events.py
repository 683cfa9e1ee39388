"""Dispatching event hooks for one ``Loop``.

An event that no plugin implements is not dispatched at all (a pluggy call costs ~1 µs even
then, and some events fire per micro-batch). The "who implements it" cache is dropped at every
(un)registration: a plugin registered at any time is called from the next event on. The
implementations are called by ``Plugins.call``, the one caller of every hook: directly, in
pluggy's order, each with the arguments it names; through pluggy's executor when a hook wrapper
or a hook-call monitor (``corelooper_testing``'s recorder, a diagnosis plugin's timer) is there.
"""

from __future__ import annotations

from typing import Any


class Events:
    """``fire(name, **kwargs)`` calls ``name`` with ``loop``, ``state`` and ``control`` added."""

    def __init__(self, plugins, **always: Any) -> None:
        self.plugins = plugins
        self.always = always
        self._impls: dict[str, list] = {}
        self._version = plugins.version

    def fire(self, name: str, **kwargs: Any) -> None:
        if self._version != self.plugins.version:  # a plugin came or went: ask pluggy again
            self._impls, self._version = {}, self.plugins.version
        if (impls := self._impls.get(name)) is None:
            impls = self._impls[name] = getattr(self.plugins.hook, name).get_hookimpls()
        if impls:
            kwargs.update(self.always)
            self.plugins.call(name, impls, kwargs)
