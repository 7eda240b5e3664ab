"""Where a server's start goes: phases marked from process start to ready, logged once at debug
level (`outrider serve -v`, or OUTRIDER_LOG_LEVEL=DEBUG) and read by `tools/bench.py coldstart`.

Times are seconds since the process started (the kernel's start time of this process, so the
interpreter's own start and the imports before `main` are counted too).
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("outrider.startup")

_LOCK = threading.Lock()
_MARKS: list[tuple[str, float]] = []
_REPORTED = False


def _process_start() -> float:
    """time.monotonic() at which this process started (the kernel's record of it), else now."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
        # CLOCK_BOOTTIME (uptime) runs on in suspend, CLOCK_MONOTONIC does not; a process this
        # young has not been suspended, so its age is the same on both.
        return time.monotonic() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.monotonic()


PROCESS_START = _process_start()


def mark(phase: str) -> None:
    """Record that `phase` ended now (the first time only: a reload does not move a start phase)."""
    with _LOCK:
        if not _REPORTED and all(name != phase for name, _ in _MARKS):
            _MARKS.append((phase, time.monotonic()))


def phases() -> list[tuple[str, float]]:
    """(phase, seconds since process start at its end), in the order marked."""
    with _LOCK:
        return [(name, at - PROCESS_START) for name, at in _MARKS]


def report(what: str = "ready") -> None:
    """Log the phases once (debug level), as `start phases: a 0.123; b 0.456; ... ready 0.789`."""
    global _REPORTED
    mark(what)
    with _LOCK:
        if _REPORTED:
            return
        _REPORTED = True
        marks = list(_MARKS)
    log.debug("start phases (s since process start): %s",
              "; ".join(f"{name} {at - PROCESS_START:.3f}" for name, at in marks))
