"""ONNX Runtime backends: one per execution provider, and `onnxruntime` for the best one here.

| backend                | providers asked for, in order                  | devices   |
|------------------------|------------------------------------------------|-----------|
| `onnxruntime-tensorrt` | TensorRT, CUDA, CPU                            | cuda      |
| `onnxruntime-cuda`     | CUDA, CPU                                      | cuda      |
| `onnxruntime-cpu`      | CPU                                            | cpu       |
| `onnxruntime`          | those of TensorRT, CUDA, CPU this build has    | cpu, cuda |

ORT falls back to a later provider without raising when one fails to load; the backend
compares what it asked for with what it got, logs a warning, and shows it in `health()`.
onnxruntime is imported inside methods only, so importing this plugin stays cheap.

Manifest options: `onnx` (a file, relative to the manifest; else exported and cached),
`opset`, `export_timeout_s`, `intra_op_threads` (default: physical cores), `fp16` (TensorRT
provider), `provider_options` ({provider name: {option: value}}, passed to ORT).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import numpy as np

from pydantic import BaseModel, ConfigDict, Field

from outrider import hookimpl
from outrider.artifacts import Artifact
from outrider.backend import Availability, Backend, Task
from outrider.errors import ExecutionError
from outrider.manifest import Manifest

from .cores import physical_cores
from outrider_torch.onnx_export import DEFAULT_OPSET  # stdlib-only module: no torch

from .onnx_artifact import cache_dir, onnx_model

if TYPE_CHECKING:
    import onnxruntime

__version__ = "0.1.0"

log = logging.getLogger("outrider.onnxruntime")

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
_GPU_PROVIDERS = (TENSORRT, CUDA)
_INSTALL_HINT = {TENSORRT: "install onnxruntime-gpu and TensorRT", CUDA: "install onnxruntime-gpu"}


class OrtOptions(BaseModel):
    """The `options` of an ONNX Runtime manifest, validated at start."""

    model_config = ConfigDict(extra="forbid")

    onnx: Optional[str] = Field(None, description="an ONNX file (relative to the manifest); else exported")
    opset: int = Field(DEFAULT_OPSET, ge=7, le=30)
    export_timeout_s: float = Field(900, gt=0)
    intra_op_threads: Optional[int] = Field(None, ge=1, le=1024)
    fp16: bool = False
    provider_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    max_seq_length: Optional[int] = Field(None, ge=2, description="text task: longest input in tokens")


@hookimpl
def outrider_register_backends(register: Callable[[type], None]) -> None:
    """Register the ONNX Runtime backends."""
    for cls in (OnnxRuntimeBackend, OnnxRuntimeTensorRTBackend, OnnxRuntimeCUDABackend, OnnxRuntimeCPUBackend):
        register(cls)


class OnnxRuntimeBackend(Backend):
    """An ORT InferenceSession over the manifest's ONNX graph (given, or exported and cached)."""

    name = "onnxruntime"
    options_model = OrtOptions
    device_kinds = ("cpu", "cuda")
    #: execution providers in order of preference.
    providers: ClassVar[tuple[str, ...]] = (TENSORRT, CUDA, CPU)
    #: the provider without which this backend is pointless (None: any of `providers` will do).
    required: ClassVar[Optional[str]] = None
    #: ask only for the providers this build has (the preference backend), rather than for
    #: exactly `providers`, where a missing one must show up as a fallback.
    take_what_is_built: ClassVar[bool] = True

    def __init__(self, manifest: Manifest, device: str, task: Optional[Task] = None) -> None:
        super().__init__(manifest, device, task)
        self.session: Optional["onnxruntime.InferenceSession"] = None
        self.onnx_path: Optional[Path] = None
        self.requested_providers: list[str] = []
        self.active_providers: list[str] = []
        self.fallback: Optional[str] = None
        self.intra_op_threads: Optional[int] = None
        self.session_seconds: Optional[float] = None
        self._input_names: list[str] = []
        self._output_names: list[str] = []
        self._use_io_binding = False

    # -- availability -------------------------------------------------------------------------

    @classmethod
    def availability(cls, manifest: Optional[Manifest] = None, device: str = "auto") -> Availability:
        """onnxruntime importable, the needed provider in this build, and an ONNX source."""
        base = super().availability(manifest, device)
        if not base.available:
            return base
        if importlib.util.find_spec("onnxruntime") is None:
            return Availability(False, "onnxruntime is not installed (pip install 'outrider[onnx]')")
        import onnxruntime  # about 0.1 s, and needed to list the providers

        built = onnxruntime.get_available_providers()
        needed = cls.required or (CUDA if device.startswith("cuda") else None)
        if needed and needed not in built:
            return Availability(
                False,
                f"{needed} is not in this onnxruntime build (installed: onnxruntime "
                f"{onnxruntime.__version__} with {', '.join(built)}); {_INSTALL_HINT[needed]}",
            )
        if manifest is not None and not manifest.options.get("onnx"):
            for package in ("torch", "transformers"):
                if importlib.util.find_spec(package) is None:
                    return Availability(
                        False,
                        f"no ONNX file: set options.onnx, or install {package} "
                        "(pip install 'outrider[torch]') so the model can be exported once",
                    )
        return Availability(True)

    @classmethod
    def resolve_device(cls, device: str) -> str:
        """'auto' -> 'cuda' when this backend (and build) has a GPU provider, else 'cpu'."""
        if device != "auto":
            return device
        if "cuda" not in cls.device_kinds:
            return "cpu"
        if "cpu" not in cls.device_kinds:
            return "cuda"
        import onnxruntime

        return "cuda" if CUDA in onnxruntime.get_available_providers() else "cpu"

    def _providers_to_request(self, built: list[str]) -> list[str]:
        if not self.device.startswith("cuda"):
            return [CPU]
        if self.take_what_is_built:
            return [p for p in self.providers if p in built] or [CPU]
        return list(self.providers)

    def _provider_options(self, provider: str) -> dict[str, Any]:
        device_id = int(self.device.split(":")[1]) if ":" in self.device else 0
        extra = dict(self.manifest.options.get("provider_options", {}).get(provider, {}))
        if provider == TENSORRT:
            # TensorRT builds an engine per shape profile, which takes minutes: keep it on disk.
            engines = cache_dir() / "ort-tensorrt"
            return {"device_id": device_id, "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": str(engines), "trt_timing_cache_enable": True,
                    "trt_timing_cache_path": str(engines),
                    "trt_fp16_enable": bool(self.manifest.options.get("fp16", False)), **extra}
        if provider == CUDA:
            return {"device_id": device_id, **extra}
        return extra

    # -- load ---------------------------------------------------------------------------------

    def load(self) -> None:
        """Find or export the ONNX graph, then open a session on the requested providers."""
        import onnxruntime

        source = Artifact(onnx_model(self.manifest), "onnx")
        # Quantization (and later engine builds) run here, before the session opens; the task
        # turns sentences into feeds and outputs into embeddings for the quality gate.
        self.onnx_path = self.transform_artifact(source, feeds=self._gate_feeds, postprocess=self._gate_outputs).path
        options = onnxruntime.SessionOptions()
        self.intra_op_threads = int(self.manifest.options.get("intra_op_threads") or physical_cores())
        options.intra_op_num_threads = self.intra_op_threads
        # One request runs one graph; parallel branches are rare in these models, and a second
        # pool would only compete with the first for the same cores.
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Not cached: saving the optimized graph (optimized_model_filepath) saved ~10 ms of a
        # ~120 ms session start for MiniLM, and that file is specific to this CPU.
        self.requested_providers = self._providers_to_request(onnxruntime.get_available_providers())
        providers = [(p, self._provider_options(p)) for p in self.requested_providers]

        start = time.perf_counter()
        self.session = onnxruntime.InferenceSession(str(self.onnx_path), options, providers=providers)
        self.session_seconds = time.perf_counter() - start
        self.active_providers = list(self.session.get_providers())
        self._input_names = [i.name for i in self.session.get_inputs()]
        self._output_names = [o.name for o in self.session.get_outputs()]
        self._use_io_binding = any(p in self.active_providers for p in _GPU_PROVIDERS)

        missing = [p for p in self.requested_providers if p not in self.active_providers]
        if missing:
            self.fallback = (
                f"asked for {', '.join(self.requested_providers)}; onnxruntime activated only "
                f"{', '.join(self.active_providers)} ({', '.join(missing)} failed to load or is not in this build)"
            )
            log.warning("model %s on %s: %s", self.manifest.name, self.device, self.fallback)

    def _gate_feeds(self, sentences: list[str]) -> dict[str, np.ndarray]:
        if self.task is None:
            raise ExecutionError(f"model {self.manifest.name!r}: a quality gate on text needs a task")
        return self.task.preprocess({self.manifest.inputs[0].name: np.array(sentences, dtype=object)})

    def _gate_outputs(self, outputs: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
        result = self.task.postprocess(outputs, feeds) if self.task else outputs
        return next(iter(result.values()))

    # -- execute ------------------------------------------------------------------------------

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Task feeds -> session -> task outputs; an empty batch never reaches the session."""
        if self.session is None:
            raise ExecutionError(f"model {self.manifest.name!r}: execute() before load()")
        feeds = self.task.preprocess(inputs) if self.task else inputs
        empty = getattr(self.task, "empty_outputs", None)
        outputs = empty(feeds) if empty else None
        if outputs is None:
            missing = [n for n in self._input_names if n not in feeds]
            if missing:
                raise ExecutionError(
                    f"model {self.manifest.name!r}: the ONNX graph needs inputs {missing}; got {sorted(feeds)}"
                )
            # Only what the graph declares: exports often drop an input they never use.
            graph_feeds = {name: feeds[name] for name in self._input_names}
            if self._use_io_binding:
                outputs = self._run_bound(graph_feeds)
            else:
                outputs = dict(zip(self._output_names, self.session.run(self._output_names, graph_feeds)))
        return self.task.postprocess(outputs, feeds) if self.task else outputs

    def _run_bound(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # On a GPU, IOBinding copies each input to the device once and writes outputs straight
        # into host memory, instead of ORT staging both through its own temporaries per run.
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in self._output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        return dict(zip(self._output_names, binding.copy_outputs_to_cpu()))

    # -- health -------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """Providers asked for and active, and any silent fallback between them."""
        return {
            "healthy": self.session is not None,
            "device": self.device,
            "requested_providers": self.requested_providers,
            "active_providers": self.active_providers,
            "fallback": self.fallback,
            "intra_op_threads": self.intra_op_threads,
            "onnx": str(self.onnx_path) if self.onnx_path else None,
        }

    def metadata(self) -> dict[str, Any]:
        """What `models` replies show about this instance."""
        return {"framework": "onnxruntime", "providers": self.active_providers, "fallback": self.fallback}

    def unload(self) -> None:
        """Drop the session; ORT frees its memory with it."""
        self.session = None


class OnnxRuntimeTensorRTBackend(OnnxRuntimeBackend):
    """ORT with the TensorRT provider first (CUDA, then CPU, for nodes TensorRT cannot take)."""

    name = "onnxruntime-tensorrt"
    device_kinds = ("cuda",)
    providers = (TENSORRT, CUDA, CPU)
    required = TENSORRT
    take_what_is_built = False


class OnnxRuntimeCUDABackend(OnnxRuntimeBackend):
    """ORT on the CUDA provider, CPU for nodes it lacks."""

    name = "onnxruntime-cuda"
    device_kinds = ("cuda",)
    providers = (CUDA, CPU)
    required = CUDA
    take_what_is_built = False


class OnnxRuntimeCPUBackend(OnnxRuntimeBackend):
    """ORT on the CPU provider only."""

    name = "onnxruntime-cpu"
    device_kinds = ("cpu",)
    providers = (CPU,)
    take_what_is_built = False
