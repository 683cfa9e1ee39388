#!/usr/bin/env bash
# The wheels for an offline GPU machine whose python already has CUDA torch, transformers,
# accelerate, peft and safetensors (a cloud image, this workplace's lent GPU): corelooper and the
# plugins run.sh uses (pip wheel --no-deps, built from this checkout), and the packages such an
# image lacks, at the versions of the local venv, for the machine's Python (PYVER, default 3.12).
#
#   bash benchmarks/gpu/wheelhouse.sh [.whl]        # here, with internet (PyPI)
#   SKIP_INSTALL=1 WHEELHOUSE=.whl PY=python3 bash benchmarks/gpu/run.sh   # there
#
# Env: PY (the local venv's python, default .venv/bin/python: versions and the deepspeed build),
# PYVER, EXTRA (the packages to fetch; default below).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.whl}
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
EXTRA=${EXTRA:-"tomli-w datasets dill multiprocess hjson pydantic pydantic-core annotated-types typing-inspection
liger-kernel trl typing-extensions"}  # typing-extensions: pydantic needs a recent one
mkdir -p "$OUT"
rm -f "$OUT"/corelooper*.whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" . plugins/lm plugins/sft plugins/hf plugins/peft \
    plugins/fsdp plugins/deepspeed plugins/auto_batch_size plugins/doctor plugins/liger
pinned=()
for name in $EXTRA; do
  pinned+=("$name==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
tag=${PYVER/./}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --abi "cp$tag" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$OUT" "${pinned[@]}"
# DeepSpeed is an sdist on PyPI: built here as a pure-python wheel (its ops compile at run time)
ds=$("$PY" -c "import importlib.metadata as m; print(m.version('deepspeed'))")
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "deepspeed==$ds"
echo "$(ls "$OUT"/*.whl | wc -l) wheels in $OUT ($(du -sh "$OUT" | cut -f1))"
