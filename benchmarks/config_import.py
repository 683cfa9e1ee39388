"""Import cost of the config layer: the hand-written validator against pydantic v2 and msgspec.

`corelooper --help` must finish in < 0.3 s as a whole command, and it loads corelooper.config
(every plugin's entry point is imported, and the CLI validates nothing heavy). This measures, in
fresh interpreters (best of N):

* ``python -c pass`` (the interpreter alone),
* ``import corelooper.config`` (the hand-written validator, with corelooper/hf/args.py),
* ``import pydantic`` + building a ``BaseModel`` with TrainArgs' fields (schema build included),
* ``import msgspec`` + the same as a ``msgspec.Struct``,
* the whole ``corelooper --help`` command.

    python benchmarks/config_import.py [--repeat 7]

pydantic / msgspec are measured only when installed (they are not corelooper dependencies).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time

CASES = {
    "python -c pass": "pass",
    "import corelooper.config": "import corelooper.config",
    "pydantic v2 model of TrainArgs": (
        "import pydantic\n"
        "from typing import Any, Optional\n"
        "fields = {f'f{i}': (Optional[float], None) for i in range(66)}\n"
        "M = pydantic.create_model('TrainArgs', **fields)\n"
        "M(f0=1.0)\n"
    ),
    "msgspec Struct of TrainArgs": (
        "import msgspec\n"
        "from typing import Optional\n"
        "M = msgspec.defstruct('TrainArgs', [(f'f{i}', Optional[float], None) for i in range(66)])\n"
        "msgspec.convert({'f0': 1.0}, M)\n"
    ),
}


def best_of(cmd: list[str], repeat: int) -> float | None:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True)
        if r.returncode != 0:
            return None
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    repeat = parser.parse_args().repeat
    base = None
    for name, code in CASES.items():
        t = best_of([sys.executable, "-c", code], repeat)
        if t is None:
            print(f"{name:36s} not installed")
            continue
        base = t if base is None else base
        print(f"{name:36s} {t * 1000:7.1f} ms  (+{(t - base) * 1000:6.1f} ms over the interpreter)")
    exe = shutil.which("corelooper") or str(
        __import__("pathlib").Path(sys.executable).with_name("corelooper")
    )
    t = best_of([exe, "--help"], repeat)
    print(
        f"{'corelooper --help (whole command)':36s} {t * 1000:7.1f} ms" if t else "corelooper --help failed"
    )


if __name__ == "__main__":
    main()
