"""The world-size table of docs/clusters.md ("Which world sizes a global batch allows"), cell by
cell against the planner a resume on another number of processes uses."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from corelooper_elastic_resume.geometry import Geometry, plan

from corelooper.errors import ConfigError

DOC = Path(__file__).resolve().parents[3] / "docs" / "clusters.md"


def table() -> tuple[list[int], list[tuple[int, int, int, list[str]]]]:
    text = DOC.read_text()
    head = re.search(r"^\| global batch \(per device × accumulation × processes\) \|(.*)\|$", text, re.M)
    assert head, "the table is gone from docs/clusters.md"
    sizes = [int(n) for n in re.findall(r"\((\d+)\)", head.group(1))]
    rows = []
    for m in re.finditer(r"^\| (\d+) = (\d+) × (\d+) × (\d+) \|(.*)\|$", text, re.M):
        total, per_device, accumulation, world = map(int, m.group(1, 2, 3, 4))
        assert total == per_device * accumulation * world
        rows.append((per_device, accumulation, world, [c.strip() for c in m.group(5).split("|")]))
    return sizes, rows


def test_every_cell_is_what_a_resume_on_that_many_processes_does():
    sizes, rows = table()
    assert sizes == [32, 24, 16, 8] and len(rows) == 4
    for per_device, accumulation, world, cells in rows:
        saved = Geometry(world, per_device, accumulation)
        for size, cell in zip(sizes, cells, strict=True):
            if cell == "refused":
                with pytest.raises(ConfigError, match=f"Cannot resume exactly on {size} processes"):
                    plan(saved, size, per_device)
                continue
            got = plan(saved, size, per_device)
            assert f"{got.per_device} × {got.accumulation}" == cell, (saved, size)
            assert got.global_batch == saved.global_batch


def test_the_multiple_the_doc_names_fits_every_node_count():
    lcm = math.lcm(8, 16, 24, 32)
    assert lcm == 96 and "multiple of 96 (the least common\nmultiple of 8, 16, 24 and 32)" in DOC.read_text()
    for size in (8, 16, 24, 32):
        plan(Geometry(32, 3, 1), size, 3)  # 96 = 3 x 1 x 32: no refusal
