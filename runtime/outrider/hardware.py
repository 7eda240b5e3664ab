"""This machine and this process: the facts plugins choose kernels, precision and threads by, and
the process's memory (resident size, handing freed heap back, bounding malloc arenas). Imports
nothing heavy."""

from __future__ import annotations

import gc
import hashlib
import math
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Optional


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


def physical_cores() -> int:
    """Physical cores in this process's CPU affinity set, capped by a cgroup v2 CPU quota."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux: no affinity or topology files to read
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    count = len(cores)
    quota = _cgroup_cpu_quota()
    return max(1, min(count, quota) if quota else count)


def _cgroup_cpu_quota() -> Optional[int]:
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(1, math.ceil(int(limit) / int(period)))


def usable_cpus() -> int:
    """The CPUs in this process's affinity set (hyper-threads counted), or the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def resident_bytes() -> int:
    """This process's resident memory (RSS), from /proc; 0 where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them otherwise, and
    the RSS after an unload would stay at its peak)."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): freed memory is reused, not returned
        pass


def bound_malloc_arenas(arenas: int = 2) -> bool:
    """At most `arenas` glibc malloc arenas (unless MALLOC_ARENA_MAX says otherwise). Each thread
    that allocates may get an arena of its own (up to 8 per core), and a model's weights freed in
    one stay as fragments there: 20 load/unload cycles of smollm2-int8 grew the RSS by 80 MB with
    the default, by none with 2 (and decoding was no slower). Called before the server's threads
    start; False where this is not glibc."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None).mallopt(-8, arenas) == 1  # M_ARENA_MAX
    except (OSError, AttributeError):
        return False
