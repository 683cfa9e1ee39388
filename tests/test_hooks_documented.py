"""Every hookspec has a docstring and is documented in docs/hooks.md (as datasette does it).

``python tests/test_hooks_documented.py`` rewrites docs/hooks.md from corelooper/hookspecs.py.
"""

from __future__ import annotations

import inspect
import re

import pytest
from conftest import REPO

from corelooper import hookspecs

DOCS = REPO / "docs" / "hooks.md"
REGENERATE = "run `python tests/test_hooks_documented.py` to rewrite docs/hooks.md from the hookspecs"


def all_hookspecs() -> dict[str, object]:
    return {
        name: fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, f"{hookspecs.PROJECT}_spec")
    }


def signature(fn) -> str:
    return fn.__name__ + str(inspect.signature(fn)).split(" ->")[0].replace("'", "")


def test_hook_lists_cover_every_spec():
    """EVENTS/PROVIDERS drive `corelooper hooks` and the docs: a spec outside them is hidden."""
    assert set(all_hookspecs()) == {
        *hookspecs.DECLARATIONS,
        *hookspecs.TRANSFORMS,
        *hookspecs.EVENTS,
        *hookspecs.PROVIDERS,
    }
    for name in hookspecs.PROVIDERS:
        assert getattr(hookspecs, name).corelooper_spec["firstresult"], name


@pytest.mark.parametrize("name", sorted(all_hookspecs()))
def test_hookspec_has_a_docstring(name):
    doc = inspect.getdoc(all_hookspecs()[name]) or ""
    assert len(doc.split()) >= 5, (
        f"hookspec {name} needs a docstring: when it fires, what it gets, what it returns"
    )


@pytest.mark.parametrize("name", sorted(all_hookspecs()))
def test_hookspec_is_documented_with_its_signature(name):
    text = DOCS.read_text()
    assert f"### `{name}`" in text, f"docs/hooks.md has no section for {name}: {REGENERATE}"
    section = text.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
    assert f"`{signature(all_hookspecs()[name])}`" in section, f"{name}'s signature is stale: {REGENERATE}"
    assert name not in hookspecs.PROVIDERS or f"**Returns** {returns_line(name)}" in section, (
        f"{name}'s return is stale: {REGENERATE}"
    )


def returns_line(name: str) -> str:
    from corelooper.dispatch import returns

    annotation = getattr(hookspecs, name).__annotations__["return"]
    return f"`{annotation}`: {returns(name).__doc__}, or None (the next provider answers)."


@pytest.mark.parametrize("name", sorted(all_hookspecs()))
def test_every_argument_and_answer_of_a_hook_is_typed(name):
    """Every argument annotated; an event returns None, a provider its one declared type."""
    fn = all_hookspecs()[name]
    params = inspect.signature(fn).parameters
    assert [p for p in params if p not in fn.__annotations__] == [], f"{name}: annotate every argument"
    assert "return" in fn.__annotations__, f"{name}: annotate what it returns"
    if name in hookspecs.EVENTS:
        assert fn.__annotations__["return"] == "None", name
        assert list(params)[:3] == ["loop", "state", "control"], name


@pytest.mark.parametrize("name", sorted(all_hookspecs()))
def test_the_annotations_name_real_types(name):
    """The annotations are strings (postponed): each resolves, with the TYPE_CHECKING imports."""
    import typing

    import torch  # noqa: F401  (the names below import it)

    namespace = dict(vars(hookspecs))
    exec(
        inspect.getsource(hookspecs)
        .split("if TYPE_CHECKING:", 1)[1]
        .split("\n\n\n", 1)[0]
        .replace("\n    ", "\n"),
        namespace,
    )
    assert typing.get_type_hints(all_hookspecs()[name], globalns=namespace)


def test_docs_are_what_the_hookspecs_generate():
    """docs/hooks.md says it is generated from hookspecs.py: a docstring edited there and not
    regenerated here (the step's description, once) fails, not only a signature."""
    assert DOCS.read_text() == render(), f"docs/hooks.md is stale: {REGENERATE}"


def test_docs_list_no_hook_that_does_not_exist():
    documented = set(re.findall(r"^### `(\w+)`", DOCS.read_text(), re.M))
    assert documented == set(all_hookspecs())


INTRO = """\
# Hooks

Every hook corelooper calls, generated from `corelooper/hookspecs.py` (the source of truth;
`corelooper hooks` prints the same) by `python tests/test_hooks_documented.py`. The tests fail
when a hook is missing here or has no docstring.

- **Events** (`on_*`) keep the Hugging Face `TrainerCallback` names. Each receives `loop`, `state`
  and `control` by name, plus its own arguments; an implementation takes any subset of them
  (pluggy's rule): `def on_step_end(state, control): ...` is a complete plugin. Events return
  nothing; a plugin changes the run through `control` (e.g. `control.should_training_stop = True`).
- **Providers** are `firstresult`: the first implementation that returns something other than
  `None` answers. The builtin plugin implements each with `trylast=True`, so any other plugin wins.
  Among installed plugins the name that sorts first is asked first; local plugins
  (`[plugins] local`) and objects passed to `Loop(plugins=[...])` come before installed ones.
  `corelooper plugins` shows which plugin answers each provider.
- Every argument and answer is typed (the names `Batch`, `Loss`, `Metrics`, ... are the aliases
  `corelooper/hookspecs.py` defines for type checkers). Every provider declares what it returns
  once, as its return annotation (**Returns** below, with what it means). The loop, the builtin and plugins
  call providers through one dispatcher (`loop.plugins.call_provider(hook, **kwargs)`), which
  checks every answer: a wrong type (a float as loss, a parameter list as optimizer) is a
  `PluginError` naming the plugin, the hook, what was expected and what came (exit 3).
- Hook wrappers (`@hookimpl(wrapper=True)` / `hookwrapper=True`) work on events; they are
  refused when the plugin is registered on a provider (the loop must know which implementation
  answered: the sum/mean rule of `compute_loss`, whom to blame for a wrong answer) and on the hooks
  corelooper calls one implementation at a time (`on_exception`, `corelooper_unconfigure`, the
  transforms and the declarations: nothing to wrap). A provider that wraps the next one calls
  `loop.plugins.call_next(hook, self, **kwargs)`, which asks only the providers after it.
- **Transforms** (`transform_model`, `transform_data`) change the run's model or data once, when
  the `Loop` is built: every implementation runs, in its declared `order`
  (`corelooper.transforms.order`), each given the previous one's result; `None` keeps it.
- A function named like a hook is an implementation even without `@hookimpl` (as in pytest); a
  name close to a hook's that is not one (`on_step_ends`) is an error, not silently ignored.

## The public Loop API

What a hook may use of the `loop` it is given. These are **read-only** properties (assigning one
raises `AttributeError`; `tests/test_architecture.py` checks that nothing outside `loop.py`
assigns to the Loop): `config` (final before `corelooper_configure`, never replaced: a
resume's batch geometry, `resume_config`, is settled before plugins are configured), `args` (`config.train`),
`state`, `control`, `plugins`, `hook`, `events`, `model` (after `transform_model`; wrapped by the
backend in `train()`), `optimizer`, `scheduler`, `backend`, `train_dataset`, `eval_dataset`,
`data_collator` (after `transform_data`), `train_loader`, `loss_type` (`"auto"` until the first
batch resolves it), `is_training`, `num_micro_batches` (fetched for the step in progress),
`last_step` (the `StepResult` of the last optimizer step), `forward_signature`.
Methods: `train()`, `evaluate()`, `predict()`, `training_step(micro_batches)` (returns a
`StepResult`), `log(logs)`, `prepare_for_evaluation()`, `resolve_loss_type(batch)` (decides
`"auto"` once, from the first batch that asks). A plugin changes the model or the data through
the transform hooks and the run through `control`; a step provider returns what it did.
"""


DIFFERENCES = "## Differences from the HF Trainer"


def differences_section() -> str:
    """The hand-written tail of docs/hooks.md (kept when the rest is regenerated)."""
    text = DOCS.read_text() if DOCS.exists() else ""
    return text[text.index(DIFFERENCES) :] if DIFFERENCES in text else ""


def render() -> str:
    module_doc = inspect.getdoc(hookspecs)
    order = module_doc[module_doc.index("Order of events") :].split("::", 1)[1].strip("\n")
    out = [INTRO, "## Order of events in `Loop.train()`", "", "```", order, "```", ""]
    specs = all_hookspecs()
    groups = [
        ("Configuration", list(hookspecs.DECLARATIONS)),
        ("Transforms", list(hookspecs.TRANSFORMS)),
        ("Providers", list(hookspecs.PROVIDERS)),
        ("Events", list(hookspecs.EVENTS)),
    ]
    listed = {n for _, names in groups for n in names}
    groups.append(("Other hooks", sorted(set(specs) - listed)))
    for title, names in groups:
        if not names:
            continue
        out += [f"## {title}", ""]
        for name in names:
            kind = (
                "provider (firstresult)"
                if specs[name].corelooper_spec.get("firstresult")
                else (
                    "event"
                    if name.startswith("on_")
                    else "transform"
                    if name in hookspecs.TRANSFORMS
                    else "declaration"
                )
            )
            out += [f"### `{name}`", "", f"`{signature(specs[name])}` — {kind}", ""]
            if name in hookspecs.PROVIDERS:
                out += [f"**Returns** {returns_line(name)}", ""]
            out += [inspect.getdoc(specs[name]) or "", ""]
    tail = differences_section()
    return "\n".join(out).rstrip() + "\n" + ("\n" + tail if tail else "")


if __name__ == "__main__":
    DOCS.write_text(render())
    print(f"wrote {DOCS}")
