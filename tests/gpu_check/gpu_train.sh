#!/usr/bin/env bash
# `make gpu-train`: tests/gpu_check/gpu_train.py with the wheels its command carries and draftsmith importable from
# this checkout (the repository root is the package). Subcommands: prepare | part1 | part2 | receive | dry-run
# (gpu_train.py's docstring). On the GPU machine: no registry, so the wheels in .gpu_train/cmdN/wheels are installed
# into /tmp/site (part1 brings speculators' and its needs, part2 gguf's); results go to $OUT.
set -uo pipefail

# REPO, PY and the offline environment
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

command="${1:-}"
case "$command" in
    part1|part2)
        WHEELS="$REPO/.gpu_train/cmd${command: -1}/wheels"
        # the CPU rehearsal (--device cpu) runs in this venv; the wheels are the GPU machine's (python 3.12)
        if [[ " $* " != *" --device cpu "* ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                "$WHEELS"/*.whl || { echo "gpu-train: installing the carried wheels from $WHEELS failed" >&2; exit 2; }
            export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        fi
        if [[ " $* " != *" --device cpu "* ]]; then
            export GPU_TRAIN_PEER_PYTHON="${GPU_TRAIN_PEER_PYTHON:-$PY}"  # speculators runs in this interpreter there
            if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
                echo "gpu-train: $command needs a CUDA GPU (torch sees none); rehearse: make gpu-train DRY_RUN=1" >&2
                exit 3
            fi
        fi;;
    prepare|receive|dry-run) ;;
    *) echo "usage: gpu_train.sh prepare|part1|part2|receive|dry-run [options]" >&2; exit 2;;
esac

PKG="${GPU_CHECK_PKG:-/tmp/dspkg}"
mkdir -p "$PKG" && ln -sfn "$REPO" "$PKG/draftsmith"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO" || exit 2
exec "$PY" tests/gpu_check/gpu_train.py "$@"
