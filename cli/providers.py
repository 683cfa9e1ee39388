"""Who answers each provider hook, as a user reads it: ``corelooper plugins`` and the run banner.

pluggy asks a provider's implementations in one order (``tryfirst``, then the last registered
first, the builtin last) and the first answer that is not None wins. Read as is, that order
misleads: corelooper-lm's per-run objects, registered last, are asked before a user's
``compute_loss`` plugin, yet one of them only passes another plugin's answer on (counting its
tokens) and the other answers only when no other plugin does. A plugin says so on its
implementation, and the lists here follow it:

* ``fn.corelooper_role = "wraps"``: asks the next provider (``plugins.call_next``) and returns
  its answer (measured, retried): shown as "wrapped by", not as the one that answers;
* ``fn.corelooper_role = "gives_way"``: answers only when no plugin but the builtin provides the
  hook: listed after the other plugins.
"""

from __future__ import annotations

from corelooper import hookimpl

BUILTIN = "builtin"


def role(impl) -> str | None:
    return getattr(impl.function, "corelooper_role", None)


def answer_order(plugins, hook: str) -> tuple[list[str], list[str]]:
    """``(the plugins in the order they answer, the plugins that wrap the answer)``."""
    impls = list(reversed(getattr(plugins.hook, hook).get_hookimpls()))  # the order they are asked
    wrappers = [i.plugin_name for i in impls if role(i) == "wraps"]
    answer = [i for i in impls if role(i) != "wraps"]
    first = [i.plugin_name for i in answer if role(i) != "gives_way" and i.plugin_name != BUILTIN]
    later = [i.plugin_name for i in answer if role(i) == "gives_way"]
    return first + later + [i.plugin_name for i in answer if i.plugin_name == BUILTIN], wrappers


def describe(plugins, hook: str) -> str:
    """``compute_loss: mine  (then lm.run, builtin; wrapped by lm.train_token_accuracy)``."""
    order, wrappers = answer_order(plugins, hook)
    rest = [f"then {', '.join(order[1:])}"] if len(order) > 1 else []
    rest += [f"wrapped by {', '.join(wrappers)}"] if wrappers else []
    return f"{hook}: {order[0] if order else '-'}" + (f"  ({'; '.join(rest)})" if rest else "")


class AnswerRecorder:
    """Which plugin answered each provider called while a run starts (the model, the data, the
    backend, the optimizer...): a hook-call monitor from ``corelooper_configure`` until ``stop()``
    at ``on_train_begin`` (while one is installed every hook call goes through pluggy: never
    during training)."""

    def __init__(self, plugins) -> None:
        from corelooper.hookspecs import PROVIDERS

        self.answered: dict[str, str] = {}
        providers = set(PROVIDERS)

        def after(outcome, hook_name, hook_impls, kwargs) -> None:
            if hook_name in providers and outcome.exception is None and outcome.get_result() is not None:
                # the innermost answer comes first (a wrapper returns after the provider it called)
                self.answered.setdefault(hook_name, hook_impls[-1].plugin_name)

        self._undo = plugins.pm.add_hookcall_monitoring(lambda *a: None, after)

    def stop(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


def banner(plugins, answered: dict[str, str]) -> str | None:
    """One line naming the providers a plugin answers for this run (None: only the builtin):
    those already called as they answered, ``compute_loss`` and the providers of the run's own
    plugins (local modules, ``Loop(plugins=...)``) as they will be asked."""
    from corelooper.hookspecs import PROVIDERS

    parts = []
    for hook in PROVIDERS:
        order, wrappers = answer_order(plugins, hook)
        who = answered.get(hook)
        if who is None and order:
            info = plugins.info.get(order[0])
            mine = info is not None and info.kind in ("local", "object")
            who = order[0] if hook == "compute_loss" or mine else None
        if who is None or who == BUILTIN and not wrappers or who == "cli":
            continue
        parts.append(f"{hook} {who}" + (f" (wrapped by {', '.join(wrappers)})" if wrappers else ""))
    return f"corelooper: providers from plugins: {', '.join(parts)}" if parts else None


class RunBanner:
    """``corelooper run``'s line after the console's start line: the providers plugins answer."""

    name = "cli.banner"  # its plugin name

    def __init__(self) -> None:
        self.recorder = None

    def corelooper_configure(self, plugins) -> None:
        self.recorder = AnswerRecorder(plugins)

    @hookimpl(trylast=True)  # after the console's start line
    def on_train_begin(self, loop, state) -> None:
        self.stop()
        if state.is_world_process_zero and loop.plugins.get("console") is not None:
            line = banner(loop.plugins, self.recorder.answered)
            if line:
                print(line, flush=True)

    def stop(self) -> None:
        if self.recorder is not None:
            self.recorder.stop()
