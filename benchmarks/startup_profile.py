"""Where corelooper's start-up goes: `corelooper --help` time, `python -X importtime` of
`corelooper run` to the first optimizer step against the hand-written script's, and a cProfile
of `corelooper run` up to that step.

usage: .venv/bin/python benchmarks/startup_profile.py [--help-reps 10] [--top 20] [--no-profile]
                                                     [--json benchmarks/results/startup_profile.json]
(run from the repository root with the venv a user has: `scripts/setup`'s, plugins autoloaded)

1. `corelooper --help`: wall time, median (and min-max) of --help-reps runs. Goal < 0.3 s.
2. `python -X importtime`: `corelooper run benchmarks/startup/profile_config.toml` (the start-up
   MLP; a local plugin ends the process at the first optimizer step) and
   `benchmarks/startup/raw_first_step.py`. Prints the top-level packages by cumulative import
   time for both, and the packages only corelooper's run imports — the import part of the extra
   start-up, by name.
3. cProfile of the same `corelooper run` in-process from the CLI's `main()` to the first step:
   the top --top functions by cumulative time, and the share of a few named phases (imports,
   plugin loading, `Loop()`, the first optimizer's lazy `torch._dynamo` import).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONFIG = "benchmarks/startup/profile_config.toml"
RAW = "benchmarks/startup/raw_first_step.py"
LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def help_times(reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run(
            [str(BIN / "corelooper"), "--help"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
        )
        out.append(time.perf_counter() - t)
    return out


def importtime(argv: list[str]) -> tuple[dict[str, float], dict[str, float], float]:
    """Run argv under -X importtime; return (top-level package -> cumulative s, module -> self s,
    seconds from process start to the FIRST_STEP line)."""
    start = time.time()
    p = subprocess.run(
        [sys.executable, "-X", "importtime", *argv], cwd=ROOT, env=env(), capture_output=True, text=True
    )
    first = next(
        (float(x.split()[1]) - start for x in p.stdout.splitlines() if x.startswith("FIRST_STEP ")), None
    )
    if first is None:
        raise RuntimeError(f"{argv} printed no FIRST_STEP (rc {p.returncode}):\n{p.stderr[-3000:]}")
    top: dict[str, float] = {}
    self_s: dict[str, float] = {}
    for m in LINE.finditer(p.stderr):
        own, cum, indent, name = int(m[1]), int(m[2]), len(m[3]), m[4]
        self_s[name] = self_s.get(name, 0.0) + own / 1e6
        if indent == 1:  # imported by the script itself or by a runtime import: depth 0
            pkg = name.split(".")[0]
            top[pkg] = top.get(pkg, 0.0) + cum / 1e6
    return top, self_s, first


def print_top(title: str, d: dict[str, float], n: int) -> list:
    rows = sorted(d.items(), key=lambda kv: -kv[1])[:n]
    print(f"\n{title}")
    for name, s in rows:
        print(f"  {s:7.3f} s  {name}")
    return [[k, round(v, 4)] for k, v in rows]


def profile_child(out_path: str) -> None:
    """In this process: profile the CLI's main() until the local plugin stops at the first step."""
    import cProfile

    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    prof = cProfile.Profile()
    os.environ["CORELOOPER_BENCH_PROFILE_OUT"] = out_path
    import benchmarks.startup.profile_first_step as stopper

    stopper.PROFILER = prof
    stopper.STATS_PATH = out_path
    sys.argv = ["corelooper", "run", CONFIG]
    prof.enable()
    from corelooper.cli.app import main

    main()


PHASES = {  # (label, substring of a profiled function's "file:line(name)")
    "corelooper.cli.app main()": "cli/app.py",
    "Loop.__init__": "loop.py:",
    "plugin loading (entry points, local plugins)": "load_plugins",
    "import accelerate": "accelerate/__init__.py",
    "import torch._dynamo (first torch.optim optimizer)": "torch/_dynamo/__init__.py",
    "import torch.utils.tensorboard": "torch/utils/tensorboard/__init__.py",
    "import transformers": "transformers/__init__.py",
}


def report_profile(path: str, top: int) -> dict:
    import pstats

    st = pstats.Stats(path)
    total = max(ct for (_, _, _, ct, _) in st.stats.values())
    print(
        f"\ncProfile of `corelooper run` to the first optimizer step (total {total:.3f} s), top {top} cumulative:"
    )
    st.sort_stats("cumulative").print_stats(top)
    phases = {}
    for label, needle in PHASES.items():
        hits = [
            ct
            for (file, line, name), (_, _, _, ct, _) in st.stats.items()
            if needle in f"{file}:{line}({name})"
        ]
        if hits:
            phases[label] = round(max(hits), 4)
    print("named phases (cumulative s, overlapping):")
    for k, v in phases.items():
        print(f"  {v:7.3f} s  {k}")
    return {"total_s": round(total, 4), "phases_s": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--help-reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-child", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "startup_profile.json"))
    a = ap.parse_args()
    if a.profile_child:
        profile_child(a.profile_child)
        return
    out: dict = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        cpus=os.cpu_count(),
        loadavg_start=[round(x, 2) for x in os.getloadavg()],
    )
    h = help_times(a.help_reps)
    out["help_s"] = dict(
        median=round(statistics.median(h), 4),
        range=[round(min(h), 4), round(max(h), 4)],
        reps=a.help_reps,
        goal=0.3,
    )
    print(
        f"corelooper --help: median {statistics.median(h):.3f} s over {a.help_reps} (min-max "
        f"{min(h):.3f}-{max(h):.3f}; goal < 0.3 s)"
    )

    cl_top, cl_self, cl_first = importtime(["-m", "corelooper", "run", CONFIG])
    raw_top, raw_self, raw_first = importtime([RAW])
    print(
        f"\nfirst step from process start under -X importtime: corelooper run {cl_first:.3f} s, "
        f"hand-written {raw_first:.3f} s (importtime itself slows both)"
    )
    out["importtime"] = {
        "first_step_s": {"corelooper": round(cl_first, 4), "raw": round(raw_first, 4)},
        "corelooper_top": print_top("corelooper run: top-level imports by cumulative time", cl_top, a.top),
        "raw_top": print_top("hand-written script: top-level imports by cumulative time", raw_top, a.top),
        "corelooper_top_self": print_top("corelooper run: modules by self time", cl_self, a.top),
    }
    only = {m: s for m, s in cl_self.items() if m not in raw_self}
    out["importtime"]["only_corelooper_self_total_s"] = round(sum(only.values()), 4)
    out["importtime"]["only_corelooper"] = print_top(
        f"modules only corelooper's run imports ({sum(only.values()):.3f} s of self time in all), by self time",
        only,
        a.top,
    )
    by_pkg: dict[str, float] = {}
    for m, s in only.items():
        by_pkg[m.split(".")[0]] = by_pkg.get(m.split(".")[0], 0.0) + s
    out["importtime"]["only_corelooper_by_package"] = print_top(
        "... grouped by top-level package", by_pkg, a.top
    )

    if not a.no_profile:
        with tempfile.TemporaryDirectory() as tmp:
            stats = os.path.join(tmp, "run.prof")
            subprocess.run(
                [sys.executable, __file__, "--profile-child", stats],
                cwd=ROOT,
                env=env(),
                stdout=subprocess.DEVNULL,
                check=False,
            )
            if os.path.exists(stats):
                out["profile"] = report_profile(stats, a.top)
            else:
                print("the profiled run wrote no stats (it failed before its first step)", file=sys.stderr)
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
