"""``output_dir/run.json``: how the run was made, so two runs that disagree can be compared
(``corelooper diff RUN_A RUN_B``).

The plugin ``run_record`` (corelooper-run-record; ``-p no:run_record`` switches it off); written
by the main process at ``on_train_begin``: the command line and its ``--set``s, the resolved
config, corelooper's and every loaded plugin's version, the libraries' versions, the project's
git commit and whether its tree was dirty, host, world size, device, and an identity of each
data file (size, mtime, SHA-256 of its first MiB). A resumed run keeps the first record and adds
an entry to ``"resumed"``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

__version__ = "0.2.0"

CORE_LIBRARIES = ("torch", "accelerate", "safetensors", "transformers", "datasets")


def libraries(dists) -> list[str]:
    """The core's libraries and every library a loaded plugin's distribution requires (a plugin's
    backend or adapter library: its version is the first question when two runs disagree)."""
    from importlib.metadata import PackageNotFoundError, requires

    found = list(CORE_LIBRARIES)
    for dist in dists:
        try:
            reqs = requires(dist) or []
        except PackageNotFoundError:
            continue
        for req in reqs:
            name = req.split(";")[0].split("[")[0]
            for sep in "<>=!~ (":
                name = name.split(sep)[0]
            if ";" in req and "extra ==" in req:  # a test or optional extra: not what runs
                continue
            if name and name not in found and not name.startswith("corelooper"):
                found.append(name)
    return found


HEAD_BYTES = 1 << 20
RUN_JSON = "run.json"


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _git(folder: Path) -> dict | None:
    """The commit and dirtiness of the repository holding ``folder`` (None outside one)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=20, check=True
        ).stdout.strip()

    try:
        # dirty as `git describe --dirty` means it: tracked files changed (not the run's own output)
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    except (OSError, subprocess.SubprocessError):  # no git, or not a repository
        return None


def file_identity(path: Path) -> dict:
    with path.open("rb") as fh:
        head = hashlib.sha256(fh.read(HEAD_BYTES)).hexdigest()
    st = path.stat()
    return {
        "size": st.st_size,
        "mtime": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(st.st_mtime)),
        "sha256_head": head,
    }


def data_files(config) -> dict[str, dict]:
    """``{path: identity}`` of every file the ``[data]`` splits name by path (a file, a glob, a
    folder: the files inside, a mixture's sources); ``module:callable`` factories have none."""
    base = config.source.parent if config.source else None
    found: dict[str, dict] = {}
    for split in ("train", "eval", "test"):
        for path in _named_paths(getattr(config.data, split, None), base):
            files = sorted(f for f in path.rglob("*") if f.is_file())[:200] if path.is_dir() else [path]
            found.update({str(f.resolve()): file_identity(f) for f in files})
    return found


def _named_paths(spec, base: Path | None) -> list[Path]:
    refs = spec if isinstance(spec, list) else [spec]
    refs = [r.get("path") if isinstance(r, dict) else r for r in refs]
    out: list[Path] = []
    for ref in (r for r in refs if isinstance(r, str)):
        for folder in dict.fromkeys((Path.cwd(), base or Path.cwd())):  # as the data plugin looks
            matches = [Path(m) for m in sorted(glob.glob(str(folder / Path(ref).expanduser())))]
            if matches:
                out += matches
                break
    return out


def split_sets(argv: list) -> tuple[list, list]:
    """A command line's other arguments, and its ``--set``/``-s KEY=VALUE`` values (then ``--set=``'s)."""
    bare, pairs, inline, args = [], [], [], iter(argv)
    for arg in args:
        if arg in ("--set", "-s"):
            pairs += [value for value in [next(args, None)] if value is not None]
        elif str(arg).startswith("--set="):
            inline.append(arg.split("=", 1)[1])
        else:
            bare.append(arg)
    return bare, pairs + inline


def _command() -> dict:
    argv = list(sys.argv)
    return {"argv": argv, "sets": split_sets(argv)[1], "cwd": str(Path.cwd())}


def _plugin_name(name: str, info) -> str:
    """An object passed as a plugin is registered under a name with its id: name its class."""
    if info.kind != "object":
        return name
    cls = type(info.plugin)
    return f"{cls.__module__}.{cls.__qualname__}"


def record(loop, state) -> dict:
    plugins = {
        _plugin_name(name, info): {"kind": info.kind, "dist": info.dist, "version": info.version}
        for name, info in loop.plugins.info.items()
        if info.kind != "run"
    }
    project = loop.config.source.parent if loop.config.source else Path.cwd()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": _command(),
        "config": loop.config.to_dict(),
        "versions": {
            "corelooper": _version("corelooper"),
            "python": sys.version.split()[0],
            **{
                lib: _version(lib)
                for lib in libraries({i.dist for i in loop.plugins.info.values() if i.dist})
            },
        },
        "plugins": plugins,
        "git": _git(project),
        "host": socket.gethostname(),
        "world_size": state.world_size,
        "device": str(loop.backend.device),
        "data": data_files(loop.config),
    }


def corelooper_add_commands(app) -> None:
    """``corelooper diff RUN_A RUN_B`` (corelooper_run_record/diff.py)."""
    from .diff import add_commands

    add_commands(app)


def on_train_begin(loop, state) -> None:
    if not state.is_world_process_zero:
        return
    path = Path(loop.args.output_dir) / RUN_JSON
    made = record(loop, state)
    if state.global_step > 0 and path.is_file():  # resumed: the first record stays
        try:
            first = json.loads(path.read_text())
            first.setdefault("resumed", []).append({**made, "from_step": state.global_step})
            made = first
        except ValueError:  # a cut-off file: this record replaces it
            pass
    tmp = path.with_name(f".{RUN_JSON}.tmp")
    try:
        tmp.write_text(json.dumps(made, indent=1, default=str) + "\n")
        tmp.replace(path)
    except OSError as e:  # disk full, read-only: an I/O error, not the plugin's
        from corelooper.checkpoints.ioerrors import io_error

        raise io_error(e, f"writing {RUN_JSON}", path.parent) from None
