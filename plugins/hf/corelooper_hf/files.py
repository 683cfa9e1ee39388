"""Data sets named by path in ``[data]``, read with the ``datasets`` library (memory-mapped Arrow).

``train = "data/train.jsonl"`` (also ``.json``, ``.parquet``, ``.csv``, ``.arrow``, ``.txt``, a
folder written by ``Dataset.save_to_disk``, or a glob of shards such as ``"data/part-*.parquet"``);
``eval`` likewise, or ``eval_split = 0.05`` to hold out a seeded share of the training rows; a
mixture is a list ``[{ path = "a.jsonl", weight = 0.7 }, { path = "b.jsonl", weight = 0.3 }]``
(rows drawn from each source with these probabilities, seeded, until one runs out: HF
``interleave_datasets``). The files are converted once into the ``datasets`` Arrow cache and
then memory-mapped, so memory does not grow with the file (benchmarks/data_memory.py). A string
``module:callable`` stays the factory form. Bad files raise ``DataError`` naming the file (and
for JSON the line), never a traceback.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

from corelooper.errors import DataError

SUFFIXES = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
}
_GLOB = set("*?[")


def is_data_ref(ref: Any, base: Path | None = None) -> bool:
    """Whether a ``[data]`` value names data files (else it is a ``module:callable`` factory)."""
    if isinstance(ref, (list, dict)):
        return True
    if not isinstance(ref, str):
        return False
    if _GLOB & set(ref) or Path(ref).suffix.lower() in SUFFIXES:
        return True
    return _resolve(ref, base).is_dir()


def _resolve(ref: str, base: Path | None) -> Path:
    path = Path(ref).expanduser()
    if not path.is_absolute() and not path.exists() and base is not None and (base / path).exists():
        return base / path
    return path


def _files(ref: str, key: str, base: Path | None) -> list[str]:
    if _GLOB & set(ref):
        pattern = ref if Path(ref).is_absolute() or base is None else str(base / ref)
        found = sorted(glob.glob(ref)) or sorted(glob.glob(pattern))
        if not found:
            raise DataError(f"{key} = {ref!r}: no file matches this pattern (from {Path.cwd()}).")
        return found
    path = _resolve(ref, base)
    if not path.exists():
        places = dict.fromkeys(str(p.resolve()) for p in (Path.cwd(), base) if p is not None)  # once each
        raise DataError(f"{key} = {ref!r}: no such file or folder (looked in {' and '.join(places)}).")
    return [str(path)]


def check_paths(config) -> None:
    """Every file a ``[data]`` split names exists: checked before the model is loaded, so a
    wrong path fails in seconds (``DataError`` naming the key and where it looked)."""
    base = config.source.parent if config.source else None
    for split in ("train", "eval", "test"):
        ref = getattr(config.data, split, None)
        if ref is None or not is_data_ref(ref, base):
            continue
        sources = _sources(ref, f"data.{split}")
        for i, (path, _) in enumerate(sources):
            _files(path, f"data.{split}[{i}]" if len(sources) > 1 else f"data.{split}", base)


def _quiet() -> None:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "[data] names data files, which corelooper reads with the `datasets` library: "
            "pip install 'corelooper[data]' (or datasets)."
        ) from None

    datasets.disable_progress_bars()
    # not even errors: a parse error is reported once, by _explain, with the file's line number
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)


def load_files(ref: str, key: str, base: Path | None = None):
    """One source: a file, a glob of files of one kind, or a ``save_to_disk`` folder."""
    import datasets

    _quiet()
    files = _files(ref, key, base)
    if len(files) == 1 and Path(files[0]).is_dir():
        return _load_folder(Path(files[0]), key)
    kinds = {SUFFIXES.get(Path(f).suffix.lower()) for f in files}
    if None in kinds or len(kinds) > 1:
        raise DataError(
            f"{key} = {ref!r}: cannot tell the format of {files[:3]}; use files ending in "
            f"{', '.join(SUFFIXES)} (one kind per source), or a folder saved by Dataset.save_to_disk."
        )
    for f in files:
        if Path(f).stat().st_size == 0:
            raise DataError(f"{key}: the file {f} is empty.")
    (kind,) = kinds
    try:
        ds = datasets.load_dataset(kind, data_files=files, split="train")
    except Exception as e:  # datasets wraps parser errors in its own classes
        raise _explain(files, kind, key, e) from None
    if len(ds) == 0:
        raise DataError(f"{key} = {ref!r}: the data set has no rows.")
    return ds


def _load_folder(path: Path, key: str):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(
            f"{key}: {path} is a folder but not one written by Dataset.save_to_disk "
            f"({type(e).__name__}: {e}). Name the files inside it, or a glob such as '{path}/*.parquet'."
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        split = (
            "train"
            if key.endswith("train")
            else next((s for s in ("validation", "eval", "test") if s in loaded), None)
        )
        if split not in loaded:
            raise DataError(f"{key}: {path} holds the splits {list(loaded)}; name one folder inside it.")
        loaded = loaded[split]
    return loaded


def _explain(files: list[str], kind: str, key: str, error: Exception) -> DataError:
    if kind == "json":
        for f in files:
            found = json_problem(Path(f))
            if found:
                return DataError(f"{key}: {found}")
    return DataError(
        f"{key}: reading {files[0] if len(files) == 1 else files} as {kind} failed: "
        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    )


def json_problem(path: Path) -> str | None:
    """The first malformed line of a JSON Lines file (or the error of a JSON file), as a sentence."""
    with path.open(encoding="utf-8", errors="replace") as fh:
        if path.suffix.lower() == ".json" and fh.read(1) == "[":
            fh.seek(0)
            try:
                json.load(fh)
            except json.JSONDecodeError as e:
                return f"{path}, line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})."
            return None
        fh.seek(0)
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return (
                    f"{path}, line {n}: not valid JSON ({e.msg}, column {e.colno}). Each line of a "
                    "JSON Lines file must be one JSON object."
                )
            if not isinstance(row, dict):
                return f'{path}, line {n}: a {type(row).__name__}, not a JSON object ({{"column": ...}}).'
    return None


def _sources(spec, key: str) -> list[tuple[str, float]]:
    items = spec if isinstance(spec, list) else [spec]
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append((item, 1.0))
        elif isinstance(item, dict) and isinstance(item.get("path"), str):
            unknown = set(item) - {"path", "weight"}
            if unknown:
                raise DataError(f"{key}[{i}]: unknown keys {sorted(unknown)}; a source has path and weight.")
            weight = item.get("weight", 1.0)
            if not isinstance(weight, (int, float)) or weight <= 0:
                raise DataError(f"{key}[{i}].weight must be a number > 0, got {weight!r}.")
            out.append((item["path"], float(weight)))
        else:
            raise DataError(f'{key}[{i}] = {item!r}: use a path or {{ path = "...", weight = 0.5 }}.')
    return out


def load_spec(spec, key: str, base: Path | None = None, seed: int = 42):
    """A path, a glob, a folder, or a weighted mixture of them, as one ``datasets.Dataset``."""
    sources = _sources(spec, key)
    parts = [
        load_files(ref, f"{key}[{i}]" if len(sources) > 1 else key, base)
        for i, (ref, _) in enumerate(sources)
    ]
    if len(parts) == 1:
        return parts[0]
    import datasets

    columns = [sorted(p.column_names) for p in parts]
    if any(c != columns[0] for c in columns):
        listed = "; ".join(f"{ref}: {c}" for (ref, _), c in zip(sources, columns, strict=True))
        raise DataError(f"{key}: the sources of a mixture need the same columns ({listed}).")
    total = sum(w for _, w in sources)
    try:
        return datasets.interleave_datasets(
            parts,
            probabilities=[w / total for _, w in sources],
            seed=seed,
            stopping_strategy="first_exhausted",
        )
    except (ValueError, TypeError) as e:
        raise DataError(
            f"{key}: the sources cannot be mixed ({e}); give them the same column types."
        ) from None


def load_split(config, split: str):
    """The data set of ``[data] <split>`` when it names files (``None`` otherwise).

    ``eval_split`` holds out rows of ``train``: ``load_split(config, "train")`` gives the rest,
    ``load_split(config, "eval")`` the held-out rows (the same rows every call: seeded).
    """
    d = config.data
    base = config.source.parent if config.source else None
    seed = config.train.data_seed if config.train.data_seed is not None else config.train.seed
    ref = getattr(d, split, None)
    if split == "eval" and ref is None and d.eval_split:
        return _held_out(config, base, seed)[1]
    if ref is None or not is_data_ref(ref, base):
        return None
    dataset = load_spec(ref, f"data.{split}", base, seed)
    if split == "train" and d.eval_split:
        return _held_out(config, base, seed)[0]
    return dataset


def _held_out(config, base, seed):
    d = config.data
    if d.train is None or not is_data_ref(d.train, base):
        raise DataError("data.eval_split needs data.train to name data files (a path, glob or mixture).")
    full = load_spec(d.train, "data.train", base, seed)
    size = d.eval_split if d.eval_split < 1 else int(d.eval_split)
    if len(full) < 2 or (isinstance(size, int) and size >= len(full)):
        raise DataError(f"data.eval_split = {d.eval_split!r} leaves no training rows of {len(full)}.")
    parts = full.train_test_split(test_size=size, seed=seed, shuffle=True)
    return parts["train"], parts["test"]
