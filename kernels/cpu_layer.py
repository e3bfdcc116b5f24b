"""Fused bf16 decoder layer for x86 CPUs (C++ in ``cpu_decoder_layer.cpp``), built on first use per
ISA variant.

The lean decoder's torch path (``draftsmith.runtime.target.model``) is the reference; this kernel
runs the same layer in one call so that a batch-1 decoding step is bound by reading the weights
rather than by per-op overhead. It is built with ``torch.utils.cpp_extension`` (g++ and ninja
needed) into ``~/.cache/draftsmith/extensions`` the first time a bf16 model asks for it (about 30
s), and loaded from there afterwards. Two variants share the source: ``avx512_bf16`` (AVX-512
vectors of 16 fp32 lanes) and ``avx2`` (two AVX2 vectors of 8 lanes, for CPUs without AVX-512); both
read bf16 weights and accumulate in fp32 with the same bits: ``vdpbf16ps`` (odd column of each pair,
then the even one, subnormals flushed) in the first, the same order of fp32 FMAs under FTZ/DAZ in
the second. Besides the layer (``decoder_layer``; ``ln1=None`` runs it without its input norm, as
EAGLE-1's draft layer) it offers ``TargetStack`` (a whole target forward: every layer, the final
norm and the LM head in one call), ``linear`` (any packed bf16 linear), ``linear_argmax`` (a greedy
step's LM head reduced to each row's argmax inside the GEMM, never writing the [T, V] logits),
``norm_linear_topk`` (a draft head: norm, GEMM, softmax and top-k in one call) and ``rms_norm``.
Everything here is imported lazily; when the CPU, the compiler or the shapes do not allow it,
:func:`load_cpu_layer` explains why and the caller falls back to torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.kernels import cpu_caps

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decoder_layer.cpp")


class CpuLayerUnavailable(DraftsmithError, RuntimeError):
    """The fused CPU layer cannot run here; the message says why (CPU flags, compiler, shapes)."""


# One source, one build per ISA variant: the C++ picks its vector layer from the DRAFTSMITH_ISA_*
# macro.
ISA_FLAGS: dict[str, list[str]] = {
    "avx512_bf16": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512bf16",
        "-mfma",
        "-DDRAFTSMITH_ISA_AVX512_BF16",
    ],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DDRAFTSMITH_ISA_AVX2"],
}
ISAS = tuple(ISA_FLAGS)


def extension_dir() -> Path:
    """Where built extensions are cached (``DRAFTSMITH_EXTENSIONS_DIR`` or
    ``~/.cache/draftsmith/extensions``)."""
    default = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "draftsmith" / "extensions"
    )
    return Path(os.environ.get("DRAFTSMITH_EXTENSIONS_DIR", default))


def _put_env_bin_on_path() -> None:
    """pip's ``ninja`` lives next to the interpreter, which is not on PATH when a venv is used
    without activation."""
    env_bin = str(Path(sys.executable).parent)
    if env_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([env_bin, os.environ.get("PATH", "")])


def pick_isa(caps: cpu_caps.CpuCaps | None = None) -> tuple[str | None, str]:
    """The variant for this CPU ("avx512_bf16" | "avx2" | None) and a reason a user can read."""
    caps = caps or cpu_caps.probe()
    isa = caps.cpu_layer_isa()
    if isa is None:
        return (
            None,
            (
                f"this CPU ({caps.best_isa()}) has neither AVX512-BF16 nor AVX2+FMA, which the"
                " fused layer needs"
            ),
        )
    return isa, f"fused C++ layer, {isa} variant ({caps.best_isa()} CPU)"


def why_unavailable(isa: str | None = None, caps: cpu_caps.CpuCaps | None = None) -> str | None:
    """None when the extension (``isa`` variant, default: the best this CPU runs) can be built and
    run here, else the reason."""
    _put_env_bin_on_path()
    caps = caps or cpu_caps.probe()
    if isa is None:
        isa, reason = pick_isa(caps)
        if isa is None:
            return reason
    elif isa not in ISA_FLAGS:
        return f"unknown fused-layer variant {isa!r}; valid: {', '.join(ISAS)}"
    elif isa == "avx512_bf16" and not caps.avx512_bf16:
        return (
            f"this CPU ({caps.best_isa()}) lacks AVX512-BF16, which the avx512_bf16 variant needs"
        )
    elif isa == "avx2" and not caps.avx2_fma:
        return f"this CPU ({caps.best_isa()}) lacks AVX2+FMA, which the avx2 variant needs"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++/g++) on PATH to build the fused CPU layer"
    if shutil.which("ninja") is None:
        return (
            "ninja is not on PATH (torch.utils.cpp_extension needs it to build the fused CPU layer)"
        )
    return None


# a build takes about a minute on 2 cores; waiting this long on another process's build means that
# process is stuck (paused with SIGSTOP, or hung), and the caller falls back to torch instead
BUILD_WAIT_S = 900
BATON = "draftsmith-build.lock"


@contextlib.contextmanager
def build_baton(build: Path, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold the build folder's own lock while torch builds or loads the extension there.

    torch's file baton (``build/lock``) records no owner, so a build killed mid-way (Ctrl-C, kill
    -9, a CI timeout) leaves it behind and every later process waits on it for ever. This lock is
    an ``flock`` on ``build/draftsmith-build.lock``: the kernel drops it when its holder exits in
    any way, so whoever holds it knows no build is running, and any ``lock`` file torch left is
    stale and removed. A holder that stays alive without finishing (paused, hung) is waited for
    ``wait_s`` seconds, then refused with its pid: CpuLayerUnavailable, and the caller runs torch.
    """
    baton = build / BATON
    with open(baton, "a+") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    raise CpuLayerUnavailable(
                        f"another process (pid {holder}) has held the fused CPU layer's build "
                        f"lock {baton} for over {wait_s:.0f} s (paused or hung?); running torch"
                    ) from None
                time.sleep(0.2)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            stale = build / "lock"
            if stale.exists():
                log.warning("removing torch's build lock left by an interrupted build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_cpu_layer(isa: str | None = None) -> ModuleType:
    """Build (once per source version and ISA variant) and import the extension; raises
    CpuLayerUnavailable with the reason. ``isa``: "avx512_bf16" | "avx2" | None (the best this CPU
    runs, as :func:`cpu_caps.probe` says). The variant must also run on this machine's own CPU
    (:func:`cpu_caps.hardware`): a CPU kind injected by a test can make the runtime ask for a
    variant, never run one whose instructions the hardware lacks."""
    reason = why_unavailable(isa)
    if reason:
        raise CpuLayerUnavailable(reason)
    isa = isa or pick_isa()[0]
    on_hardware = why_unavailable(isa, caps=cpu_caps.hardware())
    if on_hardware:
        raise CpuLayerUnavailable(f"{on_hardware} (this machine's own CPU)")
    return _load(isa)


@functools.lru_cache(maxsize=4)
def _load(isa: str) -> ModuleType:
    """Build and import the ``isa`` variant (checked to run here)."""
    from torch.utils.cpp_extension import load  # lazy: pulls in setuptools machinery

    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:12]
    name = (  # a new source or torch gets a new module, never a stale one
        f"draftsmith_cpu_layer_{isa}_{tag}"
    )
    build = extension_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", *ISA_FLAGS[isa], "-fopenmp"]
    try:
        with build_baton(build):
            module = load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
    except CpuLayerUnavailable:
        raise
    # compiler errors come as RuntimeError / CalledProcessError with the log
    except Exception as err:
        raise CpuLayerUnavailable(f"building the fused CPU layer ({isa}) failed: {err}") from err
    module.isa = isa
    return module


def compile_check(isa: str) -> str | None:
    """Compile the ``isa`` variant to an object file without importing or running it: None when it
    compiles, else the compiler's last lines. A variant this CPU cannot run is still checked this
    way (a new CPU kind should never be the first to build a branch); a success is remembered per
    source and torch version beside the built extensions.
    """
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return "no C++ compiler (c++/g++) on PATH"
    tag = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    marker = extension_dir() / f"compile_check_{isa}_{tag}.ok"
    if marker.is_file():
        return None
    marker.parent.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    obj = marker.with_suffix(".o")
    cmd = [
        compiler,
        "-std=c++17",
        "-O0",
        "-fPIC",
        "-fopenmp",
        "-w",
        "-DTORCH_EXTENSION_NAME=compile_check",
        *ISA_FLAGS[isa],
        *includes,
        "-c",
        str(SOURCE),
        "-o",
        str(obj),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    obj.unlink(missing_ok=True)
    if done.returncode:
        return "\n".join(done.stderr.strip().splitlines()[-15:])
    marker.touch()
    return None


def shapes_supported(head_dim: int, hidden_size: int, intermediate_size: int) -> str | None:
    """None when the kernel handles these shapes, else the reason (head_dim a multiple of 16 up to
    128, even sizes)."""
    if head_dim % 16 or head_dim > 128:
        return f"head_dim {head_dim} is not a multiple of 16 up to 128"
    if hidden_size % 2 or intermediate_size % 2:
        return f"hidden ({hidden_size}) and intermediate ({intermediate_size}) sizes must be even"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [ceil(N/16), K/2, 32]: blocks of 16 rows, each column pair of the block in one
    64-byte vector (the order the kernel's GEMM streams). Rows are zero-padded to a whole block; K
    must be even."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"pack_weight needs an even number of input features, got {k}")
    blocks = -(-n // 16)
    padded = torch.zeros(blocks * 16, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return (
        padded.view(blocks, 16, k // 2, 2).transpose(1, 2).reshape(blocks, k // 2, 32).contiguous()
    )
