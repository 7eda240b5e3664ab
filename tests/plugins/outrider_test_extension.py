"""Plugin kinds added with no core edit (registered only by tests/test_extension.py):

- a `stamp:` accelerator section (a batch policy whose pydantic model the core has never seen),
  which adds a `stamp` output holding the section's `value` to every reply;
- a `jsonline` front: a TCP server on loopback that reads one JSON object per line,
  {"model": ..., "x": [floats]}, submits it as an infer request with an FP32 tensor `x`, and
  writes back one JSON line with the outputs or the error.
"""

from __future__ import annotations

import json
import socketserver
import threading
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from outrider import hookimpl
from outrider.accelerators import AcceleratorSpec
from outrider.front import Front
from outrider.serving.scheduler import Scheduler


class StampConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: int = Field(ge=0, le=1000)


class Stamper(Scheduler):
    """One request per execute, as the default policy, plus the section's stamp."""

    def __init__(self, manifest: Any, config: StampConfig) -> None:
        super().__init__(manifest)
        self.value = config.value

    def execute(self, backend, batch):
        outputs = dict(backend.execute(batch[0].inputs))
        outputs["stamp"] = np.array([self.value], dtype=np.int64)
        return [outputs]


class JsonLineFront(Front):
    name = "jsonline"

    def start(self) -> None:
        host, _, port = self.address.rpartition(":")
        server = self.server

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    done = threading.Event()
                    answer: dict[str, Any] = {}

                    def on_reply(header: dict, outputs: Any) -> None:
                        answer.update(header)
                        if outputs:
                            answer["outputs"] = {k: np.asarray(v).tolist() for k, v in outputs.items()}
                        done.set()

                    try:
                        body = json.loads(line)
                        x = np.asarray(body["x"], dtype=np.float32)
                        server.submit("infer", body["model"], {}, [{"name": "x", "datatype": "FP32",
                                                                     "shape": list(x.shape)}],
                                      [x.tobytes()], client=b"jsonline", on_reply=on_reply)
                        done.wait(30)
                    except Exception as exc:  # an OutriderError refusing it at once, or bad JSON
                        answer = {"ok": False, "error": str(exc)}
                    self.wfile.write(json.dumps(answer).encode() + b"\n")

        self._tcp = socketserver.ThreadingTCPServer((host, int(port)), Handler)
        self._tcp.daemon_threads = True
        threading.Thread(target=self._tcp.serve_forever, name="jsonline", daemon=True).start()

    def stop(self, timeout: float = 5.0) -> None:
        self._tcp.shutdown()
        self._tcp.server_close()


@hookimpl
def outrider_register_accelerators(register) -> None:
    register(AcceleratorSpec(name="stamper", role="batch_policy", section="stamp", factory=Stamper,
                             config=StampConfig, description="adds a `stamp` output"))


@hookimpl
def outrider_register_fronts(register) -> None:
    register(JsonLineFront)
