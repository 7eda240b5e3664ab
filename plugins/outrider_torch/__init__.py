"""`torch` backend: the task's PyTorch module on CPU or CUDA.

It also owns the ONNX export (`python -m outrider_torch.onnx_export`), which the ONNX Runtime
and TensorRT plugins run in a subprocess. Importing this plugin does not import torch; `load`
does, when a manifest asks for this backend.

Manifest options: `threads` (torch intra-op threads; default: the CPUs this process may use).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from outrider import hookimpl
from outrider.backend import Availability, Backend, Task, require_packages, torch_device
from outrider.errors import ExecutionError, ManifestError
from outrider.manifest import Manifest

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

    model_config = ConfigDict(extra="forbid")

    threads: Optional[int] = Field(None, ge=1, le=1024)
    max_seq_length: Optional[int] = Field(None, ge=2, description="text task: longest input in tokens")


class TorchBackend(Backend):
    """Runs the task's torch module (see `outrider_torch.models`) under `inference_mode`."""

    name = "torch"
    options_model = TorchOptions
    device_kinds = ("cpu", "cuda")

    def __init__(self, manifest: Manifest, device: str, task: Optional[Task] = None) -> None:
        super().__init__(manifest, device, task)
        self.model: Optional["torch.nn.Module"] = None
        self.threads: Optional[int] = None
        self.load_seconds: Optional[float] = None

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

        from .models import MODELS, build_model

        start = time.perf_counter()
        where = self.manifest.source_file or self.manifest.name
        task = self.manifest.model.task if self.manifest.model else None
        if task not in MODELS:
            raise ManifestError(f"{where}: field 'model.task': the torch backend runs {sorted(MODELS)}, not {task!r}")
        # Threads are per process in torch: the last torch model loaded sets them for all.
        self.threads = int(self.manifest.options.get("threads") or _default_threads())
        torch.set_num_threads(self.threads)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ManifestError(
                f"{where}: field 'device': {self.device} was asked for, but torch {torch.__version__} sees no CUDA GPU"
            )
        self.model = build_model(task, self.manifest.model_path()).to(self.device)
        self.load_seconds = time.perf_counter() - start

    # -- execute ------------------------------------------------------------------------------

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Task feeds -> tensors on the device -> module -> numpy -> task outputs."""
        import torch

        if self.model is None:
            raise ExecutionError(f"model {self.manifest.name!r}: execute() before load()")
        feeds = self.task.preprocess(inputs) if self.task else inputs
        empty = getattr(self.task, "empty_outputs", None)
        outputs = empty(feeds) if empty else None
        if outputs is None:
            names = getattr(self.model, "input_names", tuple(feeds))
            args = [torch.from_numpy(feeds[name]).to(self.device) for name in names]
            with torch.inference_mode():
                result = self.model(*args)
            output_name = getattr(self.model, "output_name", "output")
            outputs = {output_name: result.float().cpu().numpy()}
        return self.task.postprocess(outputs, feeds) if self.task else outputs

    # -- health -------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """Device, threads and torch version; unhealthy until loaded."""
        if self.model is None:
            return {"healthy": False, "device": self.device, "reason": "not loaded"}
        import torch  # already imported by load(): free here

        return {
            "healthy": True,
            "device": self.device,
            "threads": torch.get_num_threads(),  # live: another torch model may have changed it
            "torch": torch.__version__,
        }

    def metadata(self) -> dict[str, Any]:
        """What `models` replies show about this instance."""
        return {"framework": "torch", "device": self.device, "threads": self.threads}

    def unload(self) -> None:
        """Drop the module (and, on CUDA, its cached memory)."""
        self.model = None
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
