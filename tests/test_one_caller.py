"""The plugin contract (issue 50): every hook is called through one caller (pluggy's executor), so
monitors see every call and wrappers run or are refused when the plugin registers; a plugin's
exception at any moment of a run names the plugin and the hook; only functions a plugin defines
(or marks) implement hooks; two backends for one config are refused by the core."""

from __future__ import annotations

import logging
import re
import types

import pytest
import toys

from corelooper import hookimpl
from corelooper.errors import ConfigError, PluginError
from corelooper.loop import Loop
from corelooper.plugins import Plugins, load_plugins


def plugin_module(name: str, source: str) -> types.ModuleType:
    """A small plugin module whose functions are defined in it (as an installed plugin's are)."""
    module = types.ModuleType(name)
    exec(source, vars(module))
    return module


# moment -> (the hook that raises, its arguments); each plugin module raises RuntimeError("boom")
MOMENTS = {
    "declaring sections": ("corelooper_config_sections", ""),
    "configure": ("corelooper_configure", "config, plugins"),
    "model transform": ("transform_model", "model"),
    "backend": ("create_backend", "loop"),
    "data transform": ("transform_data", "train_dataset"),
    "the Loop is built": ("on_init_end", "loop"),
    "an event": ("on_step_end", "state"),
    "a provider": ("create_optimizer", "loop, model"),
    "the end of training": ("on_train_end", "state"),
    "teardown": ("corelooper_unconfigure", "config"),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_plugin_error_at_any_moment_names_the_plugin_and_the_hook(moment, train_args):
    hook, args = MOMENTS[moment]
    module = plugin_module("boomer", f"def {hook}({args}):\n    raise RuntimeError('boom')\n")
    with pytest.raises(PluginError) as e:
        loop = Loop(toys.mlp(), train_args(max_steps=2), train_dataset=toys.Blobs(16), plugins=[module])
        loop.train()
        loop.close()
    message = str(e.value)
    named = "corelooper_unconfigure failed in plugin 'boomer'" if hook == "corelooper_unconfigure" else None
    assert (named or f"Plugin 'boomer' raised in hook {hook!r}") in message, message
    assert "RuntimeError: boom" in message and (named or "-p no:boomer" in message)


def test_errors_while_the_loop_is_built_say_so(train_args):
    module = plugin_module("boomer", "def create_backend(loop):\n    raise RuntimeError('no device')\n")
    with pytest.raises(
        PluginError, match="'create_backend' while the Loop was built: RuntimeError: no device"
    ):
        Loop(toys.mlp(), train_args(), train_dataset=toys.Blobs(16), plugins=[module])


@pytest.mark.parametrize(
    "hook", ["on_exception", "corelooper_unconfigure", "transform_model", "transform_data"]
)
def test_a_wrapper_on_a_hook_called_one_by_one_is_refused_at_registration(hook):
    class Wrapper:
        name = "wrapper"

    def wrap(*args, **kwargs):
        yield

    wrap.__name__ = hook
    setattr(Wrapper, hook, hookimpl(wrapper=True)(wrap))
    with pytest.raises(PluginError) as e:
        Plugins().register(Wrapper(), "wrapper")
    assert f"Plugin 'wrapper' declares a hook wrapper on {hook!r}" in str(e.value)


def test_a_monitor_sees_every_kind_of_hook_call(train_args):
    """The recorder of corelooper-testing and the doctor's timer are hook-call monitors: they see
    the declarations, configure, transforms, providers, events, on_exception and unconfigure."""
    seen: list[str] = []

    class Monitor:
        name = "monitor"

        def corelooper_configure(self, plugins):
            plugins.pm.add_hookcall_monitoring(lambda name, impls, kw: seen.append(name), lambda *a: None)

        def transform_data(self, train_dataset):
            return None

        def on_step_end(self, state):
            if state.global_step == 2:
                raise ValueError("stop here")

        def on_exception(self, exception):
            pass

    loop = Loop(toys.mlp(), train_args(max_steps=4), train_dataset=toys.Blobs(16), plugins=[Monitor()])
    with pytest.raises(PluginError, match="'monitor' raised in hook 'on_step_end' at global_step 2"):
        loop.train()
    loop.close()
    for hook in (
        "transform_model",
        "create_backend",
        "transform_data",
        "on_init_end",
        "create_optimizer",
        "on_step_end",
        "on_exception",
        "corelooper_unconfigure",
    ):
        assert hook in seen, hook


def test_only_functions_a_plugin_defines_or_marks_are_implementations():
    """A module plugin that imports a function named like a hook does not implement that hook
    (pytest's rule for plugin modules); one it defines does, marked or not."""
    module = plugin_module(
        "importer",
        "from corelooper.hf.optimizers import create_optimizer\n"
        "from corelooper.hf.schedules import create_scheduler\n"
        "def on_log(logs):\n    pass\n",
    )
    plugins = load_plugins(objects=[module], autoload=False)
    assert plugins.info["importer"].hooks == ["on_log"]
    assert (
        plugins.provider_order("create_optimizer")
        == plugins.provider_order("create_scheduler")
        == ["builtin"]
    )


class Answers:
    def __init__(self, name: str):
        self.name, self.asked = name, 0

    def corelooper_config_sections(self):
        return {self.name: {}}

    def create_backend(self, loop):
        from corelooper.backends.local import LocalBackend, local_device

        self.asked += 1
        return LocalBackend(local_device(True)) if self.name in loop.config.sections else None


def test_two_backend_answers_are_refused_naming_both_plugins_and_the_way_out(train_args):
    from corelooper.config import Config

    config = Config.from_dict({"train": train_args().__dict__, "one": {}, "two": {}})
    with pytest.raises(ConfigError) as e:
        Loop(toys.mlp(), config, train_dataset=toys.Blobs(16), plugins=[Answers("one"), Answers("two")])
    assert str(e.value) == (
        "Two plugins answer create_backend for this config: 'two' and 'one'; a run has one backend. "
        "Choose one: disable the other (`-p no:one` or `-p no:two`, or [plugins] disable), or remove "
        "the config section that asks for it ([two] or [one])."
    )
    alone = Answers("one")
    config = Config.from_dict({"train": train_args().__dict__, "one": {}})
    loop = Loop(toys.mlp(), config, train_dataset=toys.Blobs(16), plugins=[alone, Answers("two")])
    assert alone.asked == 1 and type(loop.backend).__name__ == "LocalBackend"


def test_an_on_exception_that_raises_is_named_and_the_others_still_run(train_args, caplog):
    reported: list[str] = []
    first = plugin_module("first", "def on_exception(exception):\n    raise KeyError('cleanup')\n")
    second = plugin_module("second", "def on_exception(exception):\n    REPORTED.append(str(exception))\n")
    second.REPORTED = reported
    boom = plugin_module("boom", "def on_step_end(state):\n    raise ValueError('bad step')\n")
    loop = Loop(
        toys.mlp(), train_args(max_steps=2), train_dataset=toys.Blobs(16), plugins=[second, first, boom]
    )
    with caplog.at_level(logging.WARNING, logger="corelooper"), pytest.raises(PluginError, match="'boom'"):
        loop.train()
    assert reported == ["bad step"]
    assert "Plugin 'first' raised in hook 'on_exception' (KeyError: 'cleanup')" in caplog.text


def test_the_caller_uses_only_pluggys_public_api():
    """pluggy's private names (``pluggy._callers``, ``_hookexec``, ``_inner_hookexec``, ...) change
    between its releases; the core's one caller keeps to the public API (``HookCaller``,
    ``add_hookcall_monitoring``, ``Result``)."""
    from conftest import REPO

    private = re.compile(r"pluggy\._|\.(_hookexec|_inner_hookexec|_multicall|_hookimpls|_call_history)\b")
    used = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "corelooper").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert used == []
