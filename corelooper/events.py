"""Dispatching event hooks for one ``Loop``.

An event that no plugin implements is not dispatched at all (a pluggy call costs ~1 µs even
then, and some events fire per micro-batch). The "who implements it" answer is cached, and the
cache is dropped whenever a plugin is registered or unregistered, so a plugin registered at
any time is called from the next event on.
"""

from __future__ import annotations

from typing import Any


class Events:
    """``fire(name, **kwargs)`` calls ``name`` with ``loop``, ``state`` and ``control`` added."""

    def __init__(self, plugins, **always: Any) -> None:
        self.plugins = plugins
        self.always = always
        self._callers: dict[str, Any] = {}
        self._version = plugins.version

    def caller(self, name: str):
        """The hook caller of ``name``, or ``None`` when no plugin implements it."""
        if self._version != self.plugins.version:
            self._callers.clear()
            self._version = self.plugins.version
        try:
            return self._callers[name]
        except KeyError:
            caller = getattr(self.plugins.hook, name)
            caller = caller if caller.get_hookimpls() else None
            self._callers[name] = caller
            return caller

    def fire(self, name: str, **kwargs: Any) -> None:
        caller = self.caller(name)
        if caller is not None:
            caller(**self.always, **kwargs)
