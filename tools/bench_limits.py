#!/usr/bin/env python3
"""What a huge request costs the server and everyone else, with and without the default limits.

  python tools/bench_limits.py [--rows 100000] [--small 300] [--concurrency 4] [--window 15]
                               [--manifest manifests/minilm.yaml]

One `infer` of ROWS empty strings (the cheapest rows there are: 2 tokens each, so the cost is the
runtime's and the batcher's more than the model's), sent to `outrider serve MANIFEST`:

1. with the manifest as shipped (`limits.max_rows` 2048): it must be refused `too_large` before
   anything is decoded; the table shows the reply time (median of 5) and the server's RSS;
2. with a temporary copy of the manifest whose `limits.max_rows` is ROWS: the batcher splits it
   into `batching.max_batch_size` pieces; the table shows its reply time (alone on the server)
   and the server's peak RSS while it ran (VmHWM, reset just before it is sent; /proc/PID/status);
3. on that second server, the latency (p50 / p99) of small requests (one short sentence,
   CONCURRENCY in flight at a time, each on a connection of its own) while the same huge request
   is processed again (for WINDOW seconds at most, then it is cancelled), against the same small
   requests on the idle server, before and after.

Servers run one at a time with only the plugins they need (`--plugin`, no entry points), on an
ipc:// address in a temporary folder. The default run takes 2-4 minutes on 2 idle CPU cores;
`--rows` shrinks it. Machine load (/proc/loadavg) is printed with the table: absolute figures do
not carry from one machine to the next, compare within a run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))

PLUGINS = ["outrider_text", "outrider_onnxruntime", "outrider_batching"]
SMALL = "A man is eating food in the park."


def _status_mib(pid: int, field: str) -> float:
    from outrider.harness import rss_mb

    value = rss_mb(pid, field)
    if value <= 0:
        raise RuntimeError(f"no {field} in /proc/{pid}/status")
    return value


def _reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux 4.0+); False where that is refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def Server(manifest: Path, directory: str, label: str) -> Any:
    """`outrider serve MANIFEST` with PLUGINS only, on ipc://DIRECTORY/LABEL.sock, its log beside it."""
    from outrider.harness import ServerProcess

    return ServerProcess.start([manifest], f"ipc://{directory}/{label}.sock", plugins=PLUGINS,
                               log_path=Path(directory) / f"{label}.log", cwd=ROOT)


def _small_requests(address: str, model: str, concurrency: int, count: Optional[int],
                    until: Optional[threading.Event] = None) -> list[tuple[float, float]]:
    """(start, seconds) of small requests, `concurrency` in flight (one connection each), until
    `count` are done, or until `until` is set (requests still running then are not counted)."""
    from outrider import Client

    text = {"text": np.array([SMALL], dtype=object)}
    out: list[tuple[float, float]] = []
    lock = threading.Lock()
    issued = [0]
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with Client(address, timeout=600) as client:
                while True:
                    with lock:
                        if count is not None and issued[0] >= count:
                            return
                        issued[0] += 1
                    if until is not None and until.is_set():
                        return
                    start = time.monotonic()
                    client.infer(model, text)
                    took = time.monotonic() - start
                    if until is not None and until.is_set():
                        return  # finished after the huge request did: not "during" it
                    with lock:
                        out.append((start, took))
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _latency(samples: list[tuple[float, float]]) -> dict[str, Any]:
    seconds = sorted(s for _, s in samples)
    if not seconds:
        return {"n": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    p99 = seconds[min(len(seconds) - 1, int(round(0.99 * (len(seconds) - 1))))]
    return {"n": len(seconds), "p50": statistics.median(seconds) * 1e3, "p99": p99 * 1e3, "max": seconds[-1] * 1e3}


def _during_huge(address: str, model: str, huge: dict, concurrency: int, window: float) -> tuple[dict, bool]:
    """Small-request latency while `huge` is processed: sent on a raw DEALER, cancelled after
    `window` seconds if still running. Returns the latency summary and whether it finished."""
    import msgpack
    import zmq

    from outrider.protocol import encode_message

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    stop = threading.Event()
    finished = [False]

    def watch() -> None:
        end = time.monotonic() + window
        while time.monotonic() < end:
            if sock.poll(50):
                sock.recv_multipart()  # the huge request's reply: it finished within the window
                finished[0] = True
                stop.set()
                return
        sock.send_multipart(encode_message("cancel", {"id": "cancel", "target": "huge"}))
        stop.set()
        for _ in range(2):  # the cancel's reply and the huge request's `cancelled`
            if sock.poll(60_000):
                msgpack.unpackb(sock.recv_multipart()[1])

    try:
        sock.send_multipart(encode_message("infer", {"id": "huge", "model": model}, huge))
        time.sleep(0.05)  # it is on its way (a 400 KB message): the small ones go behind it
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        during = _latency(_small_requests(address, model, concurrency, None, until=stop))
        watcher.join()
    finally:
        sock.close(0)
    return during, finished[0]


def refused(manifest: Path, model: str, rows: int, directory: str) -> dict[str, Any]:
    from outrider import Client, OutriderError

    server = Server(manifest, directory, "default-limits")
    try:
        server.wait_ready()
        huge = {"text": np.array([""] * rows, dtype=object)}
        with Client(server.address, timeout=600) as client:
            client.infer(model, {"text": np.array([SMALL], dtype=object)})
            rss_before = _status_mib(server.pid, "VmRSS")
            _reset_peak(server.pid)
            times, codes = [], set()
            for _ in range(5):
                start = time.monotonic()
                try:
                    client.infer(model, huge)
                    codes.add("ok")
                except OutriderError as exc:
                    codes.add(exc.code)
                    message = exc.message
                times.append(time.monotonic() - start)
            peak = _status_mib(server.pid, "VmHWM")
        return {"result": ",".join(sorted(codes)), "seconds": statistics.median(times), "rss_before": rss_before,
                "rss_peak": peak, "message": message if codes == {"too_large"} else ""}
    finally:
        server.stop()


def split(manifest: Path, model: str, rows: int, small: int, concurrency: int, window: float,
          directory: str) -> dict[str, Any]:
    from outrider import Client

    data = yaml.safe_load(manifest.read_text())
    data.setdefault("limits", {})["max_rows"] = rows
    # The copy lives elsewhere: a package-relative model path still resolves, a file-relative one must not move.
    model_src = data.get("model") or {}
    if model_src.get("path") and not model_src.get("package") and not os.path.isabs(model_src["path"]):
        model_src["path"] = str((manifest.parent / model_src["path"]).resolve())
    raised = Path(directory) / f"raised-{manifest.name}"
    raised.write_text(yaml.safe_dump(data, sort_keys=False))
    batch = (data.get("batching") or {}).get("max_batch_size")

    server = Server(raised, directory, "raised-limits")
    try:
        server.wait_ready()
        huge = {"text": np.array([""] * rows, dtype=object)}
        with Client(server.address, timeout=600) as client:
            one = client.infer(model, {"text": np.array([""], dtype=object)})["embedding"][0]
        _small_requests(server.address, model, concurrency, 20)  # warm every connection path
        idle_before = _latency(_small_requests(server.address, model, concurrency, small))

        # The huge request alone: its reply time and the server's peak RSS while it ran.
        rss_before = _status_mib(server.pid, "VmRSS")
        peak_known = _reset_peak(server.pid)
        with Client(server.address, timeout=3600) as client:
            start = time.monotonic()
            out = client.infer(model, huge)["embedding"]
            result = {"seconds": time.monotonic() - start, "shape": out.shape,
                      "max_dev": float(np.abs(out - one).max())}  # every row embeds ""
            del out
        peak = _status_mib(server.pid, "VmHWM") if peak_known else float("nan")
        rss_after = _status_mib(server.pid, "VmRSS")

        # The same request again, with small requests from other connections while it runs (for
        # `window` seconds at most: then it is cancelled, so the run stays short).
        during, finished = _during_huge(server.address, model, huge, concurrency, window)
        idle_after = _latency(_small_requests(server.address, model, concurrency, small))
        return {"batch": batch, "rss_before": rss_before, "rss_peak": peak, "rss_after": rss_after,
                "idle_before": idle_before, "during": during, "idle_after": idle_after,
                "during_finished": finished, **result}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default=str(ROOT / "manifests" / "minilm.yaml"))
    parser.add_argument("--rows", type=int, default=100_000, help="rows (empty strings) of the huge request")
    parser.add_argument("--small", type=int, default=300, help="small requests per idle measurement")
    parser.add_argument("--concurrency", type=int, default=4, help="small requests in flight at a time")
    parser.add_argument("--window", type=float, default=15.0,
                        help="seconds of small requests during the huge one (it is then cancelled)")
    args = parser.parse_args()

    from outrider.manifest import load_manifest

    manifest = Path(args.manifest).resolve()
    loaded = load_manifest(manifest)
    model, default_rows = loaded.name, loaded.limits.max_rows
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as directory:
        first = refused(manifest, model, args.rows, directory)
        second = split(manifest, model, args.rows, args.small, args.concurrency, args.window, directory)
    took = time.monotonic() - started

    load = open("/proc/loadavg").read().split()[:3]
    print(f"\n{args.rows:,} empty strings in one infer to {model} ({manifest.relative_to(ROOT) if manifest.is_relative_to(ROOT) else manifest}); "
          f"{os.cpu_count()} CPUs, load average {' '.join(load)} at the end; run took {took:.0f} s\n")
    print(f"{'huge request':<44} {'reply':>14} {'reply s':>9} {'server RSS MiB: before -> peak':>32}")
    refused_rows = f"limits as shipped (max_rows {default_rows:,})"
    print(f"{refused_rows:<44} {first['result']:>14} {first['seconds']:>9.4f} "
          f"{first['rss_before']:>21.0f} -> {first['rss_peak']:.0f}")
    shape = "x".join(map(str, second["shape"]))
    split_rows = f"max_rows {args.rows:,}: split in pieces of {second['batch']}"
    print(f"{split_rows:<44} {'ok ' + shape:>14} {second['seconds']:>9.2f} "
          f"{second['rss_before']:>21.0f} -> {second['rss_peak']:.0f}  (after: {second['rss_after']:.0f})")
    print(f"\nsmall requests (one sentence, {args.concurrency} in flight, other connections)"
          f"\n{'':<44} {'n':>6} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for label, key in (("idle server, before", "idle_before"),
                       (f"during the {args.rows:,}-row request" + ("" if second["during_finished"] else
                        f" (first {args.window:g} s)"), "during"),
                       ("idle server, after", "idle_after")):
        s = second[key]
        print(f"  {label:<42} {s['n']:>6} {s['p50']:>9.1f} {s['p99']:>9.1f} {s['max']:>9.1f}")
    idle = second["idle_before"]
    if idle["n"] and second["during"]["n"]:
        print(f"\nduring / idle: p50 x{second['during']['p50'] / idle['p50']:.1f}, p99 x{second['during']['p99'] / idle['p99']:.1f}")
    if first["message"]:
        print(f"refusal: {first['message']}")
    print(f"every row of the split reply embeds \"\": max |row - embedding('')| = {second['max_dev']:.2e}")


if __name__ == "__main__":
    main()
