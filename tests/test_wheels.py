"""corelooper and every plugin are separate packages: each builds as a wheel on its own, with its
own version and a version range on corelooper, and they install from wheels into a clean venv.

The sources are copied to a temporary folder first (building writes ``build/`` and
``*.egg-info`` next to the sources). The clean venv gets torch (the pinned CPU wheel), corelooper's
wheel and the wheels of the plugins that install quickly; their third-party dependencies come
from the package index (the pip cache makes that fast after the first run). Then the real
``corelooper`` of that venv lists the plugins and trains one tiny run, with no access to this
checkout. deepspeed, peft and wandb are built and checked but not installed (their dependencies
take minutes); their plugins are exercised by their own tests in the development venv.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.name for p in (REPO / "plugins").iterdir() if (p / "pyproject.toml").exists())
INSTALLED = ["auto_batch_size", "early_stopping", "fsdp", "neftune", "optuna", "tensorboard"]
SKIP = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests", "scripts")


def _source_version(package_dir: Path) -> str:
    """``__version__`` of a package, read from its ``__init__.py`` without importing it."""
    tree = ast.parse((package_dir / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__version__" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"no __version__ in {package_dir}")


def _package_dir(plugin: str) -> Path:
    (pkg,) = [p for p in (REPO / "plugins" / plugin).glob("corelooper_*") if (p / "__init__.py").exists()]
    return pkg


def _metadata(wheel: Path) -> tuple[dict[str, list[str]], str]:
    """(METADATA headers, entry_points.txt) of a wheel."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        eps = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        headers: dict[str, list[str]] = {}
        for line in z.read(meta).decode().split("\n\n", 1)[0].splitlines():
            key, _, value = line.partition(": ")
            headers.setdefault(key, []).append(value)
        return headers, z.read(eps[0]).decode() if eps else ""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.pop("CORELOOPER_DISABLE_PLUGIN_AUTOLOAD", None)
    return {**env, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


# PEP 517's build_wheel hook of a package's own backend, called in a fresh process in its folder
# with no build isolation: what `pip wheel --no-deps --no-build-isolation` does for the wheel itself.
# pip also runs a metadata hook in another process and resolves first: ~3 s of CPU a package
# against ~1 s here, for 21 packages.
BUILD_WHEEL = "import importlib, sys; print(importlib.import_module(sys.argv[1]).build_wheel(sys.argv[2]))"


def _build_wheel(source: Path, out: Path) -> None:
    import tomllib

    backend = tomllib.loads((source / "pyproject.toml").read_text())["build-system"]["build-backend"]
    proc = subprocess.run(
        [sys.executable, "-c", BUILD_WHEEL, backend, str(out)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert proc.returncode == 0, f"{source.name}: {proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """{"corelooper": wheel, "early_stopping": wheel, ...}, each built on its own (--no-deps)."""
    tmp = tmp_path_factory.mktemp("wheels")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("corelooper", "cli"):
        shutil.copytree(REPO / name, src / name, ignore=SKIP)
    for plugin in PLUGINS:
        shutil.copytree(REPO / "plugins" / plugin, src / "plugins" / plugin, ignore=SKIP)
    out = tmp / "dist"
    out.mkdir()
    for source in (src, *(src / "plugins" / p for p in PLUGINS)):
        _build_wheel(source, out)
    built = {}
    for wheel in out.glob("*.whl"):
        dist = wheel.name.split("-")[0]  # corelooper, corelooper_early_stopping, ...
        built[dist.removeprefix("corelooper_") if dist != "corelooper" else dist] = wheel
    assert sorted(built) == sorted(["corelooper", *PLUGINS])
    return built


@pytest.mark.slow
def test_every_package_is_its_own_wheel_with_its_version_and_a_core_range(wheels):
    core_meta, _ = _metadata(wheels["corelooper"])
    core_version = core_meta["Version"][0]
    assert core_version == _source_version(REPO / "corelooper") == "0.2.0"
    with zipfile.ZipFile(wheels["corelooper"]) as z:
        tops = {n.split("/")[0] for n in z.namelist() if not n.startswith("corelooper-")}
    assert tops == {"corelooper"}  # cli/ installs as corelooper.cli; no tests, no plugins inside
    names = set()
    for plugin in PLUGINS:
        meta, entry_points = _metadata(wheels[plugin])
        names.add(meta["Name"][0])
        assert meta["Version"][0] == _source_version(_package_dir(plugin)), plugin
        (core,) = [
            Requirement(r) for r in meta.get("Requires-Dist", []) if Requirement(r).name == "corelooper"
        ]
        # a range: this core is in it, the next minor version (a new hook contract) is not
        assert core.specifier.contains(core_version) and not core.specifier.contains("0.3.0"), (plugin, core)
        # a corelooper plugin under its own name; the pytest kit for plugin authors is a pytest plugin
        group = "[pytest11]" if plugin == "testing" else "[corelooper]"
        assert group in entry_points and (plugin == "testing" or f"\n{plugin} = " in entry_points), plugin
        with zipfile.ZipFile(wheels[plugin]) as z:
            assert not [n for n in z.namelist() if "/tests/" in n or n.startswith("tests/")], plugin
    assert len(names) == len(PLUGINS)  # distinct distributions


@pytest.mark.slow
def test_wheels_install_into_a_clean_venv_list_and_train(wheels, tmp_path):
    venv = tmp_path / "venv"
    # Without pip of its own: this venv's pip installs into it (--python), which saves ensurepip.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300, env=_env()
    )
    py, cl = venv / "bin" / "python", venv / "bin" / "corelooper"
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    pin = tmp_path / "torch-pin.txt"
    pin.write_text("torch==2.13.0\n")  # the CPU wheel: nothing may pull a CUDA build
    # --no-compile: byte-compiling torch's thousands of files is most of the CPU time of an install
    install = [
        *pip,
        "install",
        "-q",
        "--no-compile",
        "-c",
        str(pin),
        "torch==2.13.0",
        str(wheels["corelooper"]),
        *(str(wheels[p]) for p in INSTALLED),
    ]
    proc = subprocess.run(install, capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = subprocess.run([*pip, "check"], capture_output=True, text=True, env=_env())
    assert check.returncode == 0, check.stdout  # every version range is satisfied

    def run(*args, cwd=tmp_path):
        return subprocess.run(
            [str(cl), *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=_env()
        )

    where = subprocess.run(
        [str(py), "-c", "import corelooper; print(corelooper.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), where  # the wheel, not this checkout
    assert run("--version").stdout.strip() == "corelooper 0.2.0"

    listed = run("plugins")
    assert listed.returncode == 0, listed.stderr
    for plugin in INSTALLED:
        dist = _metadata(wheels[plugin])[0]["Name"][0]
        assert f"  {plugin} ({dist} 0.2.0) [installed" in listed.stdout, listed.stdout
    assert "thirdparty" not in listed.stdout  # nothing of the test environment leaks in

    hpo = run("hpo", "--help")  # a subcommand that comes from the corelooper-optuna wheel
    assert hpo.returncode == 0 and "--trials" in hpo.stdout, hpo.stderr

    (tmp_path / "task.py").write_text(TASK)
    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(task=tmp_path / "task.py", out=tmp_path / "run"))
    trained = run("run", str(config))
    assert trained.returncode == 0, trained.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r and r.get("event") != "eval"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert [r["eval_loss"] for r in rows if "eval_loss" in r]  # evaluated, early stopping watching
    assert (tmp_path / "run" / "model.safetensors").exists()
    assert list(
        (tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*")
    )  # the tensorboard wheel logged


TASK = """
import torch


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def _points(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return [(x[i], int(x[i].sum() > 0)) for i in range(n)]


def train_set():
    return _points(96, 0)


def eval_set():
    return _points(32, 1)
"""

CONFIG = """
[model]
factory = "{task}:model"
[data]
train = "{task}:train_set"
eval = "{task}:eval_set"
[train]
output_dir = "{out}"
max_steps = 6
per_device_train_batch_size = 16
learning_rate = 0.05
logging_steps = 1
eval_strategy = "steps"
eval_steps = 3
save_strategy = "no"
disable_tqdm = true
[early_stopping]
patience = 5
"""


@pytest.mark.parametrize("plugin", PLUGINS)
def test_every_plugin_names_a_readme_that_exists(plugin):
    """A missing readme is a warning in every editable install (scripts/setup) and an empty
    long description on the index."""
    import tomllib

    project = tomllib.loads((REPO / "plugins" / plugin / "pyproject.toml").read_text())["project"]
    readme = REPO / "plugins" / plugin / project["readme"]
    assert readme.is_file() and readme.read_text().startswith(f"# corelooper-{plugin.replace('_', '-')}")


def fake_setup(tmp_path, uv_rc: int | None = 0, **env) -> tuple[subprocess.CompletedProcess, list, list]:
    """scripts/setup with a recording python (and uv, unless ``uv_rc`` is None) in place of the
    venv's: what it printed, and the pip and uv calls it made."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    fake = venv / "bin" / "python"
    fake.write_text(f'#!/bin/sh\necho "python PYTHONWARNINGS=$PYTHONWARNINGS $*" >> {calls}\n')
    fake.chmod(0o755)
    if uv_rc is not None:
        uv = venv / "bin" / "uv"
        uv.write_text(f'#!/bin/sh\necho "uv PYTHONWARNINGS=$PYTHONWARNINGS $*" >> {calls}\nexit {uv_rc}\n')
        uv.chmod(0o755)
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "VENV": str(venv), **env},
    )
    assert r.returncode == 0, r.stderr
    recorded = calls.read_text().splitlines()
    return r, [c for c in recorded if c.startswith("python ")], [c for c in recorded if c.startswith("uv ")]


def test_setup_says_each_stage_and_hides_the_build_backends_warnings(tmp_path):
    """A line per stage, in order; pip installs pip, torch and uv, and uv installs corelooper and
    every plugin, editable, with torch pinned; every call with the build backends' warnings
    (setuptools' editable-install notes) switched off."""
    r, pip, uv = fake_setup(tmp_path)
    venv = tmp_path / "venv"
    stages = [line.split(" (")[0] for line in r.stdout.splitlines()]
    assert stages == [
        f"setup: virtual environment {venv}",
        "setup: pip",
        "setup: torch 2.13.0",
        f"setup: corelooper and {len(PLUGINS)} plugins, editable",
        f"setup: done: use {venv}/bin/corelooper and {venv}/bin/python -m pytest",
    ], r.stdout
    assert len(pip) == 3 and all(
        c.startswith("python PYTHONWARNINGS=ignore -m pip install -q") for c in pip
    ), pip
    assert pip[2].endswith("install -q uv"), pip
    (install,) = uv
    # --compile-bytecode: .pyc files as pip writes them (none where PYTHONDONTWRITEBYTECODE is set)
    assert install.startswith(
        f"uv PYTHONWARNINGS=ignore pip install -q --compile-bytecode --python {venv}/bin/python"
    )
    assert f"-c {venv}/torch-pin.txt" in install and install.count(" -e ") == len(PLUGINS) + 1


@pytest.mark.parametrize("how", ["uv fails", "CORELOOPER_SETUP_PIP=1"])
def test_setup_installs_with_pip_when_uv_fails_or_is_not_wanted(tmp_path, how):
    failing = how == "uv fails"
    r, pip, uv = fake_setup(
        tmp_path, 1 if failing else 0, **({} if failing else {"CORELOOPER_SETUP_PIP": "1"})
    )
    assert len(uv) == (1 if failing else 0), uv
    assert ("setup: uv could not install them; pip instead" in r.stdout) is failing, r.stdout
    assert (
        pip[-1].startswith("python PYTHONWARNINGS=ignore -m pip install -q -c ")
        and pip[-1].count(" -e ") == len(PLUGINS) + 1
    ), pip
