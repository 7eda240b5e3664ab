"""`tensorrt` backend: a TensorRT 10 engine built from the model's ONNX graph, cached on disk.

The ONNX graph comes from the ONNX Runtime plugin's artifact cache (`options.onnx`, or an
export made once). Building an engine takes minutes, so engines are cached too, keyed by the
ONNX file's hash, the TensorRT version, the GPU and the build options. Device buffers are torch
CUDA tensors: torch is the simplest CUDA allocator and stream the Python side already has.
Importing this plugin imports neither tensorrt nor torch.

Manifest options: `onnx`, `max_batch` (default: batching.max_batch_size, else 32),
`max_seq_length` (default: the task's), `fp16`, `workspace_mb`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from outrider import hookimpl
from outrider.backend import Availability, Backend, Task
from outrider.errors import BadRequestError, ExecutionError, OutriderError
from outrider.artifacts import ArtifactCache
from outrider.manifest import Manifest
from outrider_onnxruntime.onnx_artifact import onnx_model
from outrider_torch.onnx_export import DEFAULT_OPSET  # stdlib-only module: no torch

__version__ = "0.1.0"

log = logging.getLogger("outrider.tensorrt")


class TensorRTOptions(BaseModel):
    """The `options` of a TensorRT manifest, validated at start."""

    model_config = ConfigDict(extra="forbid")

    onnx: Optional[str] = None
    opset: int = Field(DEFAULT_OPSET, ge=7, le=30)
    export_timeout_s: float = Field(900, gt=0)
    max_batch: Optional[int] = Field(None, ge=1, le=65536)
    max_seq_length: Optional[int] = Field(None, ge=2)
    fp16: bool = False
    workspace_mb: int = Field(1024, ge=16)


@hookimpl
def outrider_register_backends(register: Callable[[type], None]) -> None:
    """Register the TensorRT backend."""
    register(TensorRTBackend)


def _cuda_device_count() -> int:
    # Asks the driver directly: importing torch only to learn there is no GPU would cost seconds.
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


class TensorRTBackend(Backend):
    """One engine and one execution context per instance, on one GPU."""

    name = "tensorrt"
    options_model = TensorRTOptions
    device_kinds = ("cuda",)

    def __init__(self, manifest: Manifest, device: str, task: Optional[Task] = None) -> None:
        super().__init__(manifest, device, task)
        self.engine: Any = None
        self.context: Any = None
        self.engine_path: Optional[Path] = None
        self.gpu: Optional[str] = None
        self._lock = threading.Lock()  # one execution context: one request at a time

    @classmethod
    def availability(cls, manifest: Optional[Manifest] = None, device: str = "auto") -> Availability:
        """tensorrt and torch installed, and a CUDA GPU the driver can see."""
        base = super().availability(manifest, device)
        if not base.available:
            return base
        if importlib.util.find_spec("tensorrt") is None:
            return Availability(False, "tensorrt is not installed (pip install 'outrider[tensorrt]')")
        if importlib.util.find_spec("torch") is None:
            return Availability(False, "torch (a CUDA build) is needed for device buffers; it is not installed")
        if _cuda_device_count() == 0:
            return Availability(False, "no CUDA GPU (the CUDA driver is missing or sees no device)")
        return Availability(True)

    @classmethod
    def resolve_device(cls, device: str) -> str:
        """TensorRT runs on CUDA only."""
        return "cuda" if device == "auto" else device

    # -- load ---------------------------------------------------------------------------------

    def load(self) -> None:
        """Build (or read from the cache) the engine, then create an execution context."""
        import tensorrt as trt
        import torch

        self._trt, self._torch = trt, torch
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._device = torch.device(self.device)
        onnx_path = onnx_model(self.manifest)
        opts = self.manifest.options
        batching = self.manifest.batching
        max_batch = int(opts.get("max_batch") or (batching.max_batch_size if batching else 32))
        max_seq = int(opts.get("max_seq_length") or getattr(self.task, "max_length", 512))
        self.build_options = {
            "min": [1, 1], "opt": [max(1, max_batch // 2), max(1, max_seq // 2)], "max": [max_batch, max_seq],
            "fp16": bool(opts.get("fp16", False)), "workspace_mb": int(opts.get("workspace_mb", 1024)),
        }
        self.gpu = torch.cuda.get_device_name(self._device)
        # The core artifact cache keys the engine by the ONNX content, TensorRT version, GPU model,
        # compute capability and build options; a second start deserializes and builds nothing.
        capability = ".".join(map(str, torch.cuda.get_device_capability(self._device)))
        artifact = ArtifactCache().get_or_build(
            "tensorrt-engine", lambda directory, progress: self._build(onnx_path, directory / "model.engine"),
            label=f"{self.manifest.name} TensorRT engine", sources=[onnx_path], versions=["tensorrt"],
            device=f"{self.gpu} sm{capability}", options=self.build_options,
        )
        self.engine_path = artifact.file("model.engine")
        runtime = trt.Runtime(self._logger)
        self.engine = runtime.deserialize_cuda_engine(self.engine_path.read_bytes())
        if self.engine is None:
            raise OutriderError(f"TensorRT could not deserialize {self.engine_path}; delete it to rebuild")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if n not in self._inputs]
        self._stream = torch.cuda.Stream(self._device)

    def _build(self, onnx_path: Path, engine_path: Path) -> dict:
        trt = self._trt
        log.info("model %s: building a TensorRT engine on %s (minutes; cached afterwards)",
                 self.manifest.name, self.gpu)
        start = time.monotonic()
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise OutriderError(f"TensorRT cannot parse {onnx_path}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.build_options["workspace_mb"] << 20)
        if self.build_options["fp16"]:
            config.set_flag(trt.BuilderFlag.FP16)
        # One profile covering every batch and sequence length the server will send; dims the
        # graph fixes (e.g. a hidden size) keep their value.
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            bounds = (self.build_options["min"], self.build_options["opt"], self.build_options["max"])
            profile.set_shape(tensor.name, *(_profile_shape(tensor.shape, bound) for bound in bounds))
        config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise OutriderError(f"TensorRT failed to build an engine from {onnx_path} (see the log above)")
        engine_path.write_bytes(bytes(serialized))  # inside the cache's temporary entry: atomic
        log.info("model %s: built the engine in %.0f s", self.manifest.name, time.monotonic() - start)
        return {"gpu": self.gpu}

    # -- execute ------------------------------------------------------------------------------

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Task feeds -> device tensors -> execute_async_v3 on our stream -> host -> task outputs."""
        feeds = self.task.preprocess(inputs) if self.task else inputs
        empty = getattr(self.task, "empty_outputs", None)
        outputs = empty(feeds) if empty else None
        if outputs is None:
            outputs = self._run(feeds)
        return self.task.postprocess(outputs, feeds) if self.task else outputs

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        trt, torch = self._trt, self._torch
        limit = self.build_options["max"]
        with self._lock, torch.cuda.stream(self._stream):
            keep = []  # the device tensors must outlive the asynchronous run
            for name in self._inputs:
                array = feeds[name]
                if any(d > m for d, m in zip(array.shape, limit)):
                    raise BadRequestError(f"input {name!r} shape {list(array.shape)} exceeds the engine's {limit}")
                dtype = _torch_dtype(torch, trt, self.engine.get_tensor_dtype(name))
                tensor = torch.from_numpy(np.ascontiguousarray(array)).to(self._device, dtype, non_blocking=True)
                self.context.set_input_shape(name, tuple(tensor.shape))
                self.context.set_tensor_address(name, tensor.data_ptr())
                keep.append(tensor)
            results = {}
            for name in self._outputs:
                shape = tuple(self.context.get_tensor_shape(name))  # known once input shapes are set
                dtype = _torch_dtype(torch, trt, self.engine.get_tensor_dtype(name))
                results[name] = torch.empty(shape, dtype=dtype, device=self._device)
                self.context.set_tensor_address(name, results[name].data_ptr())
            if not self.context.execute_async_v3(self._stream.cuda_stream):
                raise ExecutionError(f"model {self.manifest.name!r}: TensorRT execute_async_v3 failed")
            host = {name: t.to("cpu", non_blocking=True) for name, t in results.items()}
            self._stream.synchronize()
        return {name: t.numpy() for name, t in host.items()}

    # -- health -------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """GPU, TensorRT version and engine file."""
        loaded = self.context is not None
        return {
            "healthy": loaded,
            "device": self.device,
            "gpu": self.gpu,
            "tensorrt": self._trt.__version__ if loaded else None,
            "engine": str(self.engine_path) if loaded else None,
        }

    def unload(self) -> None:
        """Drop the context and engine (their device memory goes with them)."""
        self.context = None
        self.engine = None


def _profile_shape(dims: Any, bound: list[int]) -> list[int]:
    """Dynamic dims take (batch, sequence) from `bound` in order; fixed dims keep their size."""
    return [(bound[j] if j < len(bound) else 1) if d == -1 else d for j, d in enumerate(dims)]


def _torch_dtype(torch: Any, trt: Any, dtype: Any) -> Any:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.int8: torch.int8, trt.bool: torch.bool}
    return table[dtype]
