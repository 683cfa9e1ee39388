"""The ``corelooper`` command's first module: stop signals are handled before anything heavy loads.

The console script and ``python -m corelooper`` start here. Importing typer, torch and the
plugins takes a second or more; a SIGTERM or SIGINT in that time (a scheduler cancelling a job
that just started, a Ctrl-C) must end the command with one line and its exit code (75 / 76), not
a ``KeyboardInterrupt`` traceback through an import or a silent death by the signal. So this
module imports only ``corelooper.cli.signals`` (``signal`` and ``threading``) before it installs
the handlers, and only then the typer app.
"""

from __future__ import annotations

import sys


def main() -> None:
    from corelooper.cli.signals import StartupStop, install_startup_handlers

    install_startup_handlers()
    try:
        from corelooper.cli.app import main as app_main

        app_main()
    except StartupStop as e:  # raised while typer, torch or a plugin was being imported
        print(f"corelooper: {e}. Exit {e.exit_code}.", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
