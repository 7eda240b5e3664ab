"""Process instances, the server's side: a backend in a worker process, driven over a private ZeroMQ PAIR socket.

A crash (even a segfault in native code) or a hang in the worker costs the requests of one
batch, never the server: the supervisor kills a hung worker, and a dead one is replaced.
The same msgpack + raw tensor frames as the public protocol; no pickle.

Nothing here waits on the worker without also watching it: every send is non-blocking (a PAIR
socket whose peer died would block a plain send forever), and every wait polls the socket
together with the process's pidfd, so a worker that dies at any moment (idle, mid-batch,
mid-reply) wakes the caller at once. Each call carries a sequence number that the worker echoes,
so a late reply to an abandoned call is never taken for the answer to the next one.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import numpy as np
import zmq

from ..backend import Backend
from ..errors import InstanceCrashed, OutriderError, error_from_wire
from ..manifest import Manifest
from ..protocol import decode_tensors, encode_message, unpack_header
from .wire import CONNECT_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, LIMITS, POLL_MS

def describe_exit(pid: int, code: int) -> str:
    """'worker process 123 was killed by signal SIGKILL' / '... exited with code 3'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"worker process {pid} was killed by signal {name}"
    return f"worker process {pid} exited with code {code}"


class WorkerBackend(Backend):
    """Proxy with the Backend lifecycle; the real backend lives in `python -m outrider.worker`."""

    name = "worker"
    killable = True

    def __init__(self, manifest: Manifest, device: str, plugin_modules: list[str], index: int = 0) -> None:
        super().__init__(manifest, device, None)
        self.plugin_modules = plugin_modules
        self.index = index
        self.proc: Optional[subprocess.Popen] = None
        self._dir: Optional[str] = None
        self._sock: Optional[zmq.Socket] = None
        self._pidfd: Optional[int] = None
        self._recv_poller = zmq.Poller()
        self._send_poller = zmq.Poller()
        self._connected = False
        self._seq = 0
        self._lock = threading.Lock()
        self._health: dict[str, Any] = {}
        self._metadata: dict[str, Any] = {}

    def prepare_artifact(self) -> None:
        """Nothing here: the worker prepares its backend's artifact itself, before its load."""

    def load(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="outrider-worker-")
        address = f"ipc://{self._dir}/worker.sock"
        self._sock = zmq.Context.instance().socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        spec = {
            "manifest": self.manifest.model_dump(mode="json"),
            "source_file": self.manifest.source_file,
            "device": self.device,
            "plugins": self.plugin_modules,
        }
        self.proc = subprocess.Popen([sys.executable, "-m", "outrider.worker", address, json.dumps(spec)])
        try:  # readable the moment the process exits: waits wake at once instead of at the next tick
            self._pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            self._pidfd = None
        self._recv_poller.register(self._sock, zmq.POLLIN)
        self._send_poller.register(self._sock, zmq.POLLOUT)
        if self._pidfd is not None:
            self._recv_poller.register(self._pidfd, zmq.POLLIN)
            self._send_poller.register(self._pidfd, zmq.POLLIN)
        self._call("load")
        self._metadata = self._call("metadata")[0].get("metadata", {})

    def warmup(self) -> None:
        self._call("warmup")
        self._health = self._call("health")[0].get("health", {})

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._call("execute", inputs)[1]

    def health(self) -> dict[str, Any]:
        # Answered from what the worker last said: asking it would wait behind a running batch.
        alive = self.proc is not None and self.proc.poll() is None
        return {**self._health, "healthy": alive and self._health.get("healthy", True),
                "worker_pid": self.proc.pid if self.proc else None}

    def heartbeat(self, timeout: float = HEARTBEAT_TIMEOUT_S) -> dict[str, Any]:
        """Ask the worker for its backend's health now (from the instance's thread, between batches).

        A worker that does not answer within `timeout` is wedged: it is killed, and InstanceCrashed
        says so. The answer is also what `health()` reports from then on.
        """
        self._health = self._call("health", timeout=timeout)[0].get("health", {})
        return self.health()

    def exited(self) -> Optional[str]:
        """None while the worker process runs; once it is gone, how it ended (for messages and health)."""
        proc = self.proc
        if proc is None:
            return None
        code = proc.poll()
        if code is None and self._pidfd is not None and _readable(self._pidfd):
            # It has exited, but poll() says nothing while another thread (the supervisor's own
            # poll) holds Popen's waitpid lock: wait for that verdict rather than send a batch to
            # a dead worker (seen in test_two_instances_one_killed_one_busy).
            code = proc.wait()
        return None if code is None else describe_exit(proc.pid, code)

    def metadata(self) -> dict[str, Any]:
        return {**self._metadata, "instance_kind": "process"}

    def kill(self) -> None:
        """Kill the worker now (it hung); a waiting `_call` then reports the crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def unload(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                try:
                    self._call("unload", timeout=5.0)
                except OutriderError:
                    pass
                try:
                    self.proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            if self._sock is not None:
                self._sock.close(0)
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)

    def _where(self) -> str:
        return f"model {self.manifest.name!r} instance {self.index}"

    def _crashed(self, kind: str, delivered: bool) -> Exception:
        """InstanceCrashed for a worker found dead: `unavailable` when this call never reached it."""
        assert self.proc is not None
        try:
            code = self.proc.wait(1.0)  # the pidfd fired or poll() saw it: reaping is immediate
        except subprocess.TimeoutExpired:
            code = None
        how = describe_exit(self.proc.pid, code) if code is not None else f"worker process {self.proc.pid} closed its socket"
        if delivered:
            reason = f"{how} during {kind}"
            return InstanceCrashed(f"{self._where()}: {reason}; the instance is being replaced", reason=reason)
        reason = f"{how} before {kind} reached it"
        return InstanceCrashed(f"{self._where()}: {reason}; the instance is being replaced, retry",
                               code="unavailable", delivered=False, reason=reason)

    def _hung(self, kind: str, timeout: float) -> Exception:
        self.kill()
        pid = self.proc.pid if self.proc else None
        reason = f"worker process {pid} did not answer {kind} within {timeout:g}s and was killed"
        return InstanceCrashed(f"{self._where()}: {reason}; the instance is being replaced", reason=reason)

    def _wait(self, poller: zmq.Poller, deadline: Optional[float]) -> tuple[bool, bool]:
        """Wait on `poller` up to the deadline: (socket ready, process gone)."""
        assert self.proc is not None
        # With a pidfd the poll wakes on exit by itself; the tick only bounds a missed wake-up.
        wait_ms = 1000 if self._pidfd is not None else POLL_MS
        if deadline is not None:
            wait_ms = max(0, min(wait_ms, int((deadline - time.monotonic()) * 1000) + 1))
        events = dict(poller.poll(wait_ms))
        ready = self._sock in events
        gone = (self._pidfd is not None and self._pidfd in events) or self.proc.poll() is not None
        return ready, gone

    def _call(self, kind: str, tensors: Optional[dict] = None, timeout: Optional[float] = None) -> tuple[dict, dict]:
        """One request to the worker and its reply; never blocks on a worker that is gone or wedged.

        `timeout` bounds the whole call (the worker is killed past it); without one, the wait
        ends when the worker answers or dies (the supervisor kills one that runs too long).
        """
        assert self._sock is not None and self.proc is not None
        with self._lock:
            if self.proc.poll() is not None:
                raise self._crashed(kind, delivered=False)
            self._seq += 1
            seq = self._seq
            frames = encode_message(kind, {"id": seq}, tensors)
            start = time.monotonic()
            deadline = None if timeout is None else start + timeout
            # The first send waits for the new worker to connect; later ones find the peer there.
            send_deadline = deadline if self._connected else start + min(timeout or CONNECT_TIMEOUT_S, CONNECT_TIMEOUT_S)
            while True:
                try:
                    self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    self._connected = True
                    break
                except zmq.Again:
                    pass
                ready, gone = self._wait(self._send_poller, send_deadline)
                if gone and not ready:
                    raise self._crashed(kind, delivered=False)
                if send_deadline is not None and time.monotonic() > send_deadline:
                    raise self._hung(kind, send_deadline - start)
            while True:
                ready, gone = self._wait(self._recv_poller, deadline)
                if ready:
                    try:
                        reply = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        continue
                    header = unpack_header(reply[1].buffer, LIMITS)
                    if header.get("id") != seq:  # the late answer to a call that was given up on
                        continue
                    break
                if gone:
                    raise self._crashed(kind, delivered=True)
                if deadline is not None and time.monotonic() > deadline:
                    raise self._hung(kind, timeout)
        if not header.get("ok", False):
            raise error_from_wire(header.get("error") or {})
        outputs = decode_tensors(header.get("outputs", []), reply[2:], LIMITS)
        return header, outputs


def _readable(fd: int) -> bool:
    """Whether `fd` is readable now (a pidfd is, once its process has exited)."""
    return bool(select.select([fd], [], [], 0)[0])
