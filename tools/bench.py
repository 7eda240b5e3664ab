#!/usr/bin/env python3
"""Benchmarks that compare side by side, in one run, and print a table.

  python tools/bench.py overhead    echo model vs a raw pyzmq DEALER<->ROUTER echo (same payload)
  python tools/bench.py coldstart   process start -> ready for echo, minilm, minilm-int8 and smollm2-int8
                                    (or each --manifest), median of --runs, with the phase breakdown;
                                    --http HOST:PORT waits for HTTP GET /v2/health/ready instead
  python tools/bench.py batching    minilm with dynamic batching vs without, and ORT offline;
                                    --clients 1,2,4,8,16,32 sets the curve, --plot [DIR] draws it
                                    (DIR/batching.png, default docs/; needs matplotlib: outrider[bench])
  python tools/bench.py quantize    float vs quantized MiniLM and SmolLM2, with and without
                                    speculation, and llama.cpp when installed (tools/bench_quantize.py)
  python tools/bench.py bulk        one infer of 1,024 and 256 mixed-length sentences through a server,
                                    the engine alone and sentence-transformers (tools/bench_bulk.py)
  python tools/bench.py all         all of them

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import offline_backend as _offline_backend  # noqa: E402
from bench_common import start_server as _start_server  # noqa: E402
from bench_common import wait_ready as _wait_ready  # noqa: E402

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


class _RawEcho:
    """A raw pyzmq ROUTER that sends every message straight back: the floor to compare against."""

    def __init__(self, address: str) -> None:
        import msgpack
        import zmq

        self.proc = subprocess.Popen([sys.executable, "-c", RAW_ECHO, address], stdout=subprocess.PIPE, text=True)
        self.proc.stdout.readline()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(address)
        self.header = {"id": 0, "model": "echo", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 384]}]}
        self._msgpack = msgpack

    def round_trip(self, payload: np.ndarray) -> None:
        self.header["id"] += 1
        self.sock.send_multipart([b"outrider/1 infer", self._msgpack.packb(self.header), memoryview(payload)], copy=False)
        frames = self.sock.recv_multipart(copy=False)
        self._msgpack.unpackb(frames[1].buffer)
        np.frombuffer(frames[2].buffer, np.float32)

    def close(self) -> None:
        self.sock.close(0)
        self.proc.kill()
        self.proc.wait()


def _wait_http_ready(http: str, timeout: float = 120.0) -> float:
    """Poll GET http://HOST:PORT/v2/health/ready until it answers 200 (what a Knative or KServe
    readiness probe asks); the moment it did."""
    import urllib.error
    import urllib.request

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=0.5) as reply:
                if reply.status == 200:
                    return time.monotonic()
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.005)
    raise RuntimeError(f"http://{http}/v2/health/ready not 200 within {timeout}s")


def _interleaved(raw_addr: str, our_addr: str, n: int, payload: np.ndarray) -> tuple[list[float], list[float]]:
    """Alternate blocks of raw and Outrider round trips, so drift in machine speed hits both alike."""
    from outrider import Client

    raw = _RawEcho(raw_addr)
    proc = _start_server([str(ROOT / "manifests/echo.yaml")], our_addr, {"OUTRIDER_PLUGINS": "echo"})
    try:
        _wait_ready(our_addr)
        with Client(our_addr, timeout=10) as client:
            for _ in range(300):  # warm both paths
                raw.round_trip(payload)
                client.infer("echo", {"x": payload})
            raw_times, our_times = [], []
            block = 250
            for _ in range(max(1, n // block)):
                for _ in range(block):
                    t0 = time.perf_counter()
                    raw.round_trip(payload)
                    raw_times.append(time.perf_counter() - t0)
                for _ in range(block):
                    t0 = time.perf_counter()
                    out = client.infer("echo", {"x": payload})
                    our_times.append(time.perf_counter() - t0)
            assert out["x"].shape == (1, 384)
        return raw_times, our_times
    finally:
        raw.close()
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
        raw_times, our_times = _interleaved(raw_addr, our_addr, n, payload)
        rows.append((transport, _percentiles(raw_times), _percentiles(our_times)))
    print(f"\nround trip, 1x384 FP32, {n} requests each, one client, interleaved blocks (microseconds)")
    print(f"{'transport':<10}{'raw p50':>10}{'raw p99':>10}{'echo p50':>10}{'echo p99':>10}{'p50 ratio':>11}{'p99 ratio':>11}")
    for transport, raw, ours in rows:
        print(f"{transport:<10}{raw[0]:>10.0f}{raw[1]:>10.0f}{ours[0]:>10.0f}{ours[1]:>10.0f}"
              f"{ours[0] / raw[0]:>10.2f}x{ours[1] / raw[1]:>10.2f}x")


COLDSTART_MANIFESTS = ("echo", "minilm", "minilm-int8", "smollm2-int8")
MINILM = str(ROOT / "manifests/minilm.yaml")


def _phases(log: str) -> dict[str, float]:
    """The server's `start phases` debug line (outrider.timeline) as {phase: s since process start}."""
    for line in log.splitlines():
        if "start phases (s since process start): " in line:
            out = {}
            for part in line.split("start phases (s since process start): ", 1)[1].split("; "):
                name, _, at = part.rpartition(" ")
                out[name] = float(at)
            return out
    return {}


def _one_start(manifest: str, address: str, args: list[str], http: str | None, timeout: float = 600) -> tuple[float, dict]:
    t0 = time.monotonic()
    proc = _start_server([manifest], address, {"OUTRIDER_LOG_LEVEL": "DEBUG"}, args=args)
    try:
        seen = (_wait_http_ready(http, timeout) if http else _wait_ready(address, timeout)) - t0
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    return seen, _phases(err.decode(errors="replace"))


def bench_coldstart(manifests: list[str], runs: int, http: str | None = None) -> None:
    """Process start to ready (ZeroMQ `health` ready, or with `http` GET /v2/health/ready 200),
    median of `runs` starts from a warm artifact cache, with the server's own phase breakdown."""
    tmp = tempfile.mkdtemp(prefix="outrider-bench-")
    address = f"ipc://{tmp}/cold.sock"
    args = ["--http", http] if http else []
    what = f"GET http://{http}/v2/health/ready 200" if http else "health ready"
    rows = []
    for manifest in manifests:
        first, _ = _one_start(manifest, address, args, http)  # fills the artifact cache; not counted
        starts = [_one_start(manifest, address, args, http) for _ in range(runs)]
        seen = [s for s, _ in starts]
        names = [n for n in starts[0][1]]
        median_at = {n: float(np.median([p.get(n, np.nan) for _, p in starts])) for n in names}
        rows.append((Path(manifest).stem, first, seen, median_at))
    print(f"\ncold start: process start -> {what}, warm artifact cache, {runs} starts each (seconds)")
    print("| manifest | first start | median | min | max |")
    print("|---|---|---|---|---|")
    for name, first, seen, _ in rows:
        print(f"| {name} | {first:.3f} | {np.median(seen):.3f} | {min(seen):.3f} | {max(seen):.3f} |")
    print("\nwhere it goes (median of the server's own marks; each phase ends at the time shown, "
          "the number in brackets is its length):")
    for name, _, _, at in rows:
        previous, parts = 0.0, []
        for phase, t in at.items():
            parts.append(f"{phase} {t:.3f} [{t - previous:.3f}]")
            previous = t
        print(f"- {name}: " + "; ".join(parts))
    floors = {label: float(np.median([_import_seconds(modules) for _ in range(runs)]))
              for label, modules in IMPORT_FLOORS.items()}
    print("\nthe floor under those starts: a Python process that only imports a server's third-party "
          f"dependencies and exits (median of {runs}, seconds)")
    for label, seconds in floors.items():
        print(f"- {label} ({', '.join(IMPORT_FLOORS[label])}): {seconds:.3f}")


#: what a server's process imports besides outrider, by what it serves
IMPORT_FLOORS = {
    "any server": ("numpy", "zmq", "msgpack", "pydantic", "yaml", "pluggy"),
    "an ONNX Runtime text model": ("numpy", "zmq", "msgpack", "pydantic", "yaml", "pluggy", "onnxruntime",
                                   "tokenizers"),
}


def _import_seconds(modules: tuple[str, ...]) -> float:
    """Wall seconds of `python -c "import ..."`: interpreter start, site, those imports, exit."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import " + ", ".join(modules)], check=True)
    return time.perf_counter() - start


SHORT_SENTENCE = "A man is eating food in the park."


def _closed_loop(address: str, model: str, clients: int, seconds: float, warmup: float) -> list[float]:
    """`clients` requests kept in flight on one DEALER socket; each reply sends that client's next.

    The load generator shares the server's cores, so it must be cheap: each client's request
    is encoded once, in outrider.Client's wire format, and sent again as soon as it is answered
    (about 15 us of CPU a request here, against about 60 us through AsyncClient).
    """
    import msgpack
    import zmq

    from outrider.protocol import encode_message

    text = {"text": np.array([SHORT_SENTENCE.encode()], dtype=object)}
    frames = [encode_message("infer", {"id": i, "model": model, "parameters": {}}, text) for i in range(clients)]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    latencies: list[float] = []
    start = time.perf_counter()
    measure_from, stop_at = start + warmup, start + warmup + seconds
    sent_at = [start] * clients
    for i in range(clients):
        sock.send_multipart(frames[i], copy=False)
    try:
        for _ in range(10**9):
            if not sock.poll(60_000):
                raise RuntimeError(f"no reply from {address} within 60 s")
            header = msgpack.unpackb(sock.recv_multipart(copy=False)[1].buffer)
            if not header.get("ok"):
                raise RuntimeError(f"request failed: {header.get('error')}")
            i, now = header["id"], time.perf_counter()
            if sent_at[i] >= measure_from:
                latencies.append(now - sent_at[i])
            if now < stop_at:
                sent_at[i] = now
                sock.send_multipart(frames[i], copy=False)
            else:
                clients -= 1
                if not clients:
                    break
    finally:
        sock.close()
    return latencies


def _row(label: str, sentences: int, seconds: float, latencies: list[float]) -> dict:
    lat = np.array(latencies) * 1e3 if latencies else np.zeros(1)
    return {"label": label, "throughput": sentences / seconds, "p50": float(np.percentile(lat, 50)),
            "p99": float(np.percentile(lat, 99))}


class _OtherLoad:
    """Share of the machine's CPU that processes other than this benchmark's used during a row.

    Shared machines have neighbours; a row they disturbed should be read (or rerun) as such.
    """

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self.share: float | None = None

    def _sample(self) -> tuple[int, int, int] | None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:]]
            ours = sum(os.times()[:2]) * os.sysconf("SC_CLK_TCK")
            if self.server_pid is not None:
                with open(f"/proc/{self.server_pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ours += int(fields[11]) + int(fields[12])
        except (OSError, ValueError):
            return None
        return sum(ticks), sum(ticks) - ticks[3] - ticks[4], int(ours)

    def __enter__(self) -> "_OtherLoad":
        self._start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._sample()
        if self._start and end and end[0] > self._start[0]:
            total, busy, ours = (e - s for e, s in zip(end, self._start))
            self.share = max(0.0, (busy - ours) / total)


def _server_rows(manifest: str, label: str, levels: list[int], seconds: float, sets: list[str]) -> list[dict]:
    from outrider import Client

    tmp = tempfile.mkdtemp(prefix="outrider-bench-")
    address = f"ipc://{tmp}/batching.sock"
    args = [manifest, *[a for s in sets for a in ("--set", s)]]
    proc = _start_server(args, address, {"OUTRIDER_PLUGINS": "text,onnxruntime,batching"})
    rows = []
    try:
        _wait_ready(address, timeout=900)
        for clients in levels:
            before = _batch_sizes(Client, address)
            with _OtherLoad(proc.pid) as other:
                latencies = _closed_loop(address, "minilm", clients, seconds, warmup=0.5)
            row = _row(f"{label} @{clients}", len(latencies), seconds, latencies)
            row["clients"] = clients
            row["batch"] = _mean_batch(before, _batch_sizes(Client, address))
            row["other"] = other.share
            rows.append(row)
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def _batch_sizes(client_class, address: str) -> tuple[int, float]:
    with client_class(address, timeout=10) as client:
        hist = client.health()["models"]["minilm"]["stats"]["batch_size"]
    return hist["count"], hist["sum"]


def _mean_batch(before: tuple[int, float], after: tuple[int, float]) -> float:
    batches = after[0] - before[0]
    return (after[1] - before[1]) / batches if batches else 0.0


def _offline_rows(backend, sizes: list[int], seconds: float) -> list[dict]:
    rows = []
    for size in sizes:
        inputs = {"text": np.array([SHORT_SENTENCE.encode()] * size, dtype=object)}
        for _ in range(3):
            backend.execute(inputs)
        latencies, start = [], time.perf_counter()
        with _OtherLoad() as other:
            while time.perf_counter() - start < seconds:
                t0 = time.perf_counter()
                backend.execute(inputs)
                latencies.append(time.perf_counter() - t0)
        rows.append(_row(f"ORT offline, batch {size}", size * len(latencies), time.perf_counter() - start, latencies))
        rows[-1].update(batch=float(size), other=other.share)
    return rows


def _bucketing_rows(manifest, backend, rounds: int) -> list[tuple[str, float, float, int]]:
    """Mixed-length batches of 32: one padded call vs the batcher's length buckets, interleaved."""
    import random

    from outrider.serving.request import PendingRequest
    from outrider_batching import DynamicBatcher

    batcher = DynamicBatcher(manifest)
    words = ("the a man is eating food in park quick brown fox jumps over lazy dog "
             "serve models beside your application on edge devices").split()
    rng = random.Random(0)
    out = []
    for low, high in ((3, 12), (3, 40), (3, 200)):
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(low, high))).encode() for _ in range(32)]
        batch = [PendingRequest(b"", i, "infer", "minilm", {"text": np.array([t], dtype=object)}, {}, lambda *a: None)
                 for i, t in enumerate(texts)]
        subs = batcher.plan(batch, list(range(len(batch))))
        whole = {"text": np.array(texts, dtype=object)}
        parts = [{"text": np.array([texts[i] for i in sub], dtype=object)} for sub in subs]
        padded, bucketed = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            backend.execute(whole)
            padded.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for part in parts:
                backend.execute(part)
            bucketed.append(time.perf_counter() - t0)
        out.append((f"{low}-{high} words", float(np.median(padded)) * 1e3, float(np.median(bucketed)) * 1e3, len(subs)))
    return out


def bench_batching(manifest: str, seconds: float, sets: list[str], levels: list[int] | None = None,
                   plot: Path | None = None) -> None:
    """minilm served with its batching section and without it, and ORT alone, in one run."""
    from outrider.manifest import load_manifest
    from outrider_batching import BatchingSpec

    loaded = load_manifest(manifest, sets)
    if loaded.section("batching") is None:
        raise SystemExit(f"{manifest} has no 'batching' section to compare against")
    levels = sorted({1, 32, *(levels or [8])})  # the ratios below read 1 and 32

    _, backend = _offline_backend(manifest, sets)  # also fills the ONNX cache before any server starts
    offline = _offline_rows(backend, [1, 32], seconds)
    buckets = _bucketing_rows(loaded, backend, rounds=7)
    backend.unload()
    batched = _server_rows(manifest, "batched", levels, seconds, sets)
    # The same manifest with its batching section removed: one request per execute.
    plain_sets = [s for s in sets if not s.split(":")[-1].startswith("batching")]
    unbatched = _server_rows(manifest, "unbatched", levels, seconds, [*plain_sets, "batching=null"])

    b = BatchingSpec.model_validate(loaded.section("batching"))
    print(f"\nminilm, one short sentence per request, closed loop, {seconds:g} s per row "
          f"(batching: max_batch_size {b.max_batch_size}, max_queue_delay_ms {b.max_queue_delay_ms:g})")
    print(f"{'row':<26}{'sentences/s':>12}{'p50 ms':>9}{'p99 ms':>9}{'mean batch':>12}{'other CPU':>11}")
    for row in [*batched, *unbatched, *offline]:
        other = "n/a" if row["other"] is None else f"{row['other']:.0%}"
        print(f"{row['label']:<26}{row['throughput']:>12.0f}{row['p50']:>9.2f}{row['p99']:>9.2f}{row['batch']:>12.1f}"
              f"{other:>11}")
    by = {r["label"]: r for r in [*batched, *unbatched, *offline]}
    ratios = [
        ("batched@32 / unbatched@32 throughput", by["batched @32"]["throughput"] / by["unbatched @32"]["throughput"], ">= 1.6 (goal 1.8)"),
        ("batched@32 / offline batch-32 throughput", by["batched @32"]["throughput"] / by["ORT offline, batch 32"]["throughput"], ">= 0.85"),
        ("p99@1 batched / p99@1 unbatched", by["batched @1"]["p99"] / by["unbatched @1"]["p99"], "<= 1.2"),
    ]
    for name, value, target in ratios:
        print(f"{name:<44}{value:>7.2f}x   target {target}")
    print("(other CPU: the machine's CPU that processes outside this benchmark used during the row; "
          "rerun rows where it is not about 0%)")
    print("\nbucketing: 32 mixed-length sentences, one padded call vs the batcher's length buckets (ms, median)")
    print(f"{'lengths':<16}{'padded':>9}{'bucketed':>10}{'calls':>7}{'speed-up':>10}")
    for label, padded, bucketed, calls in buckets:
        print(f"{label:<16}{padded:>9.1f}{bucketed:>10.1f}{calls:>7}{padded / bucketed:>9.2f}x")
    if plot is not None:
        import bench_plot

        load = os.getloadavg()[0]
        caption = (f"{Path(manifest).name}, one short sentence per request, {seconds:g} s per point, "
                   f"{os.cpu_count()} CPUs shared (load {load:.1f}); max_batch_size {b.max_batch_size}, "
                   f"max_queue_delay_ms {b.max_queue_delay_ms:g}. $ python tools/bench.py batching "
                   f"--clients {','.join(map(str, levels))} --seconds {seconds:g} --plot")
        path = bench_plot.plot_batching({"batched": batched, "unbatched": unbatched}, offline,
                                        plot / "batching.png", caption)
        print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["overhead", "coldstart", "batching", "quantize", "bulk", "all"])
    parser.add_argument("-n", type=int, default=3000, help="round trips per row")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--manifest", action="append", default=[],
                        help="coldstart: manifests to start (default: echo, minilm, minilm-int8, smollm2-int8)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per batching row")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a manifest field for every row, e.g. --set instances=2; batching.* "
                             "fields apply to the batched server only")
    parser.add_argument("--clients", default="1,8,32", help="batching: closed-loop client counts (1 and 32 always)")
    parser.add_argument("--plot", nargs="?", type=Path, const=ROOT / "docs", metavar="DIR",
                        help="batching: write DIR/batching.png (default docs/; needs matplotlib)")
    parser.add_argument("--http", metavar="HOST:PORT", help="coldstart: also serve HTTP and wait for its readiness")
    args = parser.parse_args()
    if args.plot is not None:
        sys.path.insert(0, str(ROOT / "tools"))
        import bench_plot

        bench_plot._pyplot()  # fail now, not after the benchmark, when matplotlib is missing
    if args.what in ("overhead", "all"):
        bench_overhead(args.n)
    if args.what in ("coldstart", "all"):
        bench_coldstart(args.manifest or [str(ROOT / f"manifests/{m}.yaml") for m in COLDSTART_MANIFESTS],
                        args.runs, args.http)
    if args.what in ("batching", "all"):
        bench_batching(args.manifest[0] if args.manifest else MINILM, args.seconds, args.set,
                       [int(c) for c in args.clients.split(",") if c.strip()], args.plot)
    if args.what in ("quantize", "all"):
        sys.path.insert(0, str(ROOT / "tools"))
        import bench_quantize

        bench_quantize.bench_minilm(rounds=5)
        bench_quantize.bench_llm(n_code=16, n_chat=8, tokens=96, threads=2)
        bench_quantize.bench_llm_memory(threads=2)
    if args.what in ("bulk", "all"):
        sys.path.insert(0, str(ROOT / "tools"))
        import bench_bulk

        bench_bulk.bench_bulk(args.manifest[0] if args.manifest else MINILM, [1024, 256], rounds=3, sets=args.set)


if __name__ == "__main__":
    main()
