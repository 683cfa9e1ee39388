"""The table of HF options plugins answer to (docs/trainer-options.md) is the plugins' own word.

The core accepts HF's default of such an option without the plugin (``PLUGIN_OPTIONS`` in
corelooper/hf/args.py) and otherwise points to that table, as it names no plugin itself. Here,
with every first-party plugin installed, the table must list exactly the TrainingArguments options
the plugins declare (``corelooper_settings()["train"]``) with the distribution that declares each,
and ``PLUGIN_OPTIONS`` must hold HF's real default for each.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from transformers import TrainingArguments

from corelooper import installed_entry_points
from corelooper.hf.args import PLUGIN_OPTIONS, settings_of

REPO = Path(__file__).resolve().parents[3]
# Options of Transformers 4.x that 5.x dropped, with their 4.x default (a 4.x to_dict() holds them).
FOUR_X_ONLY = {"logging_dir": None}


def _table() -> dict[str, str]:
    text = (REPO / "docs" / "trainer-options.md").read_text()
    body = re.search(
        r"<!-- hf-options-plugins-answer-to -->(.*?)<!-- /hf-options-plugins-answer-to -->", text, re.S
    )
    assert body, "the table's markers are gone from docs/trainer-options.md"
    table = {}
    for row in body.group(1).strip().splitlines()[2:]:
        options, package = (cell.strip() for cell in row.strip("|").split("|"))
        for option in re.findall(r"`([a-z_]+)`", options):
            table[option] = package.strip("`")
    return table


def _declared() -> dict[str, str]:
    """HF option -> the distribution of the installed plugin that declares it."""
    hf = {f.name for f in dataclasses.fields(TrainingArguments)} | set(FOUR_X_ONLY)
    found = {}
    for ep in installed_entry_points():
        for option in settings_of(ep.load(), ep.name).get("train", {}):
            if option in hf:
                assert option not in found, f"{option} declared by {found[option]} and {ep.dist.name}"
                found[option] = ep.dist.name
    return found


def test_the_table_names_the_package_of_every_option_a_plugin_declares():
    declared = _declared()
    assert {"deepspeed", "fsdp", "use_liger_kernel"} <= set(declared)  # the collection works
    assert _table() == declared
    assert set(PLUGIN_OPTIONS) == set(declared)


@pytest.mark.parametrize("option", sorted(PLUGIN_OPTIONS))
def test_the_core_accepts_hfs_real_default_without_the_plugin(option):
    if option in FOUR_X_ONLY:
        assert not hasattr(TrainingArguments(output_dir="x"), option)  # still gone from 5.x
        assert FOUR_X_ONLY[option] in PLUGIN_OPTIONS[option]
        return
    field = next(f for f in dataclasses.fields(TrainingArguments) if f.name == option)
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    assert default in PLUGIN_OPTIONS[option] and type(default) in {type(v) for v in PLUGIN_OPTIONS[option]}
    # and as TrainingArguments().to_dict() writes it (fsdp becomes a list there)
    written = TrainingArguments(output_dir="x").to_dict()[option]
    assert any(written == ok and type(written) is type(ok) for ok in PLUGIN_OPTIONS[option]), written
