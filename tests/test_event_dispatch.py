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


def test_two_monitors_see_a_direct_call_as_pluggys_caller_shows_them_one():
    """The direct path shows hook-call monitors what pluggy's executor shows them: the latest
    monitor's ``before`` first and its ``after`` last, the same implementations and arguments,
    the result (or the exception) in a ``pluggy.Result``; with no pluggy private API."""
    plugins = _plugins()
    events = Events(plugins, loop="L", state="S", control="C")
    seen: list[tuple] = []

    def monitor(tag):
        def before(name, impls, kwargs):
            seen.append((tag, "before", name, [i.plugin_name for i in impls], sorted(kwargs)))

        def after(outcome, name, impls, kwargs):
            seen.append((tag, "after", name, outcome.exception is None and outcome.get_result()))

        return before, after

    undo = [plugins.pm.add_hookcall_monitoring(*monitor(tag)) for tag in ("one", "two")]
    events.fire("on_step_end")
    ours = list(seen)
    seen.clear()
    plugins.hook.on_step_end(loop="L", state="S", control="C")  # pluggy itself
    assert ours == seen and [s[:2] for s in ours] == [
        ("two", "before"),
        ("one", "before"),
        ("one", "after"),
        ("two", "after"),
    ]
    assert len(ours[0][3]) == 4 and ours[2][3] == []  # every implementation; on_step_end returns none

    class Broken:
        def on_step_end(self):
            raise KeyError("inside")

    plugins.register(Broken(), "broken")
    seen.clear()
    with pytest.raises(KeyError, match="inside"):
        events.fire("on_step_end")
    assert [s[:2] for s in seen][-1] == ("two", "after") and seen[-1][3] is False  # the exception's outcome
    for u in undo:
        u()
    assert plugins.pm.monitors == ()
    plugins.unregister("broken")
    seen.clear()
    events.fire("on_step_end")
    assert seen == []  # both undone: no more reports


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
