"""What a Ray Serve replica knows of the process and node it runs in: its identity
(`replica_info`), and the replica directories (a socket each) that killed replicas left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray import serve


def replica_info(address: str) -> dict[str, Any]:
    """Who this replica is: Serve's replica id, the actor's name and id, its node, the pid, the socket."""
    info: dict[str, Any] = {"pid": os.getpid(), "address": address}
    try:
        context = serve.get_replica_context()
        info.update(replica_id=context.replica_id.unique_id, replica=str(context.replica_id),
                    deployment=context.deployment, app=context.app_name)
    except Exception:  # noqa: BLE001 - constructed outside a Serve replica (tests, notebooks)
        info.update(replica_id=f"local-{os.getpid()}")
    if ray.is_initialized():  # (asking the runtime context otherwise would start a local Ray)
        runtime = ray.get_runtime_context()
        info.update(actor_name=runtime.get_actor_name(), actor_id=runtime.get_actor_id(),
                    node_id=runtime.get_node_id())
    return info


def sweep_dead_replica_dirs() -> None:
    """Remove this user's replica directories (`outrider-ray-PID-*`, a socket each) whose process is
    gone: a replica that exits cleanly removes its own, one killed (ray.kill, the OOM killer) cannot."""
    for path in Path(tempfile.gettempdir()).glob("outrider-ray-*-*"):
        pid = path.name.split("-")[2]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive under another user (EPERM), or gone meanwhile
            continue
