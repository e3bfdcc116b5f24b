#!/usr/bin/env bash
# Run HERE (where PyPI can be reached), before `make gpu-check` on the lent GPU machine, which has no registry:
# downloads into .whl/ the wheels its python3 (3.12, x86-64) lacks, for scripts/gpu_check.sh to install.
# What the GPU image lacks (docs/GPU.md): hydra-core, omegaconf and omegaconf's antlr4-python3-runtime 4.9.*.
# All three are pure Python; antlr4-python3-runtime 4.9.3 exists only as an sdist, so it is built into a wheel here.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
DEST=.whl
# One version of each: two versions of a package stop the whole --no-deps install on the GPU machine.
PURE=(hydra-core==1.3.8 omegaconf==2.3.1)  # the versions the test suite runs with
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)

# .whl/ must never be committed: ignore it locally (.git/info/exclude), whatever git layout this checkout has.
EXCLUDE="$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"

rm -rf "$DEST" && mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
    --abi none --platform any -d "$DEST" "${PURE[@]}"
# Built from the sdist with --no-deps: a pure-Python py3-none-any wheel, valid on any CPython 3.
"$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" "${SDIST_ONLY[@]}"

for whl in "$DEST"/*.whl; do
    case "$whl" in *-py3-none-any.whl | *-py2.py3-none-any.whl) ;;
        *) echo "make_gpu_wheels: $whl is not pure Python; the GPU machine needs cp312 manylinux x86_64" >&2; exit 1;;
    esac
done
ls -l "$DEST"
size=$(du -sb "$DEST" | cut -f1)
echo "make_gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $((size / 1024)) KiB in $DEST (the device tool carries at most 64 MiB in all)"
(( size < 64 * 1024 * 1024 )) || { echo "make_gpu_wheels: $DEST is over 64 MiB" >&2; exit 1; }
