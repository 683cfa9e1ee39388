"""Memory of reading a chat JSONL data set by path ([data] train = "file.jsonl") vs its size.

For each size, a child process loads the file with ``corelooper_hf.files.load_spec`` (``datasets``:
converted once into its Arrow cache, then memory-mapped) and reads every row; it reports its peak
private memory (``RssAnon``, sampled while reading; the memory-mapped Arrow pages are file-backed
and reclaimable, so they are not in it) and its peak resident memory (``ru_maxrss``, which counts
touched mapped pages too), for the first load (conversion into the cache) and a second, cached load. The reference is ``json.loads`` of every line into a list, what a hand-written reader does.

    .venv/bin/python benchmarks/data_memory.py [--mb 16 64 256]

Prints one JSON line per (method, size).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
def anon_mb():  # private (heap) memory: what grows when data is held in Python objects
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
method, path = sys.argv[1], sys.argv[2]
t = time.perf_counter()
peak = anon_mb()
if method == "list":
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    n = sum(len(r["messages"]) for r in rows)
    peak = max(peak, anon_mb())
else:
    from corelooper_hf.files import load_spec
    ds = load_spec(path, "data.train")
    n = 0
    for start in range(0, len(ds), 1000):
        n += sum(len(m) for m in ds[start:start + 1000]["messages"])
        peak = max(peak, anon_mb())
print(json.dumps({"peak_anon_mb": peak, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.perf_counter() - t, "messages": n}))
"""


def write_jsonl(path: Path, megabytes: int) -> int:
    rng = random.Random(0)
    words = "the model packs short samples into rows 模型 把 短 样本 打包 成 行".split()
    rows, size = 0, 0
    with path.open("w", encoding="utf-8") as fh:
        while size < megabytes * 2**20:
            turn = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(8, 200)))  # noqa: E731
            row = {
                "messages": [{"role": "user", "content": turn()}, {"role": "assistant", "content": turn()}],
                "difficulty_score": rng.random() * 5,
            }
            line = json.dumps(row, ensure_ascii=False) + "\n"
            fh.write(line)
            size += len(line.encode())
            rows += 1
    return rows


def child(method: str, path: Path, cache: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, method, str(path)], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, nargs="+", default=[16, 64, 256])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for mb in args.mb:
            path = tmp / f"chat-{mb}.jsonl"
            rows = write_jsonl(path, mb)
            cache = tmp / f"cache-{mb}"
            for method in ("datasets-first-load", "datasets-cached", "list"):
                result = child("list" if method == "list" else "datasets", path, cache)
                print(
                    json.dumps(
                        {
                            "method": method,
                            "file_mb": mb,
                            "rows": rows,
                            **{k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()},
                            "load": round(os.getloadavg()[0], 2),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
