"""How many physical CPU cores this process may use: the default for ORT's intra-op threads.

Hyper-threads share one core's vector units, so a GEMM-bound model gains little from them
and loses to contention; containers also cap CPU time with a cgroup quota.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


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


def _cgroup_cpu_quota() -> int | None:
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(1, math.ceil(int(limit) / int(period)))
