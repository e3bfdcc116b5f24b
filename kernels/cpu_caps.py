"""What this CPU can run: ISA flags probed once, and the choices that follow from them.

Every backend choice (the fused C++ layer and its ISA variant, oneDNN bf16 linears, plain
``F.linear``) and the training dtype read a :class:`CpuCaps`. :func:`probe` fills it from the OS
(``/proc/cpuinfo`` on Linux, ``sysctl`` on macOS) and falls back to torch's own CPU capability
string; the result is cached. Decision functions take a ``CpuCaps`` argument so that tests inject
any capability and exercise every branch on any machine; :func:`injected` makes :func:`probe` itself
answer for another CPU kind (tests run a whole load under it), while what executes native code
(:func:`~draftsmith.kernels.cpu_layer.load_cpu_layer`) asks :func:`hardware`, which injection never
changes, so an injected kind can only make the code choose a path this machine then refuses and
falls back from, never run instructions the CPU lacks.

``DRAFTSMITH_CPU_ISA`` caps the probed flags at a level (``avx512_bf16``, ``avx512``, ``avx2``,
``generic``): set it to run the AVX2 path on an AVX-512 machine. It can only remove instructions the
CPU has, never add them. torch's own ``ATEN_CPU_CAPABILITY=avx2|default`` caps them too. To make an
AVX-512 machine behave as an AVX2-only one throughout (torch, oneDNN and draftsmith), set
``DRAFTSMITH_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.common.dtypes import DTYPES, dtype_from_name
from draftsmith.common.errors import InputError

# Flags (Linux /proc/cpuinfo spelling) that each level keeps; a level keeps the ones below it too.
_LEVELS: dict[str, frozenset[str]] = {
    "generic": frozenset({"sse2", "sse4_1", "sse4_2", "neon", "asimd"}),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}),
    "avx512_bf16": frozenset(
        {"avx512_bf16", "avx512_fp16", "avx_ne_convert", "amx_bf16", "amx_tile", "amx_int8"}
    ),
}
LEVELS = tuple(_LEVELS)  # in increasing order
ISA_ENV = "DRAFTSMITH_CPU_ISA"

# macOS (Intel) sysctl spells some flags differently from Linux.
_SYSCTL_ALIASES = {"avx1.0": "avx", "avx512bf16": "avx512_bf16"}


@dataclass(frozen=True)
class CpuCaps:
    """A CPU's instruction-set flags (Linux cpuinfo names, lower case) and where they came from."""

    arch: str  # platform.machine(): "x86_64", "aarch64", "arm64", ...
    flags: frozenset[str] = field(default_factory=frozenset)
    model: str = "unknown CPU"
    source: str = "cpuinfo"  # cpuinfo | sysctl | torch | injected | capped at <level>

    def has(self, *names: str) -> bool:
        """Whether every flag in ``names`` is present."""
        return all(n in self.flags for n in names)

    @property
    def x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64", "i686", "x86")

    @property
    def avx512_bf16(self) -> bool:
        """AVX512-BF16 with the AVX-512 subsets the fused layer's AVX-512 variant uses."""
        return self.x86 and self.has("avx512f", "avx512bw", "avx512vl", "avx512_bf16")

    @property
    def avx2_fma(self) -> bool:
        """AVX2 + FMA: what the fused layer's AVX2 variant needs (bf16 widening is a 32-bit
        shift)."""
        return self.x86 and self.has("avx2", "fma")

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware (AVX512-BF16 or AMX-BF16): torch's bf16 matmuls are fast only
        then."""
        return self.x86 and (self.avx512_bf16 or self.has("amx_bf16"))

    @property
    def onednn_bf16(self) -> bool:
        """oneDNN's own rule for its bf16 reorder/linear: AVX-NE-CONVERT, or AVX512 BW + VL + DQ."""
        return self.x86 and (
            self.has("avx_ne_convert") or self.has("avx512bw", "avx512vl", "avx512dq")
        )

    def cpu_layer_isa(self) -> str | None:
        """The fused C++ layer variant this CPU runs ("avx512_bf16" | "avx2"), None when neither
        (ARM, old x86)."""
        if self.avx512_bf16:
            return "avx512_bf16"
        if self.avx2_fma:
            return "avx2"
        return None

    def best_isa(self) -> str:
        """A short name of the best level present, for logs and bench tables."""
        if self.native_bf16:
            return "amx_bf16" if self.has("amx_bf16") and not self.avx512_bf16 else "avx512_bf16"
        if self.x86 and self.has("avx512f"):
            return "avx512 (no bf16)"
        if self.avx2_fma:
            return "avx2+fma"
        return self.arch if not self.x86 else "x86 (no avx2)"

    def describe(self) -> str:
        """One line: model, best ISA and the source of the flags."""
        return f"{self.model} [{self.arch}, {self.best_isa()}, flags from {self.source}]"


def _cpuinfo() -> tuple[set[str], str] | None:
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def parse_cpuinfo(text: str) -> tuple[set[str], str] | None:
    """(flags, model name) from Linux ``/proc/cpuinfo`` text (x86 ``flags``, ARM ``Features``); None
    if no flags."""
    flags: set[str] = set()
    model = "unknown CPU"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:  # x86: flags; ARM: Features
            flags = set(value.lower().split())
        elif key in ("model name", "cpu model", "hardware") and model == "unknown CPU":
            model = value.strip()
    return (flags, model) if flags else None


def _sysctl() -> tuple[set[str], str] | None:
    def read(name: str) -> str:
        try:
            return subprocess.run(
                ["sysctl", "-n", name], capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    raw = (
        " ".join(read(n) for n in ("machdep.cpu.features", "machdep.cpu.leaf7_features"))
        .lower()
        .split()
    )
    flags = {_SYSCTL_ALIASES.get(f, f) for f in raw}
    if read("hw.optional.arm.FEAT_BF16") == "1":
        flags.add("bf16")
    if read("hw.optional.neon") == "1":
        flags.add("neon")
    model = read("machdep.cpu.brand_string") or "Apple CPU"
    return (flags, model) if flags else None


def _torch_capability() -> set[str]:
    """Flags implied by torch's dispatch level ("AVX512", "AVX2", "DEFAULT", ...): a coarse last
    resort."""
    try:
        cap = torch.backends.cpu.get_cpu_capability().upper()
    except Exception:  # older torch builds
        return set()
    flags: set[str] = set()
    if cap.startswith("AVX2") or cap.startswith("AVX512"):
        flags |= _LEVELS["avx2"]
    if cap.startswith("AVX512"):
        flags |= {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    return flags


def cap_at(caps: CpuCaps, level: str) -> CpuCaps:
    """``caps`` with every flag above ``level`` removed (see the module docstring). Raises
    ValueError for an unknown level, listing the valid ones."""
    level = level.strip().lower()
    if level not in _LEVELS:
        raise InputError(f"{ISA_ENV}={level!r} is not a level; valid: {', '.join(LEVELS)}")
    allowed = frozenset().union(*(_LEVELS[n] for n in LEVELS[: LEVELS.index(level) + 1]))
    above = frozenset().union(*(_LEVELS[n] for n in LEVELS[LEVELS.index(level) + 1 :]))
    return CpuCaps(
        caps.arch,
        frozenset(f for f in caps.flags if f in allowed or f not in above),
        caps.model,
        f"{caps.source}, capped at {level} by {ISA_ENV}",
    )


_INJECTED: list[CpuCaps] = []  # a CPU kind tests made probe() answer for (innermost last)


def probe() -> CpuCaps:
    """The capabilities every choice follows: this machine's (:func:`hardware`), or a kind
    :func:`injected` set."""
    return _INJECTED[-1] if _INJECTED else hardware()


@contextmanager
def injected(caps: CpuCaps) -> Iterator[CpuCaps]:
    """Within the block, :func:`probe` answers ``caps`` (source "injected"): every choice follows
    that CPU kind, and native code the real CPU cannot run is refused by :func:`hardware` checks, so
    the fallback runs instead.
    """
    caps = CpuCaps(caps.arch, caps.flags, caps.model, "injected")
    _INJECTED.append(caps)
    try:
        yield caps
    finally:
        _INJECTED.remove(caps)


@functools.lru_cache(maxsize=1)
def hardware() -> CpuCaps:
    """This machine's capabilities (cached): OS flags, else torch's capability string; then
    ``DRAFTSMITH_CPU_ISA`` (which only removes instructions). Never injected: what runs native code
    checks it."""
    arch = platform.machine() or "unknown"
    found, source = _cpuinfo(), "cpuinfo"
    if found is None and platform.system() == "Darwin":
        found, source = _sysctl(), "sysctl"
    if found is None:
        found, source = (_torch_capability(), platform.processor() or "unknown CPU"), "torch"
    caps = CpuCaps(arch, frozenset(found[0]), found[1], source)
    level = os.environ.get(ISA_ENV, "").strip()
    if not level:  # torch limited to AVX2 / no SIMD computes as such a CPU does: choose as for one
        level = {"avx2": "avx2", "default": "generic"}.get(
            os.environ.get("ATEN_CPU_CAPABILITY", "").lower(), ""
        )
    return cap_at(caps, level) if level else caps


@functools.lru_cache(maxsize=1)
def onednn_bf16_runs() -> bool:
    """A tiny trial of oneDNN's bf16 weight reorder: the op existing does not mean this CPU can run
    it."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def native_bf16(device: torch.device | str, caps: CpuCaps | None = None) -> tuple[bool, str]:
    """Whether ``device`` computes bf16 natively, and why: CUDA with bf16 support, or a CPU with
    AVX512-BF16 / AMX."""
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, "CUDA device supports bf16" if ok else "this CUDA device has no bf16 support"
    if device.type != "cpu":
        return False, f"no bf16 rule for device type {device.type!r}"
    caps = caps or probe()
    if caps.native_bf16:
        return True, f"CPU has {caps.best_isa()}"
    return (
        False,
        (
            f"CPU has no bf16 instructions ({caps.best_isa()}): bf16 would be emulated and several"
            " times slower"
        ),
    )


def resolve_dtype(
    name: str, device: torch.device | str, caps: CpuCaps | None = None
) -> tuple[torch.dtype, str]:
    """``auto`` | ``bf16`` | ``fp16`` | ``fp32`` (and torch spellings) -> (dtype, why). ``auto``
    takes bf16 where the device computes it natively and fp32 otherwise."""
    if str(name).lower() == "auto":
        native, why = native_bf16(device, caps)
        return (
            (torch.bfloat16, f"auto -> bf16 ({why})")
            if native
            else (torch.float32, f"auto -> fp32 ({why})")
        )
    if str(name).lower().removeprefix("torch.") not in DTYPES:
        raise InputError(f"unknown dtype {name!r}; valid: auto, {', '.join(DTYPES)}")
    return dtype_from_name(name), f"{name} (as configured)"
