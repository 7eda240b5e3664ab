"""`tensorrt` backend: a TensorRT 10/11 engine built from the model's ONNX graph, cached on disk.

The ONNX graph comes from the core's ONNX artifact (`outrider.onnx.artifact`: `options.onnx`, or
an export made once), the one the ONNX Runtime backends serve. Building an engine takes minutes, so the engine goes through the core
artifact cache too, keyed by the ONNX file's hash, the TensorRT version, the GPU model, its
compute capability and the build options: a second start deserializes and builds nothing.

Precision lives in the graph, not in builder flags (TensorRT 11 removed the fp16/int8 flags and
builds every network strongly typed): `fp16: true` builds from an fp16 copy of the graph (made
once, cached; inputs and outputs keep their types), and an ONNX file quantized with NVIDIA
ModelOpt (Q/DQ nodes) given as `options.onnx` builds as int8/fp8 the same way.

One optimization profile covers the batch and sequence lengths the manifest allows
(`outrider.onnx.profiles`); a call with more rows runs in pieces. Device and pinned
host buffers for the largest shapes are allocated once per instance, and each call runs with
`execute_async_v3` on the instance's CUDA stream. torch provides the allocator and stream.
A CUDA error fails the instance (it is replaced, and the model is not ready while none serves):
a poisoned context must never keep answering. Importing this plugin imports neither tensorrt
nor torch.

Manifest options: `onnx`, `opset`, `export_timeout_s`, `max_batch` (default:
batching.max_batch_size, else 32), `max_seq_length` (default: the task's), `fp16`, `workspace_mb`,
and the text task's `truncate`, `matryoshka`, `matryoshka_dimensions` (plugins/outrider_text).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from outrider import hookimpl
from outrider.artifacts import Artifact, ArtifactCache
from outrider.backend import Availability, Backend, Task
from outrider.devices import inventory
from outrider.errors import BadRequestError, ExecutionError, OutriderError
from outrider.manifest import Manifest
from outrider.errors import InstanceCrashed
from outrider.onnx.artifact import onnx_model
from outrider.onnx.export import DEFAULT_OPSET  # stdlib only at import: no torch
from outrider.onnx.profiles import ProfileBounds, concat_rows, profile_bounds, profile_shapes, row_chunks

__version__ = "0.1.0"

log = logging.getLogger("outrider.tensorrt")

ENGINE_KIND = "tensorrt-engine"
ENGINE_FILE = "model.engine"


class TensorRTOptions(BaseModel):
    """The `options` of a TensorRT manifest, validated at start."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # schema built on first use

    onnx: Optional[str] = None
    opset: int = Field(DEFAULT_OPSET, ge=7, le=30)
    export_timeout_s: float = Field(900, gt=0)
    max_batch: Optional[int] = Field(None, ge=1, le=65536)
    max_seq_length: Optional[int] = Field(None, ge=2)
    # The text task's own (plugins/outrider_text): what it does with a text past max_seq_length,
    # and the shortened embeddings (`dimensions`) of a model trained for them (Matryoshka).
    truncate: Optional[StrictBool] = Field(None, description="text task: cut a longer text (true, the default) or refuse it")
    matryoshka: Optional[StrictBool] = Field(None, description="text task: the model gives shortened embeddings")
    matryoshka_dimensions: Optional[list[int]] = Field(None, description="text task: the shortened widths allowed")
    fp16: bool = Field(False, description="build from an fp16 copy of the graph (strongly typed)")
    workspace_mb: int = Field(1024, ge=16)


@hookimpl
def outrider_register_backends(register: Callable[[type], None]) -> None:
    """Register the TensorRT backend."""
    register(TensorRTBackend)


def engine_artifact(cache: ArtifactCache, onnx_path: Path, gpu: str, capability: str, tensorrt_version: str,
                    build_options: dict[str, Any], build: Callable[[Path], dict[str, Any]], label: str = "") -> Artifact:
    """The cached engine for this graph, GPU model, compute capability, TensorRT version and options;
    `build(engine_path)` runs only when no entry has that key."""
    return cache.get_or_build(
        ENGINE_KIND, lambda directory, progress: build(directory / ENGINE_FILE),
        label=label or "TensorRT engine", sources=[onnx_path], versions=["tensorrt"],
        device=f"{gpu} sm{capability}",
        # The version goes in the options too: TensorRT ships as tensorrt, tensorrt-cu12, tensorrt-libs...
        options={**build_options, "tensorrt": tensorrt_version},
    )


def fp16_onnx(cache: ArtifactCache, onnx_path: Path, label: str = "") -> Path:
    """An fp16 copy of `onnx_path` (weights and compute in fp16, inputs and outputs as they were),
    made once with onnxruntime's converter and kept in the artifact cache."""
    if importlib.util.find_spec("onnx") is None or importlib.util.find_spec("onnxruntime") is None:
        raise OutriderError("options.fp16 converts the ONNX graph with onnx and onnxruntime's float16 tool; "
                            "install them (pip install 'outrider[onnx,tensorrt]')", code="backend_unavailable")

    def build(directory: Path, progress: Any) -> dict[str, Any]:
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = convert_float_to_float16(onnx.load(str(onnx_path)), keep_io_types=True)
        onnx.save(model, str(directory / "model.onnx"))
        return {"converted_from": str(onnx_path)}

    artifact = cache.get_or_build("onnx-fp16", build, label=label or "fp16 ONNX", sources=[onnx_path],
                                  versions=["onnx", "onnxruntime"], device="any", options={"keep_io_types": True})
    return artifact.file("model.onnx")


def _looks_like_cuda_error(exc: BaseException) -> bool:
    # torch raises RuntimeError (AcceleratorError in 2.8+) with "CUDA error: ..." for sticky faults.
    text = str(exc)
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in text or "cudaError" in text


class TensorRTBackend(Backend):
    """One engine, one execution context, one stream and one set of buffers per instance, on one GPU."""

    name = "tensorrt"
    options_model = TensorRTOptions
    device_kinds = ("cuda",)

    def __init__(self, manifest: Manifest, device: str, task: Optional[Task] = None) -> None:
        super().__init__(manifest, device, task)
        self.engine: Any = None
        self.context: Any = None
        self.engine_path: Optional[Path] = None
        self.gpu: Optional[str] = None
        self.built_now = False
        self.bounds: Optional[ProfileBounds] = None
        #: why this instance must not run again (a CUDA error poisoned its context), or None
        self.poisoned: Optional[str] = None
        self._lock = threading.Lock()  # one execution context: one request at a time

    @classmethod
    def availability(cls, manifest: Optional[Manifest] = None, device: str = "auto") -> Availability:
        """tensorrt and torch installed, and a GPU in the device inventory."""
        base = super().availability(manifest, device)
        if not base.available:
            return base
        if importlib.util.find_spec("tensorrt") is None:
            return Availability(False, "tensorrt is not installed (pip install 'outrider[tensorrt]')")
        if importlib.util.find_spec("torch") is None:
            return Availability(False, "torch (a CUDA build) is needed for device buffers; it is not installed")
        found = inventory()
        if not found.gpus:
            return Availability(False, found.why_none())
        return Availability(True)

    @classmethod
    def resolve_device(cls, device: str) -> str:
        """TensorRT runs on CUDA only."""
        return "cuda" if device == "auto" else device

    # -- load ---------------------------------------------------------------------------------

    def load(self) -> None:
        """Build (or read from the cache) the engine, then a context, a stream and the buffers."""
        import tensorrt as trt
        import torch

        self._trt, self._torch = trt, torch
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._device = torch.device(self.device)
        opts: TensorRTOptions = self.options
        cache = ArtifactCache()
        onnx_path = onnx_model(self.manifest)
        if opts.fp16:
            onnx_path = fp16_onnx(cache, onnx_path, label=f"{self.manifest.name} fp16 ONNX")
        self.bounds = profile_bounds(self.manifest, (self.task.max_length if self.task else None), self.accelerators.batch_policy)
        build_options = {"bounds": self.bounds.__dict__, "fp16": opts.fp16, "workspace_mb": opts.workspace_mb,
                         "strongly_typed": True}
        self.gpu = torch.cuda.get_device_name(self._device)
        capability = ".".join(map(str, torch.cuda.get_device_capability(self._device)))

        def build(engine_path: Path) -> dict[str, Any]:
            self.built_now = True
            return self._build(onnx_path, engine_path, opts.workspace_mb)

        artifact = engine_artifact(cache, onnx_path, self.gpu, capability, trt.__version__, build_options, build,
                                   label=f"{self.manifest.name} TensorRT engine")
        self.engine_path = artifact.file(ENGINE_FILE)
        runtime = trt.Runtime(self._logger)
        self.engine = runtime.deserialize_cuda_engine(self.engine_path.read_bytes())
        if self.engine is None:
            raise OutriderError(f"TensorRT could not deserialize {self.engine_path}; delete it to rebuild")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if n not in self._inputs]
        self._stream = torch.cuda.Stream(self._device)
        self._allocate()

    def _build(self, onnx_path: Path, engine_path: Path, workspace_mb: int) -> dict[str, Any]:
        trt = self._trt
        log.info("model %s: building a TensorRT engine on %s (minutes; cached afterwards)", self.manifest.name, self.gpu)
        start = time.monotonic()
        builder = trt.Builder(self._logger)
        # Strongly typed: precision comes from the graph (fp16 copy, ModelOpt Q/DQ); required for
        # that on TensorRT 10, always on (flag ignored) on 11.
        strongly = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        network = builder.create_network(1 << int(strongly) if strongly is not None else 0)
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise OutriderError(f"TensorRT cannot parse {onnx_path}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
        inputs = {network.get_input(i).name: list(network.get_input(i).shape) for i in range(network.num_inputs)}
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile_shapes(inputs, self.bounds, where=str(onnx_path)).items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise OutriderError(f"TensorRT failed to build an engine from {onnx_path} (see the log above)")
        engine_path.write_bytes(bytes(serialized))  # inside the cache's temporary entry: atomic
        seconds = time.monotonic() - start
        log.info("model %s: built the engine in %.0f s", self.manifest.name, seconds)
        return {"gpu": self.gpu, "build_seconds": round(seconds, 1), "inputs": inputs}

    def _allocate(self) -> None:
        """Device buffers, and pinned host buffers to stage through, for the profile's largest shapes."""
        torch = self._torch
        self._device_buffers: dict[str, Any] = {}
        self._host_buffers: dict[str, Any] = {}
        self._max_shapes: dict[str, tuple[int, ...]] = {}
        for name in self._inputs:
            low, opt, high = self.engine.get_tensor_profile_shape(name, 0)
            self._max_shapes[name] = tuple(high)
            self.context.set_input_shape(name, tuple(high))
        for name in self._outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise OutriderError(f"model {self.manifest.name!r}: output {name!r} has a data-dependent shape "
                                    f"{list(shape)}; this backend needs output shapes that follow from the inputs")
            self._max_shapes[name] = shape
        for name, shape in self._max_shapes.items():
            dtype = _torch_dtype(torch, self._trt, self.engine.get_tensor_dtype(name))
            count = int(np.prod(shape))
            self._device_buffers[name] = torch.empty(count, dtype=dtype, device=self._device)
            self._host_buffers[name] = torch.empty(count, dtype=dtype, pin_memory=True)

    # -- execute ------------------------------------------------------------------------------

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Task feeds -> pieces of at most max_batch rows -> the engine -> task outputs."""
        if self.poisoned:
            raise InstanceCrashed(f"model {self.manifest.name!r}: {self.poisoned}", reason=self.poisoned)
        feeds = self.task.preprocess(inputs) if self.task else inputs
        outputs = self.task.empty_outputs(feeds) if self.task else None
        if outputs is None:
            feeds = {name: feeds[name] for name in self._inputs}
            outputs = concat_rows([self._run(piece) for piece in row_chunks(feeds, self.bounds.max_batch)])
        return self.task.postprocess(outputs, feeds) if self.task else outputs

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        for name, array in feeds.items():
            limit = self._max_shapes[name]
            if array.ndim != len(limit) or any(d > m for d, m in zip(array.shape, limit)):
                raise BadRequestError(f"input {name!r} shape {list(array.shape)} exceeds the engine's {list(limit)}")
        try:
            with self._lock, torch.cuda.stream(self._stream):
                for name, array in feeds.items():
                    count = array.size
                    host = self._host_buffers[name][:count].view(array.shape)
                    host.numpy()[...] = array  # into pinned memory: the copy below is truly asynchronous
                    device = self._device_buffers[name][:count].view(array.shape)
                    device.copy_(host, non_blocking=True)
                    self.context.set_input_shape(name, array.shape)
                    self.context.set_tensor_address(name, device.data_ptr())
                shapes = {}
                for name in self._outputs:
                    shapes[name] = tuple(self.context.get_tensor_shape(name))  # known once inputs are set
                    self.context.set_tensor_address(name, self._device_buffers[name].data_ptr())
                if not self.context.execute_async_v3(self._stream.cuda_stream):
                    raise ExecutionError(f"model {self.manifest.name!r}: TensorRT execute_async_v3 failed")
                results = {}
                for name, shape in shapes.items():
                    count = int(np.prod(shape))
                    host = self._host_buffers[name][:count]
                    host.copy_(self._device_buffers[name][:count], non_blocking=True)
                    results[name] = (host, shape)
                self._stream.synchronize()
                # Copied out of the pinned buffers, which the next call reuses.
                return {name: host.view(shape).numpy().copy() for name, (host, shape) in results.items()}
        except OutriderError:
            raise
        except Exception as exc:
            if not _looks_like_cuda_error(exc):
                raise
            self.poisoned = f"CUDA error on {self.device}: {exc}"
            raise InstanceCrashed(f"model {self.manifest.name!r}: {self.poisoned}", reason=self.poisoned) from None

    # -- health -------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """GPU, TensorRT version, engine file (built now or read from the cache), profile, poisoning."""
        loaded = self.context is not None
        return {
            "healthy": loaded and not self.poisoned,
            **({"reason": self.poisoned} if self.poisoned else {}),
            "device": self.device,
            "gpu": self.gpu,
            "tensorrt": self._trt.__version__ if loaded else None,
            "engine": str(self.engine_path) if loaded else None,
            "engine_built_now": self.built_now,
            "profile": self.bounds.__dict__ if self.bounds else None,
        }

    def unload(self) -> None:
        """Drop the context, engine and buffers (their device memory goes with them)."""
        self.context = None
        self.engine = None
        self._device_buffers = {}
        self._host_buffers = {}


def _torch_dtype(torch: Any, trt: Any, dtype: Any) -> Any:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.int8: torch.int8, trt.bool: torch.bool}
    return table[dtype]
