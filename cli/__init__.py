"""The ``corelooper`` command (a typer app), installed as ``corelooper.cli``."""
