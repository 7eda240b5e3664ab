"""Facts about this machine that plugins choose kernels and precision by (imports nothing heavy)."""

from __future__ import annotations

import hashlib
import platform
from functools import lru_cache


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo: x86's `flags` line, ARM's `Features` line
    (e.g. asimd, asimddp, i8mm); empty where there is none. (The native kernels read the CPU
    themselves, with cpuid or HWCAP: outrider_llm.native.cpu_features().)"""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16_instructions() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); slow emulation otherwise."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@lru_cache(maxsize=1)
def cpu_fingerprint() -> str:
    """This CPU's architecture and feature set, for the keys of cached artifacts laid out for the
    kernels that run here (ONNX Runtime's prepacked weights): 'x86_64/' + a digest of every flag.
    Every flag, not a chosen few: a host that differs in any of them builds its own copy (a few
    tenths of a second, once) rather than risk reading another kernel's layout."""
    flags = " ".join(sorted(cpu_flags()))
    return f"{platform.machine().lower()}/{hashlib.sha256(flags.encode()).hexdigest()[:16]}"
