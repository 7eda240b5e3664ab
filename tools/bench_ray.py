#!/usr/bin/env python3
"""Echo requests/s through Ray Serve (handle calls, HTTP ingress) against Outrider's own ZeroMQ
socket and HTTP front, in one run, interleaved. Needs `outrider[ray]` (and httpx, in `dev`).

  python tools/bench_ray.py                           1 replica, 1 and 16 requests in flight
  python tools/bench_ray.py --replicas 2 --concurrency 1,4,16 --seconds 5 --rounds 3

One `outrider serve manifests/echo.yaml --http ...` process is the direct path: `AsyncClient`
over ipc:// (ZeroMQ) and OIP v2 JSON over HTTP (httpx, keep-alive). A local Ray cluster
(`ray.init(num_cpus=2)`, no dashboard) runs the echo manifest as outrider_http.ray_serve
replicas: `await handle.infer.remote(...)` from this process, and the same OIP v2 JSON through
Serve's HTTP proxy. Every path carries the same FP32 [1, 384] tensor with closed-loop clients
(N requests always in flight, asyncio in this one process), for `--seconds` per path and
concurrency, in `--rounds` rounds whose order rotates; the table shows each path's median round.

The client runs on the same cores as the servers (and Ray's own processes), so these are costs
per request on this machine, not capacity figures; read the ratios against ZeroMQ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = np.linspace(0, 1, 384, dtype=np.float32).reshape(1, 384)


def free_port() -> int:
    from outrider.harness import free_port as find

    return find()


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"


async def closed_loop(call: Callable[[], Awaitable[None]], clients: int, seconds: float,
                      warmup: float = 0.5) -> tuple[float, list[float]]:
    """(requests/s, latencies in s) with `clients` requests always in flight for `seconds`."""
    latencies: list[float] = []
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds

    async def worker() -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= end:
                return
            await call()
            t1 = time.perf_counter()
            if t0 >= measure_from:
                latencies.append(t1 - t0)

    await asyncio.gather(*(worker() for _ in range(clients)))
    return len(latencies) / seconds, latencies


def oip_body() -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 384],
                                   "data": PAYLOAD.ravel().tolist()}]}).encode()


def start_direct(tmp: str, http_port: int) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{tmp}/bench-ray.sock"
    env = {**os.environ, "OUTRIDER_PLUGINS": "none"}
    proc = subprocess.Popen([sys.executable, "-m", "outrider.cli", "serve", str(ROOT / "manifests/echo.yaml"),
                             "--plugin", "outrider_echo", "--plugin", "outrider_http", "--bind", address, "--http", f"127.0.0.1:{http_port}"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from outrider import Client, OutriderError

    with Client(address, timeout=1.0) as client:
        try:
            client.wait_ready(120, interval=0.05, process=proc)
        except OutriderError as exc:
            proc.kill()
            raise SystemExit(f"outrider serve: {exc.message}") from None
    return proc, address


def start_ray(replicas: int, http_port: int, cpus_per_replica: float):
    import ray
    from ray import serve

    from outrider_http import ray_serve as outrider_ray

    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024 * 1024, log_to_driver=False,
             runtime_env={"env_vars": {"OUTRIDER_PLUGINS": "none"}})
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    app = outrider_ray.deployment([ROOT / "manifests/echo.yaml"], ["outrider_echo"], num_replicas=replicas,
                                  ray_actor_options={"num_cpus": cpus_per_replica})
    handle = serve.run(app, name="bench", route_prefix="/bench")
    return handle, time.monotonic() - t0


def stop_ray() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


async def run(args: argparse.Namespace) -> None:
    import httpx

    from outrider import AsyncClient

    levels = [int(c) for c in args.concurrency.split(",")]
    direct_http, ray_http = free_port(), free_port()
    print(f"loadavg at start: {loadavg()}  ({os.cpu_count()} CPUs)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        proc, address = start_direct(tmp, direct_http)
        handle = None
        try:
            handle, ray_start = start_ray(args.replicas, ray_http, args.cpus_per_replica)
            print(f"Ray cluster + Serve + {args.replicas} replica(s) ready in {ray_start:.1f} s", flush=True)
            zmq = AsyncClient(address, timeout=60)
            body = oip_body()
            headers = {"content-type": "application/json"}
            limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
            async with httpx.AsyncClient(timeout=60, limits=limits) as http:

                async def via_zmq() -> None:
                    out = await zmq.infer("echo", {"x": PAYLOAD})
                    assert out["x"].shape == (1, 384)

                async def via_handle() -> None:
                    out = await handle.infer.remote("echo", {"x": PAYLOAD})
                    assert out["x"].shape == (1, 384)

                def via_http(url: str) -> Callable[[], Awaitable[None]]:
                    async def call() -> None:
                        reply = await http.post(url, content=body, headers=headers)
                        assert reply.status_code == 200, reply.text

                    return call

                paths = {
                    "Outrider ZeroMQ (AsyncClient, ipc)": via_zmq,
                    "Outrider HTTP front (OIP v2 JSON)": via_http(f"http://127.0.0.1:{direct_http}/v2/models/echo/infer"),
                    f"Ray Serve handle ({args.replicas} replica{'s' if args.replicas > 1 else ''})": via_handle,
                    f"Ray Serve HTTP ingress ({args.replicas} replica{'s' if args.replicas > 1 else ''}, OIP v2 JSON)":
                        via_http(f"http://127.0.0.1:{ray_http}/bench/v2/models/echo/infer"),
                }
                for call in paths.values():  # warm every path (connections, routers, replica lookups)
                    for _ in range(20):
                        await call()
                results: dict[tuple[str, int], list[tuple[float, list[float]]]] = {}
                names = list(paths)
                for r in range(args.rounds):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for clients in levels:
                        for name in order:
                            results.setdefault((name, clients), []).append(
                                await closed_loop(paths[name], clients, args.seconds))
                    print(f"round {r + 1}/{args.rounds} done, loadavg {loadavg()}", flush=True)
            await zmq.close()
        finally:
            if handle is not None:
                stop_ray()
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    print(f"\necho, FP32 [1, 384], closed loop, {args.seconds:g} s x {args.rounds} rounds (median round), "
          f"client in this process")
    print(f"{'path':<58} {'in flight':>9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'vs ZeroMQ':>10}")
    for clients in levels:
        base = None
        for name in names:
            rounds = sorted(results[(name, clients)], key=lambda x: x[0])
            rate, lat = rounds[len(rounds) // 2]
            lat_ms = np.array(lat) * 1000 if lat else np.array([float("nan")])
            if base is None:
                base = rate
            print(f"{name:<58} {clients:>9} {rate:>8.0f} {np.percentile(lat_ms, 50):>8.2f} "
                  f"{np.percentile(lat_ms, 99):>8.2f} {rate / base:>9.2f}x")
    print(f"\nloadavg at end: {loadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per path, level and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16", help="requests in flight, comma-separated")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--cpus-per-replica", type=float, default=0.5,
                        help="Ray resources per replica (the cluster has 2 CPUs)")
    args = parser.parse_args()
    os.environ.setdefault("OUTRIDER_PLUGINS", "none")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
