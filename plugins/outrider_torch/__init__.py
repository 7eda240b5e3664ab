"""`torch` backend: the task's PyTorch module on CPU or CUDA.

The task's module is `outrider.torch_modules`, in the core, because the ONNX export the ONNX
Runtime and TensorRT backends serve (`outrider.onnx.export`) traces the same module. Importing
this plugin does not import torch; `load` does, when a manifest asks for this backend.

Manifest options: `threads` (torch intra-op threads on CPU; default: the CPUs this process may
use; torch has one pool per process, see `outrider.torch_process`), `dtype` (auto | float32 |
float16 | bfloat16: the module's precision on CUDA; auto is float16 there; CPU runs float32), and
the text task's `max_seq_length`, `truncate`, `matryoshka`, `matryoshka_dimensions` (plugins/outrider_text).

On CUDA each instance has its own stream and pinned host buffers: inputs are staged in page-locked
memory and copied without blocking, the module runs on the instance's stream, and the output comes
back the same way before one synchronize. A CUDA error that poisons the context makes `health()`
unhealthy for good; an out-of-memory error fails that call only (and warmup, so the model does
not become ready).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from outrider import hookimpl
from outrider.backend import Availability, Backend, Task, require_packages, torch_device
from outrider.errors import ExecutionError, ManifestError
from outrider.manifest import Manifest
from outrider.torch_process import CudaHealth, is_out_of_memory, release_cpu_threads, set_torch_threads

if TYPE_CHECKING:
    import torch

__version__ = "0.1.0"


@hookimpl
def outrider_register_backends(register: Callable[[type], None]) -> None:
    """Register the torch backend."""
    register(TorchBackend)


def _default_threads() -> int:
    # The CPUs this process may run on, not the machine's count (containers, taskset).
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class TorchOptions(BaseModel):
    """The `options` of a PyTorch manifest, validated at start."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # schema built on first use

    threads: Optional[int] = Field(None, ge=1, le=1024)
    max_seq_length: Optional[int] = Field(None, ge=2, description="text task: longest input in tokens")
    # The text task's own (plugins/outrider_text): what it does with a text past max_seq_length,
    # and the shortened embeddings (`dimensions`) of a model trained for them (Matryoshka).
    truncate: Optional[StrictBool] = Field(None, description="text task: cut a longer text (true, the default) or refuse it")
    matryoshka: Optional[StrictBool] = Field(None, description="text task: the model gives shortened embeddings")
    matryoshka_dimensions: Optional[list[int]] = Field(None, description="text task: the shortened widths allowed")
    dtype: Literal["auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16"] = Field(
        "auto", description="precision of the module on CUDA (auto: float16); CPU runs float32")


_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}


def compute_dtype(option: str, device: str) -> str:
    """The module's precision for the manifest's `dtype` on `device` ("float32", "float16", "bfloat16")."""
    if device.startswith("cuda"):
        return "float16" if option == "auto" else _DTYPES[option]
    return "float32" if option == "auto" else _DTYPES[option]


class TorchBackend(Backend):
    """Runs the task's torch module (see `outrider.torch_modules`) under `inference_mode`."""

    name = "torch"
    options_model = TorchOptions
    device_kinds = ("cpu", "cuda")

    def __init__(self, manifest: Manifest, device: str, task: Optional[Task] = None) -> None:
        super().__init__(manifest, device, task)
        self.model: Optional["torch.nn.Module"] = None
        self.threads: Optional[int] = None
        self.load_seconds: Optional[float] = None
        self.dtype = "float32"
        # CUDA only: the instance's stream, pinned staging buffers (by name), and its health.
        self.stream: Any = None
        self._pinned: dict[str, "torch.Tensor"] = {}
        self._phase = "execute"  # or "warmup": out of memory then leaves the instance not ready
        self.cuda_health: Optional[CudaHealth] = CudaHealth(device) if device.startswith("cuda") else None

    @classmethod
    def availability(cls, manifest: Optional[Manifest] = None, device: str = "auto") -> Availability:
        """Torch must be installed; no import here, because `import torch` costs seconds."""
        base = super().availability(manifest, device)
        if not base.available:
            return base
        return require_packages(("torch", "transformers"), "torch")

    @classmethod
    def resolve_device(cls, device: str) -> str:
        """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'."""
        return torch_device(device)

    # -- load ---------------------------------------------------------------------------------

    def load(self) -> None:
        """Build the task's module from the model directory, move it to the device."""
        import torch

        from outrider.torch_modules import MODELS, build_model

        start = time.perf_counter()
        where = self.manifest.where
        task = self.manifest.model.task if self.manifest.model else None
        if task not in MODELS:
            raise ManifestError(f"{where}: field 'model.task': the torch backend runs {sorted(MODELS)}, not {task!r}")
        options = self.options
        self.dtype = compute_dtype(options.dtype, self.device)
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ManifestError(
                    f"{where}: field 'device': {self.device} was asked for, but torch {torch.__version__} sees no CUDA GPU"
                )
            if self.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
                raise ManifestError(f"{where}: field 'options.dtype': {torch.cuda.get_device_name(self.device)} "
                                    "has no bfloat16; use float16")
        elif self.dtype != "float32":
            raise ManifestError(f"{where}: field 'options.dtype': {options.dtype} runs on CUDA only; "
                                f"this instance is on {self.device} (use auto or float32)")
        else:
            # Threads are per process in torch: the first torch model sets them (see torch_process).
            self.threads = set_torch_threads(int(options.threads or _default_threads()), f"model {self.manifest.name!r}")
        try:
            model = build_model(task, self.manifest.model_path())
            self.model = model.to(self.device, dtype=getattr(torch, self.dtype))
            if self.device.startswith("cuda"):
                self.stream = torch.cuda.Stream(device=self.device)
        except Exception as exc:
            if self.cuda_health is not None:
                self.cuda_health.record(exc, "load")
            raise
        self.load_seconds = time.perf_counter() - start

    def warmup(self) -> None:
        """The manifest's warmup inputs; out of GPU memory here fails the load with that reason."""
        self._phase = "warmup"
        try:
            super().warmup()
        finally:
            self._phase = "execute"

    # -- execute ------------------------------------------------------------------------------

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Task feeds -> tensors on the device -> module -> numpy -> task outputs."""
        import torch

        if self.model is None:
            raise ExecutionError(f"model {self.manifest.name!r}: execute() before load()")
        feeds = self.task.preprocess(inputs) if self.task else inputs
        outputs = self.task.empty_outputs(feeds) if self.task else None
        if outputs is None:
            names = getattr(self.model, "input_names", tuple(feeds))
            output_name = getattr(self.model, "output_name", "output")
            if self.stream is not None:
                outputs = {output_name: self._execute_cuda(names, feeds)}
            else:
                args = [torch.from_numpy(feeds[name]) for name in names]
                with torch.inference_mode():
                    result = self.model(*args)
                outputs = {output_name: result.float().numpy()}
        return self.task.postprocess(outputs, feeds) if self.task else outputs

    def _staging(self, name: str, like: "torch.Tensor") -> "torch.Tensor":
        """A pinned host tensor shaped like `like`, from a buffer kept per name and grown as needed."""
        import torch

        buffer = self._pinned.get(name)
        if buffer is None or buffer.dtype != like.dtype or buffer.numel() < like.numel():
            buffer = torch.empty(max(like.numel(), 1), dtype=like.dtype, pin_memory=True)
            self._pinned[name] = buffer
        return buffer[: like.numel()].view(like.shape)

    def _execute_cuda(self, names: tuple, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """Pinned host -> device (non-blocking) on this instance's stream, module, device -> pinned host."""
        import torch

        try:
            with torch.inference_mode(), torch.cuda.stream(self.stream):
                args = []
                for name in names:
                    host = torch.from_numpy(np.ascontiguousarray(feeds[name]))
                    staged = self._staging(name, host)
                    staged.copy_(host)
                    args.append(staged.to(self.device, non_blocking=True))
                result = self.model(*args).float()
                out = self._staging("(output)", result)
                out.copy_(result, non_blocking=True)
            # The staging buffers are reused by the next call: it may only start after this one.
            self.stream.synchronize()
            return out.numpy().copy()
        except Exception as exc:
            self.cuda_health.record(exc, self._phase)
            if is_out_of_memory(exc):
                raise ExecutionError(f"model {self.manifest.name!r}: out of GPU memory on {self.device} during "
                                     f"{self._phase}: {str(exc).splitlines()[0]}") from None
            raise

    # -- health -------------------------------------------------------------------------------

    def idle(self) -> None:
        """Waiting for work: hand this thread's OpenMP team back, so that a busy torch model beside
        this one keeps libgomp's fast path (see outrider.torch_process)."""
        if self.device.startswith("cpu"):
            release_cpu_threads()

    def health(self) -> dict[str, Any]:
        """Device, threads and torch version; unhealthy until loaded."""
        if self.cuda_health is not None and self.cuda_health.fault is not None:
            return {"device": self.device, "dtype": self.dtype, **self.cuda_health.report()}
        if self.model is None:
            return {"healthy": False, "device": self.device, "reason": "not loaded"}
        import torch  # already imported by load(): free here

        out = {"healthy": True, "device": self.device, "dtype": self.dtype, "torch": torch.__version__}
        if self.cuda_health is not None:
            out.update(self.cuda_health.report())
        else:
            out["threads"] = torch.get_num_threads()  # live: what this process's torch runs with
        return out

    def metadata(self) -> dict[str, Any]:
        """What `models` replies show about this instance."""
        return {"framework": "torch", "device": self.device, "threads": self.threads, "dtype": self.dtype}

    def unload(self) -> None:
        """Drop the module (and, on CUDA, its stream, staging buffers and cached memory)."""
        self.model = None
        self._pinned = {}
        self.stream = None
        if self.device.startswith("cuda") and (self.cuda_health is None or self.cuda_health.fault is None):
            import torch

            torch.cuda.empty_cache()
