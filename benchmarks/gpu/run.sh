#!/usr/bin/env bash
# corelooper on one GPU (H100/H200): bf16 full fine-tuning and LoRA vs a hand-written bf16 loop
# (tokens/s, MFU), fp16 + GradScaler, leak-free packing with flash-attention varlen vs sdpa, Liger
# kernels (corelooper-liger) vs none, auto batch size on a real CUDA OOM, the doctor's memory
# report and host-device syncs per step, single-GPU FSDP2 and ZeRO-2, Qwen2.5-0.5B's shape (vocab
# 151,936) under the HF Trainer, TRL and corelooper (full and LoRA), peak memory of each. No model
# or data download. Under 8 minutes in all (torch_compile's pair is opt-in: STEPS=...).
#
#   bash benchmarks/gpu/run.sh                 # on the GPU machine, from the repository root
#   bash benchmarks/gpu/run.sh --cpu-smoke     # tiny sizes on a CPU (uses .venv; without one, or
#                                              # one without torch, installs a CPU one in .smoke-venv)
#   bash benchmarks/gpu/run.sh --dry-run       # the plan only
# Env: GPU_VENV (default .gpu-venv), WHEELHOUSE (a folder of wheels for an offline machine:
# pip --find-links), SKIP_INSTALL=1 (use the python on PATH as is; with WHEELHOUSE, its wheels are
# installed into WHEEL_TARGET, default /tmp/corelooper-site, put on PYTHONPATH: an offline machine
# whose python has CUDA torch), BUDGET_S (default 420: the steps' share of the 8 minutes; install
# time comes on top), STEPS (comma list; sft_chat_peers_bf16, ~3 min, runs only when named).
# Exit status: 0 when every step ran or was skipped (each skip says why), 1 when a step errored,
# 2 when what every step needs (torch, transformers, corelooper) is missing and was not installed.
# CI runs the smoke (tests/test_gpu_bench_smoke.py, through bench.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
ARGS=("$@")

PLUGINS=(plugins/lm plugins/sft plugins/peft plugins/fsdp plugins/deepspeed plugins/auto_batch_size plugins/doctor)
if [[ " ${ARGS[*]-} " == *" --cpu-smoke "* || " ${ARGS[*]-} " == *" --dry-run "* ]]; then
  PY=${PY:-.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  if ! "$PY" -c "import torch, transformers, corelooper" 2>/dev/null; then
    if [ "${SKIP_INSTALL:-0}" = 1 ]; then
      echo "$PY lacks torch, transformers or corelooper (SKIP_INSTALL=1: not installing them). Run bash scripts/setup" \
           "(it makes .venv), or run without SKIP_INSTALL to install a CPU venv in .smoke-venv." >&2
      exit 2
    fi
    echo "$PY lacks torch/transformers/corelooper: installing a CPU venv in .smoke-venv (torch CPU wheel, transformers," \
         "peft, accelerate, safetensors, deepspeed, corelooper and its plugins)"
    [ -x .smoke-venv/bin/python ] || python3 -m venv .smoke-venv || { echo "python3 -m venv failed" >&2; exit 2; }
    PY=.smoke-venv/bin/python
    SPIP=("$PY" -m pip install -q)
    [ -n "${WHEELHOUSE:-}" ] && SPIP+=(--find-links "$WHEELHOUSE")
    "${SPIP[@]}" torch --index-url https://download.pytorch.org/whl/cpu \
      && "${SPIP[@]}" transformers peft accelerate safetensors numpy \
      && "${SPIP[@]}" -e . $(for d in "${PLUGINS[@]}"; do [ -f "$d/pyproject.toml" ] && echo "-e $d"; done) \
      || { echo "installing the smoke venv failed: it needs torch, transformers, peft, accelerate, safetensors," \
                "numpy and corelooper with ${PLUGINS[*]} (pip install -e each)" >&2; exit 2; }
    "${SPIP[@]}" deepspeed || echo "deepspeed did not install: the ZeRO-2 step says so and is skipped"
  fi
elif [ "${SKIP_INSTALL:-0}" = 1 ]; then
  PY=${PY:-python3}
  if [ -n "${WHEELHOUSE:-}" ]; then
    # An offline machine whose python already has torch (CUDA), transformers and accelerate: the
    # wheels in WHEELHOUSE (corelooper and its plugins built with pip wheel --no-deps, and what the
    # image lacks) go into a folder of their own on PYTHONPATH; nothing of the image is replaced.
    TARGET=${WHEEL_TARGET:-/tmp/corelooper-site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" \
        "$WHEELHOUSE"/*.whl || { echo "installing the wheels of $WHEELHOUSE into $TARGET failed" >&2; exit 2; }
    export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels from $WHEELHOUSE into $TARGET"
  fi
else
  VENV=${GPU_VENV:-.gpu-venv}
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  PY="$VENV/bin/python"
  PIP=("$PY" -m pip install -q)
  [ -n "${WHEELHOUSE:-}" ] && PIP+=(--find-links "$WHEELHOUSE")
  echo "torch==2.13.0" > "$VENV/torch-pin.txt"
  # The default index serves the CUDA build of torch on Linux x86_64: that is what we want here.
  "${PIP[@]}" --upgrade pip || true
  "${PIP[@]}" "torch==2.13.0" || { echo "torch install failed"; exit 1; }
  "${PIP[@]}" -c "$VENV/torch-pin.txt" transformers peft accelerate safetensors numpy deepspeed \
      || echo "WARNING: some of transformers/peft/accelerate/deepspeed did not install; their steps will say so"
  plugins=()
  for d in "${PLUGINS[@]}"; do
    [ -f "$d/pyproject.toml" ] && plugins+=(-e "$d")
  done
  "${PIP[@]}" -c "$VENV/torch-pin.txt" -e . "${plugins[@]}" || { echo "corelooper install failed"; exit 1; }
  # corelooper-liger brings liger-kernel (Triton kernels; triton comes with the CUDA torch): on its own,
  # so that a failure leaves the other steps alone (cl_bf16_liger then says it was skipped).
  timeout 120 "${PIP[@]}" -c "$VENV/torch-pin.txt" -e plugins/liger \
      || echo "corelooper-liger / liger-kernel did not install: the Liger step is skipped"
  # flash-attn: a prebuilt wheel only (a source build takes far longer than the budget).
  timeout 90 "${PIP[@]}" -c "$VENV/torch-pin.txt" --only-binary=:all: flash-attn \
      || echo "flash-attn: no prebuilt wheel for this torch/CUDA: the packing step runs sdpa only"
  echo "install took $(( $(date +%s) - START )) s"
fi

"$PY" benchmarks/gpu/bench.py --budget-s "${BUDGET_S:-420}" ${STEPS:+--steps "$STEPS"} "${ARGS[@]}"
RC=$?
echo "total $(( $(date +%s) - START )) s"
exit $RC
