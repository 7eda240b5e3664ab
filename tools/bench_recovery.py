#!/usr/bin/env python3
"""How fast a killed worker process is noticed and replaced.

  python tools/bench_recovery.py [--kills 7] [--manifest manifests/echo.yaml]

Serves the manifest with `scheduling.instance_kind=process`, then, a few times over: SIGKILLs the
idle worker (what the OOM killer does) and measures, from the kill,
  detect   until `health` says the model is not ready (no request is sent meanwhile),
  ready    until `health` says ready again (the replacement is loaded and warmed up),
  serve    until an infer succeeds again (a request every 5 ms from the moment of the kill;
           until then each is answered at once, `unavailable`),
and prints the p50 (and min / max) of each. Health is polled every 2 ms, which bounds the
resolution; the supervisor looks every 50 ms.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))


def _start(manifest: str, address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "outrider.cli", "serve", manifest, "--bind", address,
         "--set", "scheduling.instance_kind=process"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
    )


def _model(client, name: str) -> dict:
    return client.health(timeout=5)["models"][name]


def _wait(predicate, timeout: float, poll: float = 0.002) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic()
        time.sleep(poll)
    raise SystemExit(f"timed out after {timeout}s")


def _worker_pid(client, name: str) -> int:
    for inst in _model(client, name)["instances"]:
        pid = (inst.get("backend") or {}).get("worker_pid")
        if pid and inst.get("serving", inst["state"] == "ready"):
            return pid
    raise SystemExit(f"model {name} has no serving worker process")


def main() -> None:
    from outrider import Client, OutriderError
    from outrider.manifest import load_manifest

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default=str(ROOT / "manifests" / "echo.yaml"))
    parser.add_argument("--kills", type=int, default=7, help="kills per measure (default 7)")
    args = parser.parse_args()
    name = load_manifest(args.manifest).name
    inputs = {"x": np.ones(4, np.float32)}

    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/bench-recovery.sock"
        server = _start(args.manifest, address)
        try:
            with Client(address, timeout=5) as client:
                _wait(lambda: _ready(client), 120, poll=0.05)
                client.infer(name, inputs)
                detect, ready, serve, unavailable = [], [], [], []
                for _ in range(args.kills):
                    # Quiet kills: detection and ready-again without any request to notice it.
                    pid = _worker_pid(client, name)
                    os.kill(pid, signal.SIGKILL)
                    killed = time.monotonic()
                    detect.append(_wait(lambda: not _model(client, name)["ready"], 10) - killed)
                    ready.append(_wait(lambda: _model(client, name)["ready"], 60) - killed)
                    client.infer(name, inputs)
                for _ in range(args.kills):
                    # Busy kills: requests back to back from the moment of the kill.
                    pid = _worker_pid(client, name)
                    os.kill(pid, signal.SIGKILL)
                    killed = time.monotonic()
                    refused = 0
                    while True:
                        try:
                            client.infer(name, inputs)
                            break
                        except OutriderError as exc:
                            if exc.code not in ("unavailable", "execution_error"):
                                raise
                            refused += 1
                            time.sleep(0.005)  # a client retrying at once would only take CPU from the replacement
                            if time.monotonic() - killed > 60:
                                raise SystemExit("no successful request within 60 s of a kill") from None
                    serve.append(time.monotonic() - killed)
                    unavailable.append(refused)
                    _wait(lambda: _model(client, name)["state"] == "ready", 60, poll=0.01)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

    print(f"{name} ({args.manifest}), instance_kind=process, {args.kills} kills each, seconds from SIGKILL:")
    print(f"  {'':34} {'p50':>8} {'min':>8} {'max':>8}")
    for label, values in (("detect (health not ready)", detect),
                          ("ready again (health)", ready),
                          ("serving again (first infer ok)", serve)):
        v = np.array(values)
        print(f"  {label:34} {np.median(v):8.3f} {v.min():8.3f} {v.max():8.3f}")
    print(f"  requests answered `unavailable`/error before the first success: p50 {int(np.median(unavailable))}, "
          f"max {max(unavailable)} (each answered at once)")


def _ready(client) -> bool:
    from outrider import OutriderError

    try:
        return bool(client.health(timeout=1)["ready"])
    except OutriderError:
        return False


if __name__ == "__main__":
    main()
