#!/usr/bin/env python3
"""The HTTP front with API keys and TLS against without, and under hostile traffic, in one run.

  python tools/bench_http_hardening.py [--requests 400] [--seconds 20] [--skip-llm]

1. Keys + TLS on vs off: two servers (minilm, and smollm2-int8 unless --skip-llm) on loopback,
   one plain, one with --tls-cert/--tls-key (a self-signed certificate made here with openssl)
   and --api-key-file; requests alternate between them. MiniLM one sentence per request: OIP v2
   JSON (httpx), OIP v2 binary (tritonclient, with the key header), /v1/embeddings (openai);
   p50 and p99 per path and the ratio secure/plain. SmolLM2: streamed chat tokens/s (openai).
2. Hostile traffic: one server (echo, minilm); an innocent client sends one-sentence v2 JSON
   requests for --seconds idle, then for --seconds while hostile threads send, in loops, the
   requests (3 attacker processes) that were 5xx or unbounded before (huge numbers, huge shapes, lone surrogates,
   non-string output names, lying Inference-Header-Content-Length, 200 headers, a 1 MiB header,
   a header that never ends, slowloris sockets, stalled bodies, million-element BYTES JSON).
   Between the two, the control: 3 processes sending valid small requests as fast as they can.
   Prints the hostile requests by status class, the innocent p50/p99 idle, under the benign flood
   and during the hostile one, its
   failures, the server's RSS growth, and whether health stayed ready.
   OUTRIDER_BENCH_SKIP_CASES="million BYTES,..." leaves cases out (to see what each one costs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

from bench_http import SENTENCE, free_port, wait_ready  # noqa: E402

KEY = "bench-key"


def _serve(manifests: list[str], tmp: Path, name: str, extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    port = free_port()
    address = f"ipc://{tmp}/{name}.sock"
    proc = subprocess.Popen([sys.executable, "-m", "outrider.cli", "serve", *manifests, "--bind", address,
                             "--http", f"127.0.0.1:{port}", *extra], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "wb"))
    wait_ready(address, proc)
    return proc, address, port


def _rss_mb(pid: int) -> float:
    from outrider.harness import rss_mb

    return rss_mb(pid)


def secure_vs_plain(tmp: Path, requests: int, llm: bool) -> None:
    import ssl

    import httpx
    import openai
    import tritonclient.http as triton

    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    keys = tmp / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    manifests = [str(ROOT / "manifests/minilm.yaml")] + ([str(ROOT / "manifests/smollm2-int8.yaml")] if llm else [])
    plain = _serve(manifests, tmp, "plain", [])
    secure = _serve(manifests, tmp, "secure", ["--tls-cert", str(cert), "--tls-key", str(key),
                                               "--api-key-file", str(keys)])
    trust = ssl.create_default_context(cafile=str(cert))
    auth = {"Authorization": f"Bearer {KEY}"}
    text = np.array([SENTENCE], dtype=object)
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [SENTENCE]}]}
    paths = {}
    try:
        for label, (_, _, port), tls in (("plain", plain, False), ("keys+TLS", secure, True)):
            scheme = "https" if tls else "http"
            http = httpx.Client(base_url=f"{scheme}://127.0.0.1:{port}", verify=trust if tls else True,
                                headers=auth if tls else {}, timeout=30)
            tc = triton.InferenceServerClient(url=f"127.0.0.1:{port}", ssl=tls,
                                              ssl_context_factory=(lambda: trust) if tls else None,
                                              insecure=False)
            tensor = triton.InferInput("text", [1], "BYTES")
            tensor.set_data_from_numpy(text)
            oa = openai.OpenAI(base_url=f"{scheme}://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                               http_client=httpx.Client(verify=trust if tls else True))
            paths[label] = {
                "v2 JSON (httpx)": lambda http=http: http.post("/v2/models/minilm/infer", json=body).raise_for_status(),
                "v2 binary (tritonclient)": lambda tc=tc, tensor=tensor, h=(auth if tls else {}):
                    tc.infer("minilm", [tensor], headers=h).as_numpy("embedding"),
                "/v1/embeddings (openai)": lambda oa=oa: oa.embeddings.create(model="minilm", input=SENTENCE),
            }
        latency: dict = {(label, name): [] for label in paths for name in paths[label]}
        for label in paths:
            for call in paths[label].values():
                for _ in range(20):
                    call()
        for index in range(requests):
            for label in (list(paths) if index % 2 == 0 else list(reversed(paths))):
                for name, call in paths[label].items():
                    begin = time.perf_counter()
                    call()
                    latency[(label, name)].append((time.perf_counter() - begin) * 1000)
        print(f"\nMiniLM, one sentence per request, {requests} requests per path and server, alternating")
        print(f"{'path':28}{'plain p50':>10}{'p99':>8}{'keys+TLS p50':>14}{'p99':>8}{'p50 ratio':>11}")
        for name in paths["plain"]:
            a, b = np.array(latency[("plain", name)]), np.array(latency[("keys+TLS", name)])
            print(f"{name:28}{np.percentile(a, 50):10.2f}{np.percentile(a, 99):8.2f}{np.percentile(b, 50):14.2f}"
                  f"{np.percentile(b, 99):8.2f}{np.percentile(b, 50) / np.percentile(a, 50):10.2f}x")
        if llm:
            rates: dict = {"plain": [], "keys+TLS": []}
            for label, (_, _, port), tls in (("plain", plain, False), ("keys+TLS", secure, True)):
                scheme = "https" if tls else "http"
                oa = openai.OpenAI(base_url=f"{scheme}://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                                   http_client=httpx.Client(verify=trust if tls else True))
                for _ in range(6):
                    begin, tokens = time.perf_counter(), 0
                    for chunk in oa.chat.completions.create(
                            model="smollm2-int8", messages=[{"role": "user", "content": "Write a haiku about tea."}],
                            max_tokens=64, temperature=0, stream=True, stream_options={"include_usage": True}):
                        if chunk.usage is not None:
                            tokens = chunk.usage.completion_tokens
                    rates[label].append(tokens / (time.perf_counter() - begin))
            print(f"SSE chat, smollm2-int8, 64 tokens: plain {np.median(rates['plain']):.1f} tok/s, keys+TLS "
                  f"{np.median(rates['keys+TLS']):.1f} tok/s")
    finally:
        for proc, _, _ in (plain, secure):
            proc.terminate()
            proc.wait(60)


def _raw(port: int, data: bytes, hold: float = 0.0) -> int:
    """Send `data` on a fresh connection; the status of the answer (0: closed without one)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass
            if hold:
                time.sleep(hold)
            head = sock.recv(64)
    except (ConnectionResetError, socket.timeout, OSError):
        return 0
    try:
        return int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else 0
    except (IndexError, ValueError):
        return 0


def hostile_cases(port: int) -> list:
    ok = {"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}

    def post(path: str, body: bytes, headers: bytes = b"content-type: application/json\r\n") -> bytes:
        return (b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n" + headers
                + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)

    million = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1_000_000],
                                      "data": ["ab"] * 1_000_000}]}).encode()
    return [
        ("huge number", lambda: _raw(port, post("/v2/models/echo/infer", (
            '{"inputs": [%s], "parameters": {"timeout": 1%s}}' % (json.dumps(ok), "0" * 400)).encode()))),
        ("huge shape", lambda: _raw(port, post("/v2/models/echo/infer", (
            '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1%s, 1%s], "data": [1]}]}'
            % ("0" * 4000, "0" * 4000)).encode()))),
        ("lone surrogate", lambda: _raw(port, post("/v1/embeddings", b'{"model": "minilm", "input": "\\ud800"}'))),
        ("output name list", lambda: _raw(port, post("/v2/models/echo/infer", json.dumps(
            {"inputs": [ok], "outputs": [{"name": ["a"]}]}).encode()))),
        ("lying header length", lambda: _raw(port, post("/v2/models/echo/infer", b'{"inputs": []}',
                                                        "inference-header-content-length: ¹²\r\n".encode()))),
        ("200 headers", lambda: _raw(port, b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n"
                                     + b"".join(b"x-%d: y\r\n" % i for i in range(200)) + b"\r\n")),
        ("1 MiB header", lambda: _raw(port, b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\nx-big: "
                                      + b"a" * (1 << 20) + b"\r\n\r\n")),
        ("endless header", lambda: _raw(port, b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\nx-e: " + b"a" * 200_000)),
        ("slowloris", lambda: _raw(port, b"GET /v2/health/ready HTTP/1.1\r\nho", hold=0.0)),
        ("stalled body", lambda: _raw(port, b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\n"
                                      b"content-length: 50000000\r\n\r\n" + b"x" * 1_000_000)),
        ("million BYTES", lambda: _raw(port, post("/v2/models/minilm/infer", million))),
    ]


def hostile(tmp: Path, seconds: float) -> None:
    import httpx

    proc, address, port = _serve([str(ROOT / "manifests/echo.yaml"), str(ROOT / "manifests/minilm.yaml")], tmp,
                                 "hostile", [])
    base = f"http://127.0.0.1:{port}"
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [SENTENCE]}]}
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            def innocent(duration: float) -> tuple[list[float], int]:
                times, failed, end = [], 0, time.monotonic() + duration
                while time.monotonic() < end:
                    begin = time.perf_counter()
                    try:
                        ok = http.post("/v2/models/minilm/infer", json=body).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    times.append((time.perf_counter() - begin) * 1000)
                    failed += not ok
                return times, failed

            innocent(2.0)
            idle, idle_failed = innocent(seconds)
            # The control: as many attacker processes sending valid small requests on fresh
            # connections. On 2 cores any 3 busy clients slow the innocent one; what the hostile
            # cases may not do is slow it more than that.
            benign_senders = [subprocess.Popen([sys.executable, __file__, "--attacker", str(port), "benign",
                                                str(seconds)], stdout=subprocess.PIPE, text=True) for _ in range(3)]
            benign, benign_failed = innocent(seconds)
            benign_count = sum(json.loads(s.communicate(timeout=120)[0])[0][2] for s in benign_senders)
            rss_before = _rss_mb(proc.pid)
            statuses: Counter = Counter()
            by_case: dict = {}
            stop = threading.Event()
            health_ok = [True]
            # Attackers in processes of their own: in this one they would take the GIL from the
            # innocent client and its latency would measure this process, not the server.
            attackers = [subprocess.Popen([sys.executable, __file__, "--attacker", str(port), str(i), str(seconds)],
                                          stdout=subprocess.PIPE, text=True) for i in range(3)]

            def prober() -> None:
                with httpx.Client(base_url=base, timeout=10) as probe:
                    while not stop.is_set():
                        try:
                            health_ok[0] &= probe.get("/v2/health/ready").status_code == 200
                        except httpx.HTTPError:
                            health_ok[0] = False
                        time.sleep(0.25)

            probe = threading.Thread(target=prober, daemon=True)
            probe.start()
            during, during_failed = innocent(seconds)
            stop.set()
            probe.join(30)
            for attacker in attackers:
                for name, klass, count in json.loads(attacker.communicate(timeout=120)[0]):
                    statuses[klass] += count
                    by_case.setdefault(name, Counter())[klass] += count
            rss_after = _rss_mb(proc.pid)
        log = (tmp / "hostile.log").read_text()
        print(f"\nHostile traffic for {seconds:.0f} s against echo + minilm (3 attacker processes, one innocent client)")
        print(f"hostile requests: {sum(statuses.values())}, by answer: {dict(sorted(statuses.items()))}")
        for name, counts in by_case.items():
            print(f"  {name:20} {dict(sorted(counts.items()))}")
        print(f"innocent v2 JSON minilm: idle p50 {np.percentile(idle, 50):.2f} ms p99 {np.percentile(idle, 99):.2f} ms "
              f"({len(idle)} requests, {idle_failed} failed); during p50 {np.percentile(during, 50):.2f} ms p99 "
              f"{np.percentile(during, 99):.2f} ms ({len(during)} requests, {during_failed} failed); p99 ratio "
              f"{np.percentile(during, 99) / np.percentile(idle, 99):.2f}x")
        print(f"innocent under a benign flood ({benign_count} valid requests from 3 processes): p50 "
              f"{np.percentile(benign, 50):.2f} ms p99 {np.percentile(benign, 99):.2f} ms ({len(benign)} requests, "
              f"{benign_failed} failed); hostile p99 / benign p99 "
              f"{np.percentile(during, 99) / np.percentile(benign, 99):.2f}x")
        print(f"server RSS {rss_before:.0f} MB -> {rss_after:.0f} MB (+{rss_after - rss_before:.0f}); health ready "
              f"throughout: {health_ok[0]}; tracebacks in the log: {log.count('Traceback')}")
    finally:
        proc.terminate()
        proc.wait(60)


def attack(port: int, part: str, seconds: float) -> None:
    """One attacker process: its third (`part` 0, 1, 2) of the cases in a loop for `seconds`, or
    valid requests (`part` "benign"); prints its counts."""
    skip = set(filter(None, os.environ.get("OUTRIDER_BENCH_SKIP_CASES", "").split(",")))
    if part == "benign":
        valid = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}).encode()
        cases = [("valid", lambda: _raw(port, b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ncontent-type: "
                                        b"application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                                        % len(valid) + valid))]
    else:
        cases = [c for c in hostile_cases(port) if c[0] not in skip][int(part)::3]
    counts: Counter = Counter()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for name, send in cases:
            status = send()
            counts[(name, f"{status // 100}xx" if status else "closed")] += 1
    print(json.dumps([[name, klass, n] for (name, klass), n in counts.items()]))


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--attacker":
        attack(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--skip-llm", action="store_true")
    parser.add_argument("--skip-secure", action="store_true")
    parser.add_argument("--skip-hostile", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        print(f"load before: {Path('/proc/loadavg').read_text().strip()} ({os.cpu_count()} CPUs)")
        if not args.skip_secure:
            if shutil.which("openssl") is None:
                print("(keys + TLS not measured: no openssl command to make a certificate)")
            else:
                secure_vs_plain(tmp, args.requests, not args.skip_llm)
        if not args.skip_hostile:
            hostile(tmp, args.seconds)


if __name__ == "__main__":
    main()
