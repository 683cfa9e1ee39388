"""docs/plugins.md works as written: the tutorial package installs and its tests pass (run in
tests/test_new_plugin.py), the
provider / state / recorder examples do what the text says, and every hook is documented."""

from __future__ import annotations

import inspect
import json
import re
import types

import pytest
from conftest import REPO

from corelooper import hookspecs
from corelooper.errors import ConfigError

DOC = REPO / "docs" / "plugins.md"


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), re.M | re.S)


def block_with(text: str) -> str:
    (found,) = [b for b in code_blocks("python") if text in b]
    return found


def as_module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"docs/plugins.md:{name}", "exec"), module.__dict__)
    return module


def tutorial_files() -> dict[str, str]:
    """The files of the tutorial package: the code blocks that start with ``# file: PATH``."""
    files = {}
    for block in code_blocks("python") + code_blocks("toml"):
        first, _, _ = block.partition("\n")
        if first.startswith("# file: "):
            files[first[len("# file: ") :]] = block
    return files


def write_tutorial(dest) -> None:
    """Installed and tested (pytest in a subprocess) by tests/test_new_plugin.py, together with
    the new-plugin skeleton: one pip install and one pytest run for both."""
    for rel, text in tutorial_files().items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)


def test_tutorial_is_three_short_files_and_rejects_a_misspelt_key(make_loop, tmp_path):
    files = tutorial_files()
    assert sorted(files) == ["corelooper_lossguard/__init__.py", "pyproject.toml", "tests/test_lossguard.py"]
    assert sum(len(b.strip().splitlines()) for b in files.values()) <= 30  # "about twenty lines"
    module = as_module("corelooper_lossguard", files["corelooper_lossguard/__init__.py"])
    with pytest.raises(ConfigError, match="Did you mean 'max_loss'"):
        make_loop([module], output_dir=tmp_path / "x", sections={"lossguard": {"max_los": 1.0}})


def test_provider_example_replaces_the_default_optimizer(run_loop, hook_recorder, tmp_path):
    import torch

    sgd = as_module("sgd_plugin", block_with("def create_optimizer"))
    run_loop([sgd, hook_recorder], sections={"sgd": {"momentum": 0.5}})
    optimizer = hook_recorder.last("create_optimizer").result
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.5

    hook_recorder.clear()
    run_loop([sgd, hook_recorder], sections={"sgd": {"enabled": False}}, output_dir=tmp_path / "b")
    assert isinstance(hook_recorder.last("create_optimizer").result, torch.optim.AdamW)  # builtin answered


def test_state_example_survives_a_resume(run_loop, tmp_path):
    plugin = as_module("counter_doc", block_with("class Counter"))
    first = run_loop([plugin])
    assert first.plugins.get("counter.run").evaluations == 2  # at steps 4 and 8
    saved = json.loads((tmp_path / "run" / "checkpoint-4" / "plugins.json").read_text())
    assert saved["counter"] == {"evaluations": 1}
    resumed = run_loop([plugin], resume=str(tmp_path / "run" / "checkpoint-4"))
    # 1 restored + the evaluation at step 8 (a fresh start would give 1); a new object per run
    assert resumed.plugins.get("counter.run").evaluations == 2
    assert resumed.plugins.get("counter.run") is not first.plugins.get("counter.run")


def test_recorder_example(run_loop, hook_recorder):
    namespace = {"my_plugin": types.ModuleType("my_plugin")}
    exec(block_with("def test_logs_reach_my_plugin"), namespace)
    namespace["test_logs_reach_my_plugin"](run_loop, hook_recorder)


def _signature(fn) -> str:
    return fn.__name__ + str(inspect.signature(fn)).split(" ->")[0].replace("'", "")


@pytest.mark.parametrize(
    "name", [*hookspecs.DECLARATIONS, *hookspecs.TRANSFORMS, *hookspecs.PROVIDERS, *hookspecs.EVENTS]
)
def test_every_hook_is_documented_with_its_signature(name):
    sig = f"`{_signature(getattr(hookspecs, name))}`"
    docs = DOC.read_text() + (REPO / "docs" / "hooks.md").read_text()
    assert sig in docs, f"{sig} is in neither docs/plugins.md nor docs/hooks.md"
    assert "](hooks.md)" in DOC.read_text()


def test_the_hook_table_has_no_stale_signature():
    rows = re.findall(r"^\| `(\w+)(\(.*?\))` \|", DOC.read_text(), re.M)
    assert len(rows) >= 20
    for name, params in rows:
        assert hasattr(hookspecs, name), f"docs/plugins.md lists {name}, which is not a hook"
        assert name + params == _signature(getattr(hookspecs, name)), f"docs/plugins.md: {name} is stale"
