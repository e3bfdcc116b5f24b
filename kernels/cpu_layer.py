"""Fused bf16 decoder layer for CPUs with AVX512-BF16 (C++ in ``cpu_decoder_layer.cpp``), built on first use.

The lean decoder's torch path (``draftsmith.runtime.model``) is the reference; this kernel runs the same layer in one
call so that a batch-1 decoding step is bound by reading the weights rather than by per-op overhead. It is built with
``torch.utils.cpp_extension`` (g++ and ninja needed) into ``~/.cache/draftsmith/extensions`` the first time a bf16
model asks for it (about 30 s), and loaded from there afterwards. Everything here is imported lazily; when the CPU,
the compiler or the shapes do not allow it, :func:`load_cpu_layer` explains why and the caller falls back to torch.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("cpu_decoder_layer.cpp")


class CpuLayerUnavailable(RuntimeError):
    """The fused CPU layer cannot run here; the message says why (CPU flags, compiler, shapes)."""


@functools.lru_cache(maxsize=1)
def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU advertises AVX512-BF16 (Linux /proc/cpuinfo)."""
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def extension_dir() -> Path:
    """Where built extensions are cached (``DRAFTSMITH_EXTENSIONS_DIR`` or ``~/.cache/draftsmith/extensions``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "draftsmith" / "extensions"
    return Path(os.environ.get("DRAFTSMITH_EXTENSIONS_DIR", default))


def _put_env_bin_on_path() -> None:
    """pip's ``ninja`` lives next to the interpreter, which is not on PATH when a venv is used without activation."""
    env_bin = str(Path(sys.executable).parent)
    if env_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([env_bin, os.environ.get("PATH", "")])


def why_unavailable() -> str | None:
    """None when the extension can be built and run here, else the reason."""
    _put_env_bin_on_path()
    if not cpu_has_avx512_bf16():
        return "this CPU lacks AVX512-BF16 (needed by the fused bf16 CPU layer)"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++/g++) on PATH to build the fused CPU layer"
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (torch.utils.cpp_extension needs it to build the fused CPU layer)"
    return None


@functools.lru_cache(maxsize=1)
def load_cpu_layer() -> ModuleType:
    """Build (once per source version) and import the extension; raises CpuLayerUnavailable with the reason."""
    reason = why_unavailable()
    if reason:
        raise CpuLayerUnavailable(reason)
    from torch.utils.cpp_extension import load  # lazy: pulls in setuptools machinery

    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:12]
    name = f"draftsmith_cpu_layer_{tag}"  # a new source or torch gets a new module, never a stale one
    build = extension_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"]
    try:
        return load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(build), verbose=False)  # fmt: skip
    except Exception as err:  # compiler errors come as RuntimeError / CalledProcessError with the log
        raise CpuLayerUnavailable(f"building the fused CPU layer failed: {err}") from err


def shapes_supported(head_dim: int, hidden_size: int, intermediate_size: int) -> str | None:
    """None when the kernel handles these shapes, else the reason (head_dim a multiple of 16 up to 128, even sizes)."""
    if head_dim % 16 or head_dim > 128:
        return f"head_dim {head_dim} is not a multiple of 16 up to 128"
    if hidden_size % 2 or intermediate_size % 2:
        return f"hidden ({hidden_size}) and intermediate ({intermediate_size}) sizes must be even"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [ceil(N/16), K/2, 32]: blocks of 16 rows, each column pair of the block in one 64-byte vector
    (the order the kernel's GEMM streams). Rows are zero-padded to a whole block; K must be even."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"pack_weight needs an even number of input features, got {k}")
    blocks = -(-n // 16)
    padded = torch.zeros(blocks * 16, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(blocks, 16, k // 2, 2).transpose(1, 2).reshape(blocks, k // 2, 32).contiguous()
