#!/usr/bin/env bash
# Run HERE (where PyPI can be reached), before `make gpu-check` on the lent GPU machine, which has no registry:
# downloads into .whl/ the wheels its python3 (3.12, x86-64) lacks, for tests/gpu_check/gpu_check.sh to install.
# What the GPU image lacks (docs/GPU.md): hydra-core, omegaconf and omegaconf's antlr4-python3-runtime 4.9.*; and,
# for the strategy:deepspeed_* stages, deepspeed with hjson and pydantic (pydantic-core is the one binary wheel).
# antlr4-python3-runtime 4.9.3 and deepspeed exist only as sdists, so they are built into wheels here (deepspeed
# with DS_BUILD_OPS=0 against this venv's torch: its ops compile on first use there).
set -euo pipefail

# REPO, PY and the offline environment
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO"
DEST=.whl
# One version of each: two versions of a package stop the whole --no-deps install on the GPU machine.
PURE=(hydra-core==1.3.8 omegaconf==2.3.1)  # the versions the test suite runs with
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)
DEEPSPEED_PURE=(pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0)
DEEPSPEED_BINARY=(pydantic-core==2.50.5)  # the version pydantic 2.14.4 pins
DEEPSPEED=deepspeed==0.19.8

# .whl/ must never be committed: ignore it locally (.git/info/exclude), whatever git layout this checkout has.
EXCLUDE="$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"

rm -rf "$DEST" && mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    --abi none --platform any -d "$DEST" "${PURE[@]}"
# Built from the sdist with --no-deps: a pure-Python py3-none-any wheel, valid on any CPython 3.
"$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" "${SDIST_ONLY[@]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    --abi none --platform any -d "$DEST" "${DEEPSPEED_PURE[@]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${DEEPSPEED_BINARY[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$DEEPSPEED"

for whl in "$DEST"/*.whl; do
    case "$whl" in *-py3-none-any.whl | *-py2.py3-none-any.whl | *-cp312-cp312-*manylinux*_x86_64.whl) ;;
        *) echo "make_gpu_wheels: $whl is neither pure Python nor cp312 manylinux x86_64 (what the GPU machine runs)" >&2; exit 1;;
    esac
done
ls -l "$DEST"
size=$(du -sb "$DEST" | cut -f1)
echo "make_gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $((size / 1024)) KiB in $DEST (the device tool carries at most 64 MiB in all)"
(( size < 64 * 1024 * 1024 )) || { echo "make_gpu_wheels: $DEST is over 64 MiB" >&2; exit 1; }
