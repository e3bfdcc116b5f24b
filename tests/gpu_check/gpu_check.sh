#!/usr/bin/env bash
# `make gpu-check`: on a machine with a CUDA GPU, run tests/gpu_check/gpu_check.py (GPU-marked tests, a few bf16-mixed
# training steps of every recipe, runtime torch vs Triton kernels, a short bench) and print one table.
#
# Works where no registry can be reached (the lent GPU machine): wheels that python3 lacks travel in .whl/
# (tests/gpu_check/make_gpu_wheels.sh makes them) and are installed into /tmp/site; the repository root IS the
# draftsmith package, so a symlink /tmp/dspkg/draftsmith -> repo makes `import draftsmith` work without pip.
# Results go to $OUT when set (the device tool brings that folder back), else outputs/gpu_check.
# Extra arguments go to gpu_check.py (e.g. --stage-timeout 300); `--device cpu --tiny` skips the GPU check.
set -uo pipefail

# REPO, PY and the offline environment
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

if [[ -z "${GPU_CHECK_SKIP_WHEELS:-}" ]] && compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    SITE="${GPU_CHECK_SITE:-/tmp/site}"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$REPO"/.whl/*.whl || { echo "gpu-check: installing the carried wheels from .whl/ failed" >&2; exit 2; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

# The repo root is the package (setuptools maps draftsmith.X -> ./X): expose it under its name.
PKG="${GPU_CHECK_PKG:-/tmp/dspkg}"
mkdir -p "$PKG" && ln -sfn "$REPO" "$PKG/draftsmith"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" - "$REPO" <<'PYEOF'
import os, sys
import hydra, omegaconf  # noqa: F401  (train.py needs them; they may have come from .whl)
import draftsmith
here = os.path.realpath(os.path.dirname(draftsmith.__file__))
sys.exit(0 if here == os.path.realpath(sys.argv[1]) else f"draftsmith imports from {here}, not {sys.argv[1]}")
PYEOF
then
    echo "gpu-check: cannot import draftsmith/hydra/omegaconf from this repo (run tests/gpu_check/make_gpu_wheels.sh first?)" >&2
    exit 2
fi

if [[ " $* " != *" --device cpu "* ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu-check: no NVIDIA GPU here (nvidia-smi missing or failing); run it on a CUDA machine (docs/GPU.md)" >&2
        exit 3
    fi
    if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu-check: $("$PY" -c 'import torch; print("torch", torch.__version__)') sees no CUDA device" \
             "(CPU-only build?); use a CUDA torch (PYTHON=... to pick another interpreter)" >&2
        exit 3
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
fi

OUT_DIR="${OUT:-$REPO/outputs/gpu_check}"
mkdir -p "$OUT_DIR"
cd "$REPO" || exit 2
# Each stage has its own limit inside gpu_check.py; this one bounds the whole run.
timeout --kill-after=30 "${GPU_CHECK_TIMEOUT:-1500}" "$PY" tests/gpu_check/gpu_check.py --out "$OUT_DIR" "$@"
rc=$?
[[ $rc == 124 ]] && echo "gpu-check: the whole run passed its ${GPU_CHECK_TIMEOUT:-1500} s limit" >&2
exit $rc
