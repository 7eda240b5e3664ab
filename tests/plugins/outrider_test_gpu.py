"""Backends for placement and GPU-health tests on machines without a GPU (registered only by them).

They compute on the CPU whatever device they are placed on: what the tests check is where the
core puts instances and what health says, not GPU arithmetic.
"""

from __future__ import annotations

import numpy as np

from outrider import hookimpl
from outrider.backend import Backend

#: an error in the form ONNX Runtime's CUDA arena (bfc_arena.cc) raises when a GPU is full
ORT_CUDA_OOM = (
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running MatMul node. "
    "Name:'/encoder/layer.0/attention/self/query/MatMul' Status Message: "
    "/onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:376 void* onnxruntime::BFCArena::"
    "AllocateRawInternal(size_t, bool, onnxruntime::Stream*, bool, onnxruntime::WaitNotificationFn) "
    "Failed to allocate memory for requested buffer of size 1073741824"
)


class PlacedEchoBackend(Backend):
    """Echoes its inputs on any device label, and says in health which device it was given."""

    name = "placed-echo"
    device_kinds = ("cpu", "cuda")

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(inputs)


class OutOfMemoryWarmupBackend(Backend):
    """Warmup fails the way ONNX Runtime does on a full GPU."""

    name = "oom-warmup"
    device_kinds = ("cpu", "cuda")

    def warmup(self) -> None:
        raise RuntimeError(ORT_CUDA_OOM)

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(inputs)


@hookimpl
def outrider_register_backends(register) -> None:
    for cls in (PlacedEchoBackend, OutOfMemoryWarmupBackend):
        register(cls)
