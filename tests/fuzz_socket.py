#!/usr/bin/env python3
"""Socket fuzzer: hostile and malformed messages at a real server; every one must be answered.

  python tests/fuzz_socket.py                          100,000 messages at a fresh echo server
  python tests/fuzz_socket.py --count 20000 --seed 3
  python tests/fuzz_socket.py --address ipc:///tmp/s.sock --model echo    a server already running
  python tests/fuzz_socket.py --address ipc:///tmp/s.sock --generate-model smollm2 --count 2000

Each message is drawn from one of the classes in `MESSAGE_CLASSES` (random frames, broken type
frames, broken msgpack, hostile header fields, crafted shapes and BYTES buffers, frame-count
mismatches, odd cancels, hostile generate parameters, and well-formed requests so the server
keeps real work in flight). At most `--window` messages are outstanding at a time. The server
must answer every message exactly once (a reply per message; chunks do not count), never with an
`internal` error (that is a bug reached by input), fail no well-formed request because of a
hostile neighbour (only `overloaded` or `timeout` are allowed for those), and stay alive with
bounded memory.

Prints one table: sent, answered, unanswered, well-formed requests failed by their neighbours,
replies by error code, server crashes, and the server's RSS before, at its peak and after. Exit
status 1 when any of those checks fails. tests/test_fuzz.py imports it and runs it bounded.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import msgpack
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))

from outrider.protocol import MAGIC  # noqa: E402

# Values that have broken parsers before: wrong types, extremes, non-finite floats, huge strings.
HOSTILE = [
    None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1e300, -1e300, float("nan"),
    float("inf"), float("-inf"), 0.5, 1e-300, 5e-324, -0.0, 1e-8, 1e8, "", "x" * 5000, "\x00", "é" * 100, b"", b"\xff" * 64, [], {}, [1] * 500,
    {"a": {"b": {"c": [1, [2, [3]]]}}}, [[[[[[[[[[1]]]]]]]]]], {"": None}, ["x"] * 3,
]
DATATYPES = ["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES", "COMPLEX", "", "fp32"]
SHAPES = [
    [0, 2**62, 2**62], [2**31, 2**31], [2**62], [-1], [1.5], [True], ["1"], [None], list(range(1, 40)),
    [0], [], [1, 0, 2**40], [2**24 + 1], [4096, 4096], "1,2", {"0": 1}, None,
]


def type_frame(kind: str) -> bytes:
    return MAGIC + b" " + kind.encode()


def header_frame(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


@dataclass
class Fuzzer:
    """Builds hostile messages for `model` (a non-generating model taking any FP32 tensor)."""

    model: str
    rng: random.Random
    generate_model: Optional[str] = None  # a generating model: odd_generate then aims at it
    next_id: int = 1
    counts: collections.Counter = field(default_factory=collections.Counter)
    expect_ok: set = field(default_factory=set)  # ids of well-formed requests: they must succeed

    def _id(self):
        self.next_id += 1
        return self.next_id

    def _valid_infer(self) -> tuple[dict, list[bytes]]:
        rows = self.rng.randint(1, 4)
        cols = self.rng.choice([1, 3, 384])
        data = struct.pack(f"<{rows * cols}f", *([0.5] * rows * cols))
        header = {"id": self._id(), "model": self.model, "parameters": {},
                  "inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, cols]}]}
        return header, [data]

    # ---- message classes: each returns the frames to send (after the DEALER's own) ----

    def random_frames(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randint(0, 64)) for _ in range(self.rng.randint(1, 5))]

    def bad_type(self) -> list[bytes]:
        header, tensors = self._valid_infer()
        choice = self.rng.randrange(6)
        if choice == 0:
            kind = MAGIC + b" " + self.rng.choice([b"infr", b"", b"reply", b"chunk", b"INFER", b"infer "])
        elif choice == 1:
            kind = b"outrider/2 infer"
        elif choice == 2:
            kind = MAGIC
        elif choice == 3:
            kind = b""
        elif choice == 4:
            kind = type_frame("infer") + self.rng.randbytes(self.rng.randint(1, 8))
        else:
            kind = self.rng.randbytes(self.rng.randint(1, 300))
        return [kind, header_frame(header), *tensors]

    def bad_msgpack(self) -> list[bytes]:
        choice = self.rng.randrange(9)
        if choice == 0:
            raw = self.rng.randbytes(self.rng.randint(0, 100))
        elif choice == 1:
            raw = header_frame(self._valid_infer()[0])[: self.rng.randint(0, 20)]  # truncated
        elif choice == 2:
            raw = msgpack.packb(self.rng.choice([[1, 2], 7, "infer", None, b"x", 1.5]))
        elif choice == 3:
            raw = b"\xdd\xff\xff\xff\xff"  # array32 claiming 4 G elements, none present
        elif choice == 4:
            raw = b"\xdf\x7f\xff\xff\xff" + b"\xa1a\x01"  # map32 claiming 2 G pairs
        elif choice == 5:
            raw = b"\xdb\xff\xff\xff\xff"  # str32 claiming 4 GB
        elif choice == 6:
            raw = b"\xc7\x01\x05\x00" + msgpack.packb({"id": 1})  # ext type
        elif choice == 7:
            nested: object = 1
            for _ in range(self.rng.randint(9, 200)):
                nested = [nested]
            raw = msgpack.packb({"id": self._id(), "model": self.model, "x": nested})
        else:
            raw = msgpack.packb({1: "int key", "id": 3}, strict_types=False)
        frames = [type_frame(self.rng.choice(["infer", "generate", "health", "models", "cancel"])), raw]
        if self.rng.random() < 0.3:
            frames.append(self.rng.randbytes(16))
        return frames

    def hostile_field(self) -> list[bytes]:
        header, tensors = self._valid_infer()
        path = self.rng.choice([
            ("id",), ("model",), ("parameters",), ("parameters", "timeout_ms"), ("parameters", "priority"),
            ("parameters", "anything"), ("inputs",), ("inputs", 0), ("inputs", 0, "name"),
            ("inputs", 0, "datatype"), ("inputs", 0, "shape"), ("inputs", 0, "extra"), ("outputs",),
            ("unknown",),
        ])
        value = self.rng.choice(HOSTILE)
        target = header
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return [type_frame("infer"), header_frame(header), *tensors]

    def crafted_shape(self) -> list[bytes]:
        header, tensors = self._valid_infer()
        spec = header["inputs"][0]
        spec["datatype"] = self.rng.choice(DATATYPES)
        if self.rng.random() < 0.7:
            spec["shape"] = self.rng.choice(SHAPES)
        else:
            tensors = [tensors[0][: self.rng.randint(0, len(tensors[0]))] + self.rng.randbytes(self.rng.randint(0, 9))]
        return [type_frame("infer"), header_frame(header), *tensors]

    def bad_bytes_tensor(self) -> list[bytes]:
        count = self.rng.randint(1, 6)
        parts = []
        for _ in range(count):
            length = self.rng.choice([0, 3, 2**31, 2**32 - 1, 100])
            body = self.rng.randbytes(min(length, self.rng.randint(0, 8)))
            parts.append(struct.pack("<I", length) + body)
        if self.rng.random() < 0.3:  # many empty strings: legal, and must stay cheap
            count = self.rng.randint(1000, 50000)
            parts = [b"\0\0\0\0" * count]
        header = {"id": self._id(), "model": self.model, "parameters": {},
                  "inputs": [{"name": "t", "datatype": "BYTES", "shape": [count]}]}
        return [type_frame("infer"), header_frame(header), b"".join(parts)]

    def frame_count(self) -> list[bytes]:
        header, tensors = self._valid_infer()
        choice = self.rng.randrange(3)
        if choice == 0:
            tensors = []
        elif choice == 1:
            tensors = tensors * self.rng.randint(2, 4)
        else:
            tensors = [b"x"] * self.rng.randint(66, 200)  # past the tensor limit
        return [type_frame("infer"), header_frame(header), *tensors]

    def odd_cancel(self) -> list[bytes]:
        header = {"id": self.rng.choice([self._id(), *HOSTILE[:12]]), "target": self.rng.choice(HOSTILE)}
        return [type_frame("cancel"), header_frame(header)]

    def odd_generate(self) -> list[bytes]:
        # Otherwise sensible parameters, one to three of them hostile: the sensible rest lets a
        # generating model get as far as admission and sampling with the hostile one.
        params = {"prompt": "abc abc abc", "max_tokens": 4, "stream": self.rng.random() < 0.5, "timeout_ms": 30000}
        params.update({k: self.rng.choice(HOSTILE) for k in self.rng.sample(
            ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
             "speculative", "timeout_ms"], self.rng.randint(1, 3))})
        model = self.generate_model if self.generate_model and self.rng.random() < 0.8 else self.model
        header = {"id": self._id(), "model": self.rng.choice([model, model, "nope", None]), "parameters": params}
        return [type_frame("generate"), header_frame(header)]

    def odd_control(self) -> list[bytes]:
        header = {"id": self.rng.choice([self._id(), *HOSTILE[:14]]), "junk": self.rng.choice(HOSTILE)}
        return [type_frame(self.rng.choice(["health", "models"])), header_frame(header)]

    def valid(self) -> list[bytes]:
        header, tensors = self._valid_infer()
        if self.rng.random() < 0.2:
            header["parameters"]["timeout_ms"] = self.rng.choice([1, 50, 1000])
        else:
            self.expect_ok.add(header["id"])
        return [type_frame("infer"), header_frame(header), *tensors]

    def valid_generate(self) -> list[bytes]:
        if not self.generate_model:
            return self.valid()
        params = {"prompt": self.rng.choice(["hello there", "the sky is", "abc abc abc"]), "max_tokens": 8,
                  "temperature": self.rng.choice([0.0, 0.7, 1.0]), "stream": self.rng.random() < 0.5}
        header = {"id": self._id(), "model": self.generate_model, "parameters": params}
        self.expect_ok.add(header["id"])
        return [type_frame("generate"), header_frame(header)]

    def draw(self) -> list[bytes]:
        name, weight = self.rng.choices(MESSAGE_CLASSES, weights=[w for _, w in MESSAGE_CLASSES])[0]
        self.counts[name] += 1
        return getattr(self, name)()


MESSAGE_CLASSES = [
    ("random_frames", 8), ("bad_type", 8), ("bad_msgpack", 12), ("hostile_field", 20), ("crafted_shape", 14),
    ("bad_bytes_tensor", 6), ("frame_count", 6), ("odd_cancel", 6), ("odd_generate", 6), ("odd_control", 4),
    ("valid", 10), ("valid_generate", 4),
]
# Codes a well-formed request may still get from a loaded server without anything being wrong.
LOAD_CODES = {"overloaded", "timeout"}


@dataclass
class FuzzReport:
    sent: int = 0
    answered: int = 0
    chunks: int = 0
    codes: collections.Counter = field(default_factory=collections.Counter)
    classes: collections.Counter = field(default_factory=collections.Counter)
    collateral: int = 0  # well-formed requests that failed for another reason than load
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_after_mb: float = 0.0
    crashed: bool = False
    seconds: float = 0.0

    @property
    def unanswered(self) -> int:
        return self.sent - self.answered

    @property
    def ok(self) -> bool:
        return self.unanswered == 0 and not self.codes.get("internal") and not self.crashed and not self.collateral


def rss_mb(pid: Optional[int]) -> float:
    from outrider.harness import rss_mb as read

    return 0.0 if pid is None else read(pid)


def fuzz(address: str, model: str, count: int, seed: int = 0, window: int = 64, drain_s: float = 30.0,
         server_pid: Optional[int] = None, alive: Callable[[], bool] = lambda: True,
         generate_model: Optional[str] = None) -> FuzzReport:
    """Send `count` fuzz messages to `address`, at most `window` unanswered at a time."""
    fuzzer = Fuzzer(model, random.Random(seed), generate_model)
    report = FuzzReport(rss_before_mb=rss_mb(server_pid))
    report.rss_peak_mb = report.rss_before_mb
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    start = time.monotonic()
    last_reply = time.monotonic()

    def receive(timeout_ms: int) -> bool:
        nonlocal last_reply
        if not sock.poll(timeout_ms):
            return False
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            last_reply = time.monotonic()
            kind = frames[0].split(b" ", 1)[-1]
            if kind == b"chunk":
                report.chunks += 1
                continue
            report.answered += 1
            try:
                header = msgpack.unpackb(frames[1], raw=False)
                code = "ok" if header.get("ok") else (header.get("error") or {}).get("code", "?")
            except Exception:
                header, code = {}, "unparseable reply"
            report.codes[code] += 1
            request_id = header.get("id")
            if isinstance(request_id, int) and request_id in fuzzer.expect_ok:
                fuzzer.expect_ok.discard(request_id)
                if code != "ok" and code not in LOAD_CODES:
                    report.collateral += 1

    try:
        while report.sent < count:
            while report.sent - report.answered >= window:
                if not receive(1000) and time.monotonic() - last_reply > drain_s:
                    break
                if not alive():
                    report.crashed = True
                    break
            if report.crashed or report.sent - report.answered >= window:
                break  # the server stopped answering: stop sending, count the rest as unanswered
            sock.send_multipart(fuzzer.draw(), copy=False)
            report.sent += 1
            if report.sent % 500 == 0:
                report.rss_peak_mb = max(report.rss_peak_mb, rss_mb(server_pid))
                receive(0)
                if not alive():
                    report.crashed = True
                    break
        # Drain until everything is answered, or nothing has come back for drain_s (a hostile but
        # legal generation may run for a while; a lost request never comes back).
        while report.answered < report.sent and time.monotonic() - last_reply < drain_s and alive():
            receive(200)
        report.crashed = report.crashed or not alive()
    finally:
        sock.close(0)
    report.seconds = time.monotonic() - start
    report.rss_peak_mb = max(report.rss_peak_mb, rss_mb(server_pid))
    report.rss_after_mb = rss_mb(server_pid)
    report.classes = fuzzer.counts
    return report


def start_echo_server(directory: str) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{directory}/fuzz.sock"
    env = dict(os.environ, OUTRIDER_PLUGINS="none")
    cmd = [sys.executable, "-m", "outrider.cli", "serve", str(ROOT / "manifests" / "echo.yaml"),
           "--bind", address, "--plugin", "outrider_echo"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(f"{directory}/server.log", "wb"))
    from outrider import Client, OutriderError

    with Client(address, timeout=1.0) as client:
        try:
            client.wait_ready(30, interval=0.05, process=proc)
        except OutriderError as exc:
            raise SystemExit(f"echo server: {exc.message}; log in {directory}/server.log") from None
    return proc, address


def print_report(report: FuzzReport) -> None:
    print(f"| fuzz ({report.seconds:.0f} s) | value |")
    print("|---|---|")
    print(f"| messages sent | {report.sent} |")
    print(f"| answered | {report.answered} |")
    print(f"| unanswered | {report.unanswered} |")
    print(f"| `internal` errors | {report.codes.get('internal', 0)} |")
    print(f"| server crashes | {int(report.crashed)} |")
    print(f"| well-formed requests failed by their neighbours | {report.collateral} |")
    print(f"| server RSS before / peak / after, MB | {report.rss_before_mb:.0f} / {report.rss_peak_mb:.0f} / "
          f"{report.rss_after_mb:.0f} |")
    print("| replies by code | " + ", ".join(f"{c} {n}" for c, n in report.codes.most_common()) + " |")
    print("| messages by class | " + ", ".join(f"{c} {n}" for c, n in report.classes.most_common()) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=64, help="most messages outstanding at once")
    parser.add_argument("--address", help="fuzz a running server instead of starting an echo server")
    parser.add_argument("--model", default="echo", help="a non-generating model served at --address")
    parser.add_argument("--generate-model", help="also aim hostile generate parameters at this generating model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="outrider-fuzz-") as directory:
        proc = None
        address = args.address
        if address is None:
            proc, address = start_echo_server(directory)
        try:
            alive = (lambda: proc.poll() is None) if proc else (lambda: True)
            report = fuzz(address, args.model, args.count, args.seed, args.window,
                          server_pid=proc.pid if proc else None, alive=alive, generate_model=args.generate_model)
            print_report(report)
            if proc is not None and proc.poll() is None:
                log = Path(directory, "server.log").read_text(errors="replace")
                tracebacks = log.count("Traceback")
                print(f"| tracebacks in the server log | {tracebacks} |")
        finally:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
