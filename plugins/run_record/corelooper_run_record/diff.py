"""``corelooper diff RUN_A RUN_B``: what differs between two runs, from their ``run.json``
(config, versions, plugins, data, git, host, world size, device), and the first logged step
where their training losses part (``metrics.jsonl``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer

from . import split_sets

SECTIONS = ("config", "versions", "plugins", "data", "git", "command", "host", "world_size", "device")
LOSS_RTOL = 1e-6  # relative: the same run twice on one machine logs the same floats


def read_record(run_dir: Path) -> dict:
    from corelooper.errors import ConfigError

    path = run_dir / "run.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{str(run_dir)!r} has no run.json: name a run folder (train.output_dir) "
            "written by corelooper run."
        ) from None
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}).") from None


def flatten(value, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, object] = {}
    for key, sub in value.items():
        out.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
    return out


ABSENT = object()  # a key one record does not have


def shown(value) -> str:
    """A value as the config would write it: ``5``, not ``5.0``; ``(absent)`` unquoted."""
    if value is ABSENT:
        return "(absent)"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return json.dumps(value, default=str)


def differences(a: dict, b: dict) -> list[str]:
    """One line per differing value, grouped by section: ``config: train.learning_rate: 0.05 -> 0.1``.
    ``command.argv`` only where it differs beyond its ``--set``s (``command.sets`` says those)."""
    lines = []
    for section in SECTIONS:
        fa, fb = flatten(a.get(section), section), flatten(b.get(section), section)
        for key in sorted(set(fa) | set(fb)):
            va, vb = fa.get(key, ABSENT), fb.get(key, ABSENT)
            if (
                key == "command.argv"
                and isinstance(va, list)
                and isinstance(vb, list)
                and split_sets(va)[0] == split_sets(vb)[0]
            ):
                continue  # only the --sets differ: command.sets says how
            if va != vb:
                lines.append(f"{key}: {shown(va)} -> {shown(vb)}")
    return lines


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    out: dict[int, float] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        if rec.get("event") == "log" and "loss" in rec:
            out[int(rec["step"])] = float(rec["loss"])
    return out


def _same(x: float, y: float) -> bool:
    return (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=LOSS_RTOL, abs_tol=1e-12)


def loss_parting(a: Path, b: Path) -> str:
    la, lb = losses(a), losses(b)
    common = sorted(set(la) & set(lb))
    if not common:
        return "losses: no logged step in common"
    for step in common:
        if not _same(la[step], lb[step]):
            return f"losses part at step {step}: {la[step]:.6g} vs {lb[step]:.6g}"
    return f"losses: the same at all {len(common)} logged steps in common (up to step {common[-1]})"


def diff_runs(a: Path, b: Path) -> list[str]:
    lines = differences(read_record(a), read_record(b))
    return [*(lines or ["no differences in config, versions, plugins, data"]), loss_parting(a, b)]


def add_commands(app) -> None:
    @app.command("diff")
    def diff(
        run_a: Annotated[Path, typer.Argument(help="A run folder (output_dir) with run.json.")],
        run_b: Annotated[Path, typer.Argument(help="Another run folder.")],
        traceback_: Annotated[
            bool, typer.Option("--traceback", help="Show the full traceback of an error.")
        ] = False,
    ) -> None:
        """What differs between two runs (config, versions, plugins, data, git, host, devices), and
        the first logged step where their losses part."""
        from corelooper.cli.api import fail

        try:
            for line in diff_runs(run_a, run_b):
                typer.echo(line)
        except Exception as e:
            fail(e, traceback_)
