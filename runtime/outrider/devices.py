"""Which GPUs this machine has, how busy and how healthy they are: placement, `device: auto` and
health read this, never torch (importing torch to count GPUs costs seconds).

Sources, first that answers wins:

1. NVML through `pynvml` (`pip install 'outrider[gpu]'`, the nvidia-ml-py package): every field,
   and errors (a lost GPU, uncorrected ECC errors).
2. Jetson (no NVML there): the device tree names the module, sysfs gives the GPU load and
   temperature, /proc/meminfo the memory it shares with the CPU; `tegrastats` output, where a
   caller has a line of it, parses with `parse_tegrastats`.
3. `nvidia-smi --query-gpu=... --format=csv,noheader,nounits`, parsed.

Indices follow CUDA's: when CUDA_VISIBLE_DEVICES hides GPUs, the visible ones are renumbered from
0 in its order, as CUDA numbers them (NVML and nvidia-smi always list every GPU). The snapshot is
cached: the first call probes; later calls return at once and refresh a stale snapshot in the
background, so a health request never waits for nvidia-smi. A machine where no source found a
GPU is not probed again (GPUs do not appear while a server runs).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable, Optional, Sequence

# The records and sources live in gpu_sources.py; callers read them here, beside the snapshot.
from .gpu_sources import (  # noqa: F401
    GPU,
    NVIDIA_SMI_COMMAND,
    NVIDIA_SMI_FIELDS,
    Inventory,
    NoSource,
    jetson_capability,
    parse_nvidia_smi,
    parse_tegrastats,
    probe,
    read_jetson,
    read_nvidia_smi,
    read_nvml,
    visible,
)

log = logging.getLogger("outrider.devices")


# -- the process-wide snapshot --------------------------------------------------------------------

#: how old a snapshot may get before a read refreshes it (in the background).
MAX_AGE_S = 5.0

_provider: Callable[[], Inventory] = probe
_snapshot: Optional[Inventory] = None
_lock = threading.Lock()
_refreshing = False


def set_provider(provider: Optional[Callable[[], Inventory]]) -> Callable[[], Inventory]:
    """Use `provider` for every later inventory (None: the real probe); returns the previous one.

    For tests, and for hosts that know their devices better (a scheduler that assigns GPUs).
    """
    global _provider, _snapshot
    with _lock:
        previous, _provider, _snapshot = _provider, provider or probe, None
    return previous


def inventory(max_age_s: float = MAX_AGE_S) -> Inventory:
    """This machine's GPUs: probed on the first call; later calls never wait (see the module doc)."""
    global _snapshot, _refreshing
    with _lock:
        snapshot, provider = _snapshot, _provider
        stale = snapshot is not None and snapshot.source != "none" and \
            time.monotonic() - snapshot.taken_at > max_age_s and not _refreshing
        if stale:
            _refreshing = True
    if snapshot is None:
        fresh = provider()
        with _lock:
            if _provider is provider:
                _snapshot = fresh
        if fresh.gpus:
            log.info("GPUs via %s: %s", fresh.source, ", ".join(f"{g.device} {g.label()}" for g in fresh.gpus))
        else:
            log.info("%s", fresh.why_none())
        return fresh
    if stale:
        threading.Thread(target=_refresh, args=(provider,), name="outrider-devices", daemon=True).start()
    return snapshot


def _refresh(provider: Callable[[], Inventory]) -> None:
    global _snapshot, _refreshing
    try:
        fresh = provider()
    except Exception:
        log.exception("refreshing the GPU inventory failed")
        fresh = None
    with _lock:
        if fresh is not None and _provider is provider:
            _snapshot = fresh
        _refreshing = False


# -- what placement and `device: auto` need ------------------------------------------------------

def place(instances: int, device: str, found: Inventory) -> list[str]:
    """The device of each instance: 'cuda' spreads them over the GPUs (i -> cuda:(i % count)),
    skipping GPUs that report an error while a healthy one is left; anything else stays put."""
    if device != "cuda":
        return [device] * instances
    usable = [g for g in found.gpus if not g.error] or list(found.gpus)
    if not usable:
        return ["cuda:0"] * instances  # the inventory saw none; CUDA may still (an explicit 'cuda')
    return [usable[i % len(usable)].device for i in range(instances)]


def explain(asked: str, chosen: str, found: Inventory, kinds: Sequence[str] = ("cpu", "cuda")) -> str:
    """Why `chosen` for a manifest that asked for `asked`: 'cuda:0 (NVIDIA H200, 140 GiB) via nvml'."""
    if asked != "auto":
        return f"{chosen}: as the manifest asks"
    if chosen.startswith("cuda"):
        gpus = [found.gpu(d) for d in dict.fromkeys(place(max(found.count, 1), "cuda", found))]
        named = ", ".join(f"{g.device} ({g.label()})" for g in gpus if g is not None)
        return f"{named or chosen} via {found.source}" if named else f"{chosen}: the backend sees a GPU the inventory does not"
    if "cuda" not in kinds:
        return f"{chosen}: the backend runs on {', '.join(kinds)} only"
    if not found.gpus:
        return f"{chosen}: {found.why_none()}"
    return f"{chosen}: the backend cannot use the GPU(s) found ({', '.join(g.name for g in found.gpus)})"


_OOM_PATTERNS = re.compile(
    r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|Failed to allocate memory|"
    r"BFCArena.*(?:Failed|Available memory)|OutOfMemory|Requested amount of GPU memory",
    re.IGNORECASE)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a device running out of memory, as torch, ONNX Runtime and TensorRT say it."""
    return type(exc).__name__ in ("OutOfMemoryError", "MemoryError") or bool(_OOM_PATTERNS.search(str(exc)))


def out_of_memory_reason(device: str, exc: BaseException, found: Optional[Inventory] = None) -> str:
    """'out of GPU memory on cuda:0 (NVIDIA H200: 139000/143771 MiB in use): <error>'."""
    gpu = found.gpu(device) if found is not None else None
    where = device if device.startswith("cuda") else f"{device} (host memory)"
    use = ""
    if gpu is not None and gpu.memory_total_mib is not None:
        use = f" ({gpu.name}: {gpu.memory_used_mib}/{gpu.memory_total_mib} MiB in use)"
    kind = "GPU memory" if device.startswith("cuda") else "memory"
    return f"out of {kind} on {where}{use}: {type(exc).__name__}: {exc}"
