"""Torch state that is one per process, shared by every torch-based backend in it.

- The intra-op thread count: `torch.set_num_threads` is process-wide, so two models asking for
  different counts would silently overwrite each other, the last loaded winning for both. The
  first backend that sets it wins; a later one asking for another count gets a warning and the
  count in force. CUDA-only work never sets it (its matmuls do not run on these threads).
- The OpenMP team of an idle thread: libgomp gives each thread that starts a parallel region a
  team of worker threads of its own, kept while that thread lives. Once a process holds more such
  workers than CPUs (two torch models, or two instances, each with a team), libgomp stops
  spinning between regions for all of them, and each of a decode step's ~150 regions sleeps and
  wakes its threads through the kernel: a busy model beside an idle one ran 2-3x slower. So an
  instance hands its team back when it has nothing to do (`release_cpu_threads`).
- CUDA faults: after an illegal address or a device-side assert the process's CUDA context is
  poisoned and every later call fails, so an instance must report unhealthy for good (the core
  then takes it out of service); an out-of-memory error only fails the call that hit it.

Nothing here imports torch at module level (`import outrider` must not): the functions take it
when called, from backends that have already imported it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Callable, Optional

log = logging.getLogger("outrider.torch")

# Messages of CUDA errors that leave the context unusable (CUDA's "sticky" errors). Other CUDA
# errors (a bad launch argument) fail one call; the probe in `CudaHealth.report` has the last word.
_STICKY_MARKERS = (
    "illegal memory access",
    "an illegal address",
    "device-side assert",
    "unspecified launch failure",
    "illegal instruction",
    "misaligned address",
    "launch timed out",
    "uncorrectable ecc",
    "cublas_status_execution_failed",
)


class ThreadSetting:
    """The process's torch thread count: set once, by the first backend that asks."""

    def __init__(self, setter: Optional[Callable[[int], None]] = None) -> None:
        self._setter = setter
        self._lock = threading.Lock()
        self.threads: Optional[int] = None
        self.owner: Optional[str] = None

    def apply(self, threads: int, who: str) -> int:
        """Set `threads` for this process if nobody has yet; returns the count in force."""
        with self._lock:
            if self.threads is None:
                setter = self._setter
                if setter is None:
                    import torch

                    setter = torch.set_num_threads
                setter(int(threads))
                self.threads, self.owner = int(threads), who
                return self.threads
            if threads != self.threads:
                log.warning(
                    "%s asked for %d torch threads, but this process already runs torch with %d (set by %s): "
                    "torch's thread pool is per process, so %d stays; give both the same 'threads' "
                    "or run them in separate processes (instance_kind: process)",
                    who, threads, self.threads, self.owner, self.threads,
                )
            return self.threads


#: The one setting of this process.
TORCH_THREADS = ThreadSetting()


_TRANSFORMERS_IMPORTS = threading.Lock()


def from_transformers(*names: str) -> tuple[Any, ...]:
    """`from transformers import names`, one thread of the process at a time. Models loading in
    parallel threads that import transformers' lazy submodules at once meet Python's import-deadlock
    avoidance, which hands one of them a module still initializing ("cannot import name
    'LlamaConfig' from 'transformers'": about half the time with two threads, here)."""
    with _TRANSFORMERS_IMPORTS:
        import transformers

        return tuple(getattr(transformers, name) for name in names)


def set_torch_threads(threads: int, who: str) -> int:
    """Set torch's intra-op threads for this process once (see `ThreadSetting.apply`)."""
    return TORCH_THREADS.apply(threads, who)


_PAUSES: Optional[list[Callable[[int], int]]] = None
_OMP_PAUSE_SOFT = 1  # omp_pause_soft: free the team's threads, keep what can be rebuilt


def _openmp_pauses() -> list[Callable[[int], int]]:
    """`omp_pause_resource_all` of each libgomp this process has loaded (torch's own, found in
    /proc/self/maps, so none is loaded here that torch does not use); empty where there is none
    (torch built with another threading runtime, or not on Linux)."""
    global _PAUSES
    if _PAUSES is None:
        found: list[Callable[[int], int]] = []
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
        except OSError:
            paths = set()
        for path in sorted(paths):
            try:
                pause = ctypes.CDLL(path).omp_pause_resource_all  # already loaded: the same handle
            except (OSError, AttributeError):  # a libgomp before OpenMP 5.0 (GCC 9)
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            found.append(pause)
        _PAUSES = found
    return _PAUSES


def release_cpu_threads() -> None:
    """Hand back the calling thread's OpenMP team while it waits for work (see the module doc).

    Call on an instance's own thread, outside any torch call. The next parallel region there
    builds the team again (tens of microseconds, once per idle spell). Cheap when there is no
    team; a no-op where torch does not use libgomp.
    """
    for pause in _openmp_pauses():
        pause(_OMP_PAUSE_SOFT)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a CUDA out-of-memory error (the call failed; the context is fine)."""
    name = type(exc).__name__
    return name == "OutOfMemoryError" or "CUDA out of memory" in str(exc)


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """Whether `exc` is a CUDA error after which this process's CUDA context is unusable."""
    text = str(exc).lower()
    return not is_out_of_memory(exc) and any(marker in text for marker in _STICKY_MARKERS)


class CudaHealth:
    """What one CUDA instance reports about its device: faults it hit, memory, and a live probe.

    `record(exc)` is called with any exception from the instance's GPU work; `report()` is what
    the backend's `health()` merges in. The probe (`torch.cuda.mem_get_info`) neither blocks nor
    launches work, and fails once the context is poisoned, so a fault is seen even when it
    happened in code that never called `record`.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.fault: Optional[str] = None  # a sticky error: unhealthy for good
        self.out_of_memory = 0
        self.last_error: Optional[str] = None

    def record(self, exc: BaseException, during: str = "execute") -> None:
        """Note `exc` from GPU work. A sticky CUDA error, or running out of memory before the
        instance ever served (load, warmup), makes it unhealthy for good; out of memory later
        fails that call only."""
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        message = f"{type(exc).__name__} during {during}: {first_line}"
        if is_out_of_memory(exc):
            self.out_of_memory += 1
            self.last_error = message
            if during in ("load", "warmup"):  # never warmed up: not ready, with the reason
                self.fault = self.fault or f"out of GPU memory: {message}"
            try:
                import torch

                torch.cuda.empty_cache()  # hand the failed call's cached blocks back
            except Exception:
                pass
        elif is_sticky_cuda_error(exc):
            if self.fault is None:
                log.error("%s: CUDA context is unusable (%s); reporting unhealthy", self.device, message)
            self.fault = self.fault or message
            self.last_error = message

    def report(self) -> dict[str, Any]:
        """{'healthy': ..., 'reason'?: ..., 'gpu_memory_used'/'gpu_memory_total': bytes, ...}."""
        out: dict[str, Any] = {"healthy": True}
        if self.fault is None:
            try:
                import torch

                free, total = torch.cuda.mem_get_info(torch.device(self.device))
                out["gpu_memory_used"], out["gpu_memory_total"] = int(total - free), int(total)
            except Exception as exc:  # the probe itself failing means the context is gone
                self.fault = f"CUDA probe failed: {type(exc).__name__}: {str(exc).strip()[:300]}"
        if self.fault is not None:
            out["healthy"] = False
            out["reason"] = f"{self.device} is unusable for this instance (it needs a restart): {self.fault}"
        if self.out_of_memory:
            out["out_of_memory_errors"] = self.out_of_memory
        if self.last_error is not None:
            out["last_error"] = self.last_error
        return out
