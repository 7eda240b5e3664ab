"""Backends that misbehave on purpose, registered only by the tests that need them."""

from __future__ import annotations

import time

from typing import Any

import numpy as np

from outrider import hookimpl
from outrider.backend import Backend, GeneratingBackend
from outrider.serving.scheduler import Scheduler


class SlowWarmupBackend(Backend):
    """Echo whose warmup takes `options.warmup_s` seconds (to watch health before ready)."""

    name = "slow-warmup"

    def warmup(self) -> None:
        time.sleep(float(self.manifest.options.get("warmup_s", 1.0)))

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(inputs)


class FailingWarmupBackend(Backend):
    """Warmup raises: the model must stay not-ready with the reason in health."""

    name = "failing-warmup"

    def warmup(self) -> None:
        raise RuntimeError("warmup exploded on purpose")

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(inputs)


class BadArtifactBackend(Backend):
    """Load raises ArtifactError (deterministic), appending one line to `options.journal` per attempt:
    the model must be failed once, with the reason, and never loaded again."""

    name = "bad-artifact"

    def load(self) -> None:
        from outrider.errors import ArtifactError

        journal = self.manifest.options.get("journal")
        if journal:
            with open(journal, "a") as f:
                f.write("load\n")
        raise ArtifactError(f"model {self.manifest.name!r}: artifact /nowhere/model.onnx is truncated on purpose")

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(inputs)


class RaisingBackend(Backend):
    """Execute raises when input `x` holds a negative value; otherwise echoes."""

    name = "raising"

    def warmup(self) -> None:
        pass

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if "x" in inputs and (np.asarray(inputs["x"]) < 0).any():
            raise ValueError("negative input on purpose")
        return dict(inputs)


class UnavailableBackend(Backend):
    """Never available, to exercise fallback along a preference list."""

    name = "never-available"

    @classmethod
    def availability(cls, manifest=None, device="auto"):
        from outrider.backend import Availability

        return Availability(False, "this backend is never available (test)")




class CrashingBackend(Backend):
    """Echo, but the process exits when `x` holds 13 (use only with instance_kind: process)."""

    name = "crashing"

    def warmup(self) -> None:
        pass

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import os

        if "x" in inputs and (np.asarray(inputs["x"]) == 13).any():
            os._exit(3)
        return dict(inputs)


class HangingBackend(Backend):
    """Echo, but execute never returns when `x` holds 7 (a stuck kernel, a deadlock)."""

    name = "hanging"

    def warmup(self) -> None:
        pass

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if "x" in inputs and (np.asarray(inputs["x"]) == 7).any():
            time.sleep(3600)
        return dict(inputs)


class RowTimeBackend(Backend):
    """Echo that sleeps `options.row_ms` per row of its first input: a call costs what its rows cost."""

    name = "row-time"

    def warmup(self) -> None:
        pass

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = max((a.shape[0] for a in inputs.values() if a.ndim), default=1)
        time.sleep(rows * float(self.manifest.options.get("row_ms", 0.1)) / 1000)
        return dict(inputs)


class CountBackend(Backend):
    """Answers how many elements each input had, as a one-row output (small replies for big requests)."""

    name = "count"

    def warmup(self) -> None:
        pass

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: np.array([a.size], np.int64) for name, a in inputs.items()}


class FakeGeneratorBackend(GeneratingBackend):
    """Generates (so the server takes `generate` for it) and answers each request with no outputs,
    one at a time: its scheduler is the core's default one-request policy."""

    name = "fake-generator"

    @classmethod
    def make_scheduler(cls, manifest: Any) -> Scheduler:
        return Scheduler(manifest)

    def warmup(self) -> None:
        pass

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {}


class UnencodableBackend(Backend):
    """Answers `y`, one BYTES element per row of `x`: b"ok", or a dict (which no reply can carry)
    for rows whose first value is negative. Only the requests holding such a row cannot be encoded."""

    name = "unencodable"

    def warmup(self) -> None:
        pass

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        y = np.empty(x.shape[0], dtype=object)
        for i in range(x.shape[0]):
            y[i] = {"not": "encodable"} if x[i, 0] < 0 else b"ok"
        return {"y": y}


@hookimpl
def outrider_register_backends(register) -> None:
    for cls in (SlowWarmupBackend, FailingWarmupBackend, RaisingBackend, UnavailableBackend, CrashingBackend,
                HangingBackend, RowTimeBackend, CountBackend, FakeGeneratorBackend, UnencodableBackend,
                BadArtifactBackend):
        register(cls)
