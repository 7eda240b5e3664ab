#!/usr/bin/env python3
"""Benchmarks that compare side by side, in one run, and print a table.

  python tools/bench.py overhead    echo model vs a raw pyzmq DEALER<->ROUTER echo (same payload)
  python tools/bench.py coldstart   process start -> ready, for a manifest (cached artifacts)
  python tools/bench.py all         both

Absolute numbers differ between machines; read the ratios.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RAW_ECHO = r"""
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    frames = s.recv_multipart(copy=False)
    s.send_multipart(frames, copy=False)
"""


def _percentiles(samples: list[float]) -> tuple[float, float, float]:
    a = np.array(samples) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.mean())


def _raw_round_trips(address: str, n: int, payload: np.ndarray) -> list[float]:
    import msgpack
    import zmq

    proc = subprocess.Popen([sys.executable, "-c", RAW_ECHO, address], stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        header = {"id": 0, "model": "echo", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 384]}]}
        times = []
        for i in range(n + 200):
            header["id"] = i
            t0 = time.perf_counter()
            sock.send_multipart([b"outrider/1 infer", msgpack.packb(header), memoryview(payload)], copy=False)
            frames = sock.recv_multipart(copy=False)
            msgpack.unpackb(frames[1].buffer)
            np.frombuffer(frames[2].buffer, np.float32)
            if i >= 200:  # warm-up excluded
                times.append(time.perf_counter() - t0)
        sock.close(0)
        return times
    finally:
        proc.kill()
        proc.wait()


def _start_server(manifests: list[str], address: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "outrider.cli", "serve", *manifests, "--bind", address],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT,
    )


def _wait_ready(address: str, timeout: float = 120.0) -> float:
    from outrider import Client, OutriderError

    end = time.monotonic() + timeout
    with Client(address, timeout=0.5) as client:
        while time.monotonic() < end:
            try:
                if client.health(timeout=0.5)["ready"]:
                    return time.monotonic()
            except OutriderError:
                pass
            time.sleep(0.005)
    raise RuntimeError(f"server on {address} not ready within {timeout}s")


def _outrider_round_trips(address: str, n: int, payload: np.ndarray) -> list[float]:
    from outrider import Client

    proc = _start_server([str(ROOT / "manifests/echo.yaml")], address, {"OUTRIDER_PLUGINS": "echo"})
    try:
        _wait_ready(address)
        times = []
        with Client(address, timeout=10) as client:
            for i in range(n + 200):
                t0 = time.perf_counter()
                out = client.infer("echo", {"x": payload})
                if i >= 200:
                    times.append(time.perf_counter() - t0)
            assert out["x"].shape == (1, 384)
        return times
    finally:
        proc.terminate()
        proc.wait(10)


def bench_overhead(n: int) -> None:
    payload = np.random.default_rng(0).standard_normal((1, 384)).astype(np.float32)
    tmp = tempfile.mkdtemp(prefix="outrider-bench-")
    rows = []
    for transport, raw_addr, our_addr in (
        ("tcp", "tcp://127.0.0.1:57411", "tcp://127.0.0.1:57412"),
        ("ipc", f"ipc://{tmp}/raw.sock", f"ipc://{tmp}/outrider.sock"),
    ):
        raw = _percentiles(_raw_round_trips(raw_addr, n, payload))
        ours = _percentiles(_outrider_round_trips(our_addr, n, payload))
        rows.append((transport, raw, ours))
    print(f"\nround trip, 1x384 FP32, {n} requests, one client (microseconds)")
    print(f"{'transport':<10}{'raw p50':>10}{'raw p99':>10}{'echo p50':>10}{'echo p99':>10}{'p50 ratio':>11}{'p99 ratio':>11}")
    for transport, raw, ours in rows:
        print(f"{transport:<10}{raw[0]:>10.0f}{raw[1]:>10.0f}{ours[0]:>10.0f}{ours[1]:>10.0f}"
              f"{ours[0] / raw[0]:>10.2f}x{ours[1] / raw[1]:>10.2f}x")


def bench_coldstart(manifest: str, runs: int) -> None:
    tmp = tempfile.mkdtemp(prefix="outrider-bench-")
    address = f"ipc://{tmp}/cold.sock"
    # First start fills the artifact cache (ONNX export); not counted.
    proc = _start_server([manifest], address)
    t_first0 = time.monotonic()
    _wait_ready(address, timeout=600)
    first = time.monotonic() - t_first0
    proc.terminate()
    proc.wait(30)
    times = []
    for _ in range(runs):
        t0 = time.monotonic()
        proc = _start_server([manifest], address)
        ready = _wait_ready(address)
        times.append(ready - t0)
        proc.terminate()
        proc.wait(30)
    echo = []
    for _ in range(runs):
        t0 = time.monotonic()
        proc = _start_server([str(ROOT / "manifests/echo.yaml")], address, {"OUTRIDER_PLUGINS": "echo"})
        echo.append(_wait_ready(address) - t0)
        proc.terminate()
        proc.wait(30)
    print(f"\ncold start: process start -> health ready ({runs} runs, seconds)")
    print(f"{'manifest':<28}{'median':>8}{'min':>8}{'max':>8}")
    print(f"{Path(manifest).name + ' (first, fills cache)':<28}{first:>8.2f}{first:>8.2f}{first:>8.2f}")
    print(f"{Path(manifest).name + ' (cached)':<28}{np.median(times):>8.2f}{min(times):>8.2f}{max(times):>8.2f}")
    print(f"{'echo.yaml (no framework)':<28}{np.median(echo):>8.2f}{min(echo):>8.2f}{max(echo):>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["overhead", "coldstart", "all"])
    parser.add_argument("-n", type=int, default=3000, help="round trips per row")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--manifest", default=str(ROOT / "manifests/minilm.yaml"))
    args = parser.parse_args()
    if args.what in ("overhead", "all"):
        bench_overhead(args.n)
    if args.what in ("coldstart", "all"):
        bench_coldstart(args.manifest, args.runs)


if __name__ == "__main__":
    main()
