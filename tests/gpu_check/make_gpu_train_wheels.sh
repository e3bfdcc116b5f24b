#!/usr/bin/env bash
# Run HERE (where PyPI can be reached), before `make gpu-train`'s device calls: the wheels each command needs on the GPU
# machine (python 3.12, x86-64, no registry; its image is listed in /work/.library/device/KINDS.md), into
# .gpu_train/cmd1/wheels and .gpu_train/cmd2/wheels. Both: hydra-core, omegaconf, antlr4 (train.py's config). cmd1 also
# speculators 0.9.0 and what it imports that the image lacks (the versions of the test venv .cache/venv-speculators);
# cmd2 also gguf (transformers reads the target's GGUF with it).
set -euo pipefail

# REPO, PY and the offline environment
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"
# .gpu_train/ is in .gitignore: it travels only where a device call names it in `carry`.

CONFIG=(hydra-core==1.3.8 omegaconf==2.3.1)
PEER_PURE=(speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 python-dotenv==1.2.4 loguru==0.7.3
           openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 sniffio==1.3.1 truststore==0.10.5 pydantic==2.14.4
           pydantic-settings==2.16.3 typing-inspection==0.4.5 annotated-types==0.8.0 fsspec==2026.7.0)
PEER_BINARY=(pydantic-core==2.50.5 jiter==0.19.0)
PY312=(--python-version 3.12 --only-binary=:all: --no-deps)

for cmd in cmd1 cmd2; do
    DEST=.gpu_train/$cmd/wheels
    rm -rf "$DEST" && mkdir -p "$DEST"
    "$PY" -m pip download -q "${PY312[@]}" --implementation py --abi none --platform any -d "$DEST" "${CONFIG[@]}"
    "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" antlr4-python3-runtime==4.9.3
done
"$PY" -m pip download -q "${PY312[@]}" --implementation py --abi none --platform any -d .gpu_train/cmd1/wheels \
    "${PEER_PURE[@]}" multiprocess==0.70.19
"$PY" -m pip download -q "${PY312[@]}" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu_train/cmd1/wheels "${PEER_BINARY[@]}"
"$PY" -m pip download -q "${PY312[@]}" --implementation py --abi none --platform any -d .gpu_train/cmd2/wheels \
    gguf==0.19.0
for cmd in cmd1 cmd2; do
    echo "make_gpu_train_wheels: $cmd: $(ls .gpu_train/$cmd/wheels/*.whl | wc -l) wheels, $(du -sh .gpu_train/$cmd/wheels | cut -f1)"
done
