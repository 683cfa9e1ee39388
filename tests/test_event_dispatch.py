"""``Events.fire`` calls the implementations itself (no pluggy bookkeeping per call): pluggy is the
oracle. The same plugins, fired through ``Events`` and through pluggy's own hook caller, see the
same calls in the same order with the same arguments; monitors and wrappers still work."""

from __future__ import annotations

import copy

import pluggy
import pytest

from corelooper import hookimpl
from corelooper.events import Events
from corelooper.plugins import Plugins

CALLS: list[tuple] = []


class Plain:
    def __init__(self, name):
        self.name = name

    def on_step_end(self, state):
        CALLS.append((self.name, "on_step_end", state))

    def on_log(self, loop, state, logs):
        CALLS.append((self.name, "on_log", loop, state, dict(logs)))
        logs[self.name] = 1  # later implementations see what earlier ones added (as in pluggy)


class First(Plain):
    @hookimpl(tryfirst=True)
    def on_step_end(self, control, state):
        CALLS.append((self.name, "on_step_end", state, control))


class Last(Plain):
    @hookimpl(trylast=True)
    def on_step_end(self):
        CALLS.append((self.name, "on_step_end"))


def _plugins():
    plugins = Plugins()
    for p in (Last("last"), Plain("a"), First("first"), Plain("b")):
        plugins.register(p, p.name)
    return plugins


def _fire_both(plugins, name, **kwargs):
    always = dict(loop="L", state="S", control="C")
    CALLS.clear()
    Events(plugins, **always).fire(name, **copy.deepcopy(kwargs))
    ours = list(CALLS)
    CALLS.clear()
    getattr(plugins.hook, name)(**always, **copy.deepcopy(kwargs))  # pluggy itself
    return ours, list(CALLS)


@pytest.mark.parametrize("event", ["on_step_end", "on_log"])
def test_same_calls_order_and_arguments_as_pluggy(event):
    kwargs = {"logs": {"loss": 1.0}} if event == "on_log" else {}
    ours, theirs = _fire_both(_plugins(), event, **kwargs)
    assert ours == theirs and len(ours) == 4
    if event == "on_step_end":
        assert [c[0] for c in ours] == ["first", "b", "a", "last"]
        assert ours[0] == ("first", "on_step_end", "S", "C")


def test_registration_and_unregistration_take_effect_at_the_next_event():
    plugins = _plugins()
    events = Events(plugins, loop="L", state="S", control="C")
    CALLS.clear()
    events.fire("on_step_end")
    assert len(CALLS) == 4
    plugins.register(Plain("late"), "late")
    plugins.unregister("a")
    CALLS.clear()
    events.fire("on_step_end")
    assert [c[0] for c in CALLS] == ["first", "late", "b", "last"]


def test_a_monitor_sees_every_event_and_a_wrapper_runs():
    plugins = _plugins()
    events = Events(plugins, loop="L", state="S", control="C")
    seen = []
    undo = plugins.pm.add_hookcall_monitoring(lambda name, impls, kw: seen.append(name), lambda *a: None)
    CALLS.clear()
    events.fire("on_step_end")
    assert seen == ["on_step_end"] and len(CALLS) == 4
    undo()
    events.fire("on_step_end")
    assert seen == ["on_step_end"]  # monitoring off again: no more reports

    class Wrapper:
        @hookimpl(wrapper=True)
        def on_step_end(self):
            CALLS.append(("wrapper", "before"))
            yield
            CALLS.append(("wrapper", "after"))

    plugins.register(Wrapper(), "wrapper")
    CALLS.clear()
    events.fire("on_step_end")
    assert CALLS[0] == ("wrapper", "before") and CALLS[-1] == ("wrapper", "after") and len(CALLS) == 6


def test_a_missing_argument_is_pluggys_error_and_a_keyerror_inside_a_hook_is_the_hooks():
    plugins = Plugins()
    plugins.register(Plain("a"), "a")
    events = Events(plugins, loop="L", state="S", control="C")
    with pytest.raises(pluggy.HookCallError, match="must provide argument 'logs'"):
        events.fire("on_log")  # no logs=
    with pytest.raises(pluggy.HookCallError, match="must provide argument 'logs'"), pytest.warns(UserWarning):
        plugins.hook.on_log(loop="L", state="S", control="C")  # pluggy says the same

    class Broken:
        def on_step_end(self, state):
            return {}["missing key"]

    plugins.register(Broken(), "broken")
    with pytest.raises(KeyError, match="missing key"):
        events.fire("on_step_end")
