"""Byte counts for people (no torch)."""

from __future__ import annotations

GB = 1024**3


def fmt(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GB", GB), ("MB", 1024**2), ("KB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
