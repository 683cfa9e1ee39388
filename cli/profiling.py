"""``--profile-plugins``: wall time spent inside each plugin's hook implementations.

Every (non-wrapper) hook implementation is wrapped with a timer for the run; the report gives,
per plugin and hook, the number of calls, total time and share of the run. Provider time of the
builtin includes the work it does (e.g. ``compute_loss`` includes the model's forward).
"""

from __future__ import annotations

import time
from collections import defaultdict

CLI_PLUGIN = "cli"  # the name of corelooper run's own per-run object (cli/app.py)


class PluginProfiler:
    def __init__(self, plugins) -> None:
        self.plugins = plugins
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.started = time.perf_counter()
        self.total = 0.0
        self.first: dict[tuple[str, str], float] = {}  # a hook's first call pays one-time imports
        for name, plugin in plugins.pm.list_name_plugin():
            if name.split(".")[0] == CLI_PLUGIN:  # the CLI's own objects (cli, cli.banner...), not the run's
                continue
            for hook, impl in plugins._impls(plugin):
                if impl.hookwrapper or impl.wrapper:
                    continue
                impl.function = self._timed(impl.function, (name, hook))

    def _timed(self, fn, key):
        calls, seconds, first, clock = self.calls, self.seconds, self.first, time.perf_counter

        def timed(*args):
            t = clock()
            try:
                return fn(*args)
            finally:
                seconds[key] += clock() - t
                calls[key] += 1
                first.setdefault(key, seconds[key])

        return timed

    def stop(self) -> None:
        self.total = time.perf_counter() - self.started

    def report(self) -> str:
        total = self.total or (time.perf_counter() - self.started)
        per_plugin: dict[str, float] = defaultdict(float)
        for (plugin, _), s in self.seconds.items():
            per_plugin[plugin] += s
        lines = [
            f"plugin hook time (run: {total:.3f} s; 'first ms': the first call, with the imports it "
            "triggers: torch's first optimizer imports torch._dynamo, ~1.5 s)",
            f"  {'plugin':24s} {'hook':24s} {'calls':>7s} {'total ms':>10s} {'share':>7s} {'first ms':>10s}",
        ]
        for plugin in sorted(per_plugin, key=per_plugin.get, reverse=True):
            rows = sorted(
                ((h, s) for (p, h), s in self.seconds.items() if p == plugin),
                key=lambda r: r[1],
                reverse=True,
            )
            for hook, s in rows:
                lines.append(
                    f"  {plugin:24s} {hook:24s} {self.calls[(plugin, hook)]:7d} "
                    f"{1000 * s:10.2f} {100 * s / total:6.2f}% {1000 * self.first[(plugin, hook)]:10.2f}"
                )
            lines.append(
                f"  {plugin:24s} {'(all hooks)':24s} {'':7s} {1000 * per_plugin[plugin]:10.2f} "
                f"{100 * per_plugin[plugin] / total:6.2f}%"
            )
        return "\n".join(lines)
