"""Process instances, the worker's side: `python -m outrider.worker ADDRESS SPEC_JSON` builds the
manifest's backend (serving/assembly.py, as the server would) and answers the server's calls on
its PAIR socket until told to unload, or until the server is gone."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import zmq

from ..errors import ExecutionError, OutriderError
from ..manifest import validate_manifest
from ..plugins import create_registry
from ..protocol import decode_tensors, encode_message, parse_type_frame, unpack_header
from ..serving.assembly import backend_for
from .wire import LIMITS, WORKER_KINDS, WORKER_SNDTIMEO_MS


def serve(address: str, spec: dict) -> int:
    manifest = validate_manifest(spec["manifest"], spec.get("source_file") or "<worker>")
    manifest.source_file = spec.get("source_file")
    backend = backend_for(manifest, create_registry(modules=spec.get("plugins", [])), spec["device"])
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDTIMEO, WORKER_SNDTIMEO_MS)  # a server that is gone must not hold us
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
            header = unpack_header(frames[1].buffer, LIMITS)
            reply["id"] = header.get("id", 0)  # echoed: the server matches replies to calls
            if kind == "load":
                backend.prepare_artifact()
                backend.load()
            elif kind == "warmup":
                backend.warmup()
            elif kind == "execute":
                outputs = backend.execute(decode_tensors(header.get("inputs", []), frames[2:], LIMITS))
            elif kind == "health":
                reply["health"] = backend.health()
            elif kind == "metadata":
                reply["metadata"] = backend.metadata()
            elif kind == "unload":
                backend.unload()
        except OutriderError as exc:
            reply = {"id": reply["id"], "ok": False, "error": exc.to_wire()}
            outputs = None
        except Exception as exc:
            reply = {"id": reply["id"], "ok": False, "error": ExecutionError(f"{type(exc).__name__}: {exc}").to_wire()}
            outputs = None
        try:
            sock.send_multipart(encode_message("reply", reply, outputs, key="outputs"), copy=False)
        except zmq.Again:
            return 1  # nobody takes our replies any more: the server is gone or has given up on us
        if reply["ok"] and frames and bytes(frames[0].buffer).endswith(b"unload"):
            return 0


def main() -> int:
    """Entry point of a worker process: `python -m outrider.worker ADDRESS SPEC_JSON`."""
    logging.basicConfig(level=os.environ.get("OUTRIDER_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s worker %(process)d %(name)s: %(message)s")
    return serve(sys.argv[1], json.loads(sys.argv[2]))
