"""Process instances: a backend in a worker process, driven over a private ZeroMQ PAIR socket.

A crash (even a segfault in native code) or a hang in the worker costs the requests of one
batch, never the server: the supervisor kills a hung worker, and a dead one is replaced.
The same msgpack + raw tensor frames as the public protocol; no pickle.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, Optional

import numpy as np
import zmq

from .backend import Backend
from .errors import ExecutionError, OutriderError, error_from_wire
from .manifest import Manifest, validate_manifest
from .protocol import decode_tensors, encode_message, parse_type_frame, unpack_header, Limits

log = logging.getLogger("outrider.worker")

WORKER_KINDS = frozenset({"load", "warmup", "execute", "health", "metadata", "unload"})
_LIMITS = Limits(max_message_bytes=1 << 31, max_header_bytes=16 << 20, max_tensors=4096,
                 max_tensor_elements=1 << 31)
_POLL_MS = 100


class WorkerBackend(Backend):
    """Proxy with the Backend lifecycle; the real backend lives in `python -m outrider.worker`."""

    name = "worker"

    def __init__(self, manifest: Manifest, device: str, plugin_modules: list[str]) -> None:
        super().__init__(manifest, device, None)
        self.plugin_modules = plugin_modules
        self.proc: Optional[subprocess.Popen] = None
        self._dir: Optional[str] = None
        self._sock: Optional[zmq.Socket] = None
        self._lock = threading.Lock()
        self._health: dict[str, Any] = {}
        self._metadata: dict[str, Any] = {}

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
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)

    def _call(self, kind: str, tensors: Optional[dict] = None, timeout: Optional[float] = None) -> tuple[dict, dict]:
        from .model import InstanceCrashed

        assert self._sock is not None and self.proc is not None
        with self._lock:
            self._sock.send_multipart(encode_message(kind, {"id": 0}, tensors), copy=False)
            waited = 0.0
            while not self._sock.poll(_POLL_MS):
                code = self.proc.poll()
                if code is not None:
                    raise InstanceCrashed(
                        f"worker process {self.proc.pid} of model {self.manifest.name!r} exited with code {code} during {kind}"
                    )
                waited += _POLL_MS / 1000
                if timeout is not None and waited > timeout:
                    raise ExecutionError(f"worker did not answer {kind} within {timeout:g}s")
            frames = self._sock.recv_multipart(copy=False)
        header = unpack_header(frames[1].buffer, _LIMITS)
        if not header.get("ok", False):
            raise error_from_wire(header.get("error") or {})
        outputs = decode_tensors(header.get("outputs", []), frames[2:], _LIMITS)
        return header, outputs


def _serve(address: str, spec: dict) -> int:
    from .plugins import create_registry

    manifest = validate_manifest(spec["manifest"], spec.get("source_file") or "<worker>")
    manifest.source_file = spec.get("source_file")
    registry = create_registry(modules=spec.get("plugins", []))
    choice = registry.choose_backend(manifest)
    backend = choice.backend(manifest, spec["device"], registry.make_task(manifest))
    backend.accelerators = registry.accelerators_for(manifest, choice.backend)
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    parent = os.getppid()
    while True:
        if not sock.poll(1000):
            if os.getppid() != parent:  # the server is gone: do not linger as an orphan
                return 1
            continue
        frames = sock.recv_multipart(copy=False)
        reply: dict[str, Any] = {"id": 0, "ok": True}
        outputs = None
        try:
            kind = parse_type_frame(frames[0], WORKER_KINDS)
            header = unpack_header(frames[1].buffer, _LIMITS)
            if kind == "load":
                backend.load()
            elif kind == "warmup":
                backend.warmup()
            elif kind == "execute":
                outputs = backend.execute(decode_tensors(header.get("inputs", []), frames[2:], _LIMITS))
            elif kind == "health":
                reply["health"] = backend.health()
            elif kind == "metadata":
                reply["metadata"] = backend.metadata()
            elif kind == "unload":
                backend.unload()
        except OutriderError as exc:
            reply = {"id": 0, "ok": False, "error": exc.to_wire()}
            outputs = None
        except Exception as exc:
            reply = {"id": 0, "ok": False, "error": ExecutionError(f"{type(exc).__name__}: {exc}").to_wire()}
            outputs = None
        sock.send_multipart(encode_message("reply", reply, outputs, key="outputs"), copy=False)
        if reply["ok"] and frames and bytes(frames[0].buffer).endswith(b"unload"):
            return 0


def main() -> int:
    """Entry point of a worker process: `python -m outrider.worker ADDRESS SPEC_JSON`."""
    logging.basicConfig(level=os.environ.get("OUTRIDER_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s worker %(process)d %(name)s: %(message)s")
    return _serve(sys.argv[1], json.loads(sys.argv[2]))


if __name__ == "__main__":
    sys.exit(main())
