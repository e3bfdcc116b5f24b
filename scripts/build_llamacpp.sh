#!/usr/bin/env bash
# Cached build of llama.cpp's CPU tools (the peer `draftsmith bench export --llamacpp` times), from the llama.cpp tree that
# the PyPI source distribution llama-cpp-python==$VERSION vendors under vendor/llama.cpp. Built once, outside the
# clone, into $DRAFTSMITH_CACHE/llamacpp-$VERSION (default ~/.cache/draftsmith): bin/ holds the tools,
# convert_hf_to_gguf.py + conversion/ + gguf-py/ (+ pydeps/) the HF -> GGUF converter. A second run returns at once.
# On failure the log's tail is kept in llamacpp-$VERSION.failed next to it; retry with `make llamacpp` (or
# LLAMACPP_FORCE=1 to redo a finished one). Knobs: PYTHON (its pip downloads; the converter runs on it: the project's
# venv), LLAMACPP_JOBS (default 2), LLAMACPP_TARGETS (the cmake targets; default below), LLAMACPP_CMAKE_ARGS (added
# to the configure step).
set -euo pipefail

VERSION=${LLAMACPP_VERSION:-0.3.36}
CACHE=${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}
ROOT=$CACHE/llamacpp-$VERSION
FAILED=$ROOT.failed
LOG=$ROOT.log
PY=${PYTHON:-python3}
JOBS=${LLAMACPP_JOBS:-2}
# llama-completion is the plain completion tool (llama-cli is the chat front end; it needs the server build).
TARGETS=${LLAMACPP_TARGETS:-llama-completion llama-bench llama-speculative-simple llama-quantize llama-tokenize}

if [[ -f $ROOT/.done && -z ${LLAMACPP_FORCE:-} ]]; then
    echo "llama.cpp $VERSION: cached in $ROOT/bin (built in $(cat "$ROOT/build_seconds" 2>/dev/null || echo '?') s)"
    exit 0
fi

mkdir -p "$CACHE"
exec 9>"$ROOT.lock"
if ! flock -n 9; then
    echo "another build of llama.cpp $VERSION is running (log: $LOG); waiting for it"
    flock 9
    [[ -f $ROOT/.done ]] && { echo "llama.cpp $VERSION: built by the other run in $ROOT/bin"; exit 0; }
fi

rm -f "$FAILED" "$ROOT/.done"
: > "$LOG"
start=$(date +%s)

fail() {
    { echo "step: $1"; tail -n 25 "$LOG"; } > "$FAILED"
    echo "llama.cpp $VERSION build failed at '$1' (reason kept in $FAILED, full log $LOG)." >&2
    echo "Fix the cause, then retry with: make llamacpp   (or: bash scripts/build_llamacpp.sh)" >&2
    exit 1
}

step() {  # step NAME CMD...: run CMD with its output in the log, recording NAME on failure
    local name=$1
    shift
    echo "== $name: $*" >> "$LOG"
    "$@" >> "$LOG" 2>&1 || fail "$name"
}

SRC=$ROOT/src
mkdir -p "$ROOT/dist" "$SRC"
sdist=$(ls "$ROOT"/dist/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
if [[ -z $sdist ]]; then
    echo "downloading the llama-cpp-python==$VERSION source distribution (~75 MB)"
    step download "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT/dist"
    sdist=$ROOT/dist/llama_cpp_python-$VERSION.tar.gz
fi
TREE=$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp
[[ -f $TREE/CMakeLists.txt ]] || step unpack tar -xzf "$sdist" -C "$SRC"

# Network-free configure: no OpenSSL/HTTPS downloads, no web UI, no server, tests or unified app; static libraries
# so the installed binaries stand alone; GGML_NATIVE tunes ggml for this CPU (AVX-512/BF16 where present).
echo "configuring llama.cpp (log: $LOG)"
# shellcheck disable=SC2086  # LLAMACPP_CMAKE_ARGS is a list of words on purpose
step configure cmake -S "$TREE" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_LLGUIDANCE=OFF \
    ${LLAMACPP_CMAKE_ARGS:-}
echo "building $TARGETS with -j$JOBS (several minutes, once)"
# shellcheck disable=SC2086
step build cmake --build "$ROOT/build" --config Release -j "$JOBS" --target $TARGETS

mkdir -p "$ROOT/bin"
for t in $TARGETS; do
    step "install $t" install -m 755 "$ROOT/build/bin/$t" "$ROOT/bin/$t"
done
# the converter imports its conversion/ package and the gguf-py next to it (unless NO_LOCAL_GGUF is set)
rm -rf "$ROOT/conversion" "$ROOT/gguf-py"
step "install converter" cp -r "$TREE/convert_hf_to_gguf.py" "$TREE/conversion" "$TREE/gguf-py" "$ROOT/"
# the converter imports sentencepiece even for a BPE (tokenizer.json) model such as SmolLM2: installed beside it, in
# pydeps/ (bench/llamacpp_build.py puts it on PYTHONPATH), not in the project's venv; torch/transformers/numpy come from PYTHON
rm -rf "$ROOT/pydeps"
step "converter deps" "$PY" -m pip install -q --no-deps --target "$ROOT/pydeps" "sentencepiece>=0.1.98,<0.3.0"

seconds=$(( $(date +%s) - start ))
echo "$seconds" > "$ROOT/build_seconds"
{ echo "llama-cpp-python==$VERSION (vendor/llama.cpp)"; echo "targets: $TARGETS"; echo "built in ${seconds}s";
  date -u +%FT%TZ; } > "$ROOT/.done"
echo "llama.cpp $VERSION: built in ${seconds}s into $ROOT/bin"
