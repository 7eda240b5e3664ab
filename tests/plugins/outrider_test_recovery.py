"""A backend for recovery tests: sleeps on demand, keeps a journal, and reports health from a file.

Registered only by the tests that name it (`--plugin outrider_test_recovery`).

options:
  sleep_ms        sleep this long in every execute
  journal         a file; each execute appends one JSON line with its process id and the values
                  of input `x`, before it sleeps (which requests a killed worker was running)
  unhealthy_file  while this file exists, health() says unhealthy, with its text as the reason
inputs: any; an input `s` (FP32) adds its largest value, in seconds, to the sleep.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from outrider import hookimpl
from outrider.backend import Backend


class SleepyBackend(Backend):
    name = "sleepy"

    def warmup(self) -> None:
        pass

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        options = self.manifest.options
        journal = options.get("journal")
        if journal and "x" in inputs:
            with open(journal, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "x": np.asarray(inputs["x"]).ravel().tolist()}) + "\n")
        seconds = float(options.get("sleep_ms", 0)) / 1000
        if "s" in inputs and inputs["s"].size:
            seconds += float(np.max(inputs["s"]))
        if seconds > 0:
            time.sleep(seconds)
        return dict(inputs)

    def health(self) -> dict[str, Any]:
        flag = self.manifest.options.get("unhealthy_file")
        if flag and os.path.exists(flag):
            with open(flag) as f:
                return {"healthy": False, "reason": f.read().strip() or "unhealthy on purpose", "pid": os.getpid()}
        return {"healthy": True, "device": self.device, "pid": os.getpid()}


@hookimpl
def outrider_register_backends(register) -> None:
    register(SleepyBackend)
