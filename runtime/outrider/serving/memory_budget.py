"""The memory budget's numbers: sizes as people write them (`--memory-budget 2GiB`), and each model's
resident cost measured at its last load, kept in the artifact cache (`load-costs.json`) so the
next start estimates from a measurement instead of the model's file size."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from typing import Optional

from ..artifacts import cache_root
from ..hardware import release_memory, resident_bytes
from .entries import ModelEntry, artifact_bytes, artifact_stamp, model_path

log = logging.getLogger("outrider.repository")

#: the file, in the artifact cache, with each model's resident cost measured at its last load
LOAD_COSTS_FILE = "load-costs.json"


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '800M', '1000000': a size in bytes (binary units for K/M/G/T
    with or without 'i', as memory is counted); raises ValueError naming the expected forms."""
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}
    stripped = text.strip().upper().replace(" ", "")
    number = stripped.rstrip("KMGTIB")
    unit = stripped[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not (value > 0) or value == float("inf"):
        raise ValueError(f"{text!r} is not a size: expected a positive number with an optional unit, "
                         f"e.g. 2GiB, 512MiB, 1.5G")
    return int(value * units[unit])


def cost_key(entry: ModelEntry) -> str:
    manifest = entry.manifest
    assert manifest is not None
    where = str(model_path(manifest) or "")
    return f"{entry.name}:{hashlib.blake2b((where + artifact_stamp(manifest) + manifest.model_dump_json()).encode(), digest_size=8).hexdigest()}"


_COSTS_LOCK = threading.RLock()


def read_load_costs() -> dict[str, dict[str, int]]:
    """{cost key: {"first" | "warm": bytes}}; a file from an older version (one number per model)
    reads as a first load's cost, which errs high."""
    try:
        data = json.loads((cache_root() / LOAD_COSTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    costs: dict[str, dict[str, int]] = {}
    for key, value in data.items():
        if isinstance(value, (int, float)):
            costs[key] = {"first": int(value)}
        elif isinstance(value, dict):
            costs[key] = {k: int(v) for k, v in value.items() if k in ("first", "warm") and isinstance(v, (int, float))}
    return costs


def store_load_costs(costs: dict[str, dict[str, int]]) -> None:
    root = cache_root()
    with _COSTS_LOCK:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".{LOAD_COSTS_FILE}.{os.getpid()}"
            tmp.write_text(json.dumps(dict(list(costs.items())[-512:]), indent=1))
            os.replace(tmp, root / LOAD_COSTS_FILE)
        except OSError as exc:  # a read-only cache: the next estimate comes from the file size
            log.debug("load costs not stored: %s", exc)


def record_load_cost(key: str, kind: str, grown: int) -> None:
    """Store a load's measured resident cost (`kind`: "first" or "warm") under its cost key."""
    with _COSTS_LOCK:  # read, change and write as one: two loads may finish together
        costs = read_load_costs()
        costs[key] = {**costs.get(key, {}), kind: grown}
        store_load_costs(costs)


def estimate_cost(entry: ModelEntry, warm: bool) -> Optional[tuple[int, str]]:
    """(bytes, how it was found): the resident cost of loading `entry`, from its last measured
    load of the same warmth (`warm`: its backend has loaded a model in this process before; a
    backend's first load in a process also pays for its libraries), else of the other, else from
    the size of its model file or directory; None when neither is known. Memoized on the entry."""
    manifest = entry.manifest
    if manifest is None:
        return None
    memo_key = f"{entry.fingerprint}:{warm}"
    memo = entry.estimate_memo
    if memo is not None and memo[0] == memo_key:
        return memo[1]
    estimate: Optional[tuple[int, str]] = None
    measured = read_load_costs().get(cost_key(entry), {})
    same, other = ("warm", "first") if warm else ("first", "warm")
    if measured.get(same):
        estimate = measured[same], f"measured at its last {same} load"
    elif measured.get(other):
        estimate = measured[other], f"measured at its last {other} load"
    else:
        size = artifact_bytes(manifest)
        if size:
            estimate = size, f"the size of its model files ({mib(size)})"
    entry.estimate_memo = (memo_key, estimate)
    return estimate


def record_measured_cost(entry: ModelEntry) -> None:
    """Store what the load just measured (RSS growth from its start to ready, once the load's
    freed scratch is handed back: what the model keeps), as a first or a warm load of its
    backend, for the next budget decision; concurrent loads each see the other's growth, so it
    errs high."""
    release_memory()  # a build leaves freed scratch (graph optimisation, packing) that glibc keeps
    grown = resident_bytes() - entry.rss_before_load
    if grown <= 0:
        return
    kind = "warm" if entry.warm_load else "first"
    record_load_cost(cost_key(entry), kind, grown)
    entry.estimate_memo = None
    log.debug("model %s: resident cost of a %s load measured at %s", entry.name, kind, mib(grown))


def mib(n: float) -> str:
    """Bytes as whole MiB, for messages."""
    return f"{n / (1 << 20):.0f} MiB"


class MemoryBudget:
    """The budget a repository loads under (`limit` bytes; None: no budget), each load's estimated
    cost, and which backends are warm in this process."""

    def __init__(self, limit: Optional[int]) -> None:
        self.limit = limit
        #: backends that have loaded a model in this process: a first load of a backend also pays
        #: for its libraries, which stay after an unload, so its costs are kept apart (`estimate`)
        self.warm_backends: set[str] = set()

    def backend_is_warm(self, entry: ModelEntry) -> bool:
        """Whether the backend `entry` loads on has loaded a model in this process: the backend that
        serves it, else (not built yet) its manifest's first candidate."""
        if entry.served is not None:
            name = entry.served.choice.backend.name
        elif entry.manifest is not None:
            backend = entry.manifest.backend
            name = backend if isinstance(backend, str) else next(iter(backend), "")
        else:
            return False
        return name in self.warm_backends

    def estimate(self, entry: ModelEntry) -> Optional[tuple[int, str]]:
        """The resident cost of loading `entry` (`estimate_cost`), for its backend's warmth."""
        return estimate_cost(entry, self.backend_is_warm(entry))

    def measure(self, entry: ModelEntry) -> None:
        """Once a load is ready: its backend is warm from now on and, under a budget (only a budget
        reads it; a plain start writes nothing), what the load cost is stored (`record_measured_cost`)."""
        with entry.lock:
            served = entry.served
            if entry.measured or served is None or not served.ready:
                return
            entry.measured = True
        self.warm_backends.add(served.choice.backend.name)
        if self.limit is not None:
            record_measured_cost(entry)
