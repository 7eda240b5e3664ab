"""`echo` backend: returns its inputs unchanged and imports no framework.

It measures the runtime's own overhead (protocol, queues, threads) and serves protocol tests.
`options.delay_ms` adds a fixed compute time, to stand in for a model in latency tests.
It is also the smallest template for a backend plugin: copy this folder (its pyproject.toml
registers the entry point), and check your backend with the conformance kit as
tests/test_server.py::TestEchoConformance does (`outrider.testing.BackendConformance`).
"""

from __future__ import annotations

import time

import numpy as np

from pydantic import BaseModel, ConfigDict, Field

from outrider import hookimpl
from outrider.backend import Availability, Backend

__version__ = "0.1.0"


class EchoOptions(BaseModel):
    """`delay_ms`: sleep this long per execute (to model a slow backend in tests and benchmarks)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # schema built on first use

    delay_ms: float = Field(0, ge=0, le=600_000)


class EchoBackend(Backend):
    """Outputs are the inputs, by name, untouched (no copy)."""

    name = "echo"
    device_kinds = ("cpu",)
    options_model = EchoOptions

    @classmethod
    def availability(cls, manifest=None, device: str = "auto") -> Availability:
        # Cheap, and says why not: the core asks on every start. Echo needs no package, only a CPU;
        # a backend with dependencies checks them here (outrider.backend.require_packages).
        return super().availability(manifest, device)

    def load(self) -> None:
        self.delay = float(self.manifest.options.get("delay_ms", 0)) / 1000
        # Returning the inputs takes microseconds: the I/O thread may run it (see Backend.runs_inline).
        self.runs_inline = self.delay == 0

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.delay:
            time.sleep(self.delay)
        return dict(inputs)


@hookimpl
def outrider_register_backends(register) -> None:
    register(EchoBackend)
