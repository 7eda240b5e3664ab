"""ONNX Runtime backends: one per execution provider, and `onnxruntime` for the best one here.

| backend                | providers asked for, in order                  | devices   |
|------------------------|------------------------------------------------|-----------|
| `onnxruntime-tensorrt` | TensorRT, CUDA, CPU                            | cuda      |
| `onnxruntime-cuda`     | CUDA, CPU                                      | cuda      |
| `onnxruntime-cpu`      | CPU                                            | cpu       |
| `onnxruntime`          | those of TensorRT, CUDA, CPU this build has    | cpu, cuda |

ORT falls back to a later provider without raising when one fails to load; the backend
compares what it asked for with what it got, logs a warning, shows it in `health()`, and with
`options.on_fallback: error` refuses to serve. On a GPU it also records, during warmup, which
provider ran each node (ORT's profiler), so compute nodes left on the CPU show up too.
onnxruntime is imported inside methods only, so importing this plugin stays cheap.

On a GPU, inputs and outputs go through I/O binding into device buffers that are reused by
later calls of the same shapes. The TensorRT provider keeps its engines and timing cache in a
directory of the core artifact cache keyed by the ONNX file, the GPU, the onnxruntime and
TensorRT versions and the options, with an explicit optimization profile from the manifest
(`outrider.onnx.profiles`), so a second start builds nothing.

Manifest options: `onnx` (a file, relative to the manifest; else exported and cached),
`opset`, `export_timeout_s`, `intra_op_threads` (default: physical cores), `fp16` (TensorRT
provider), `max_batch` and `max_seq_length` (the TensorRT profile), `provider_options`
({provider name: {option: value}}, passed to ORT; `device_id` comes from placement),
`on_fallback` (`warn` or `error`), `io_binding` (default: on when a GPU provider runs), and the
text task's `truncate`, `matryoshka`, `matryoshka_dimensions` (plugins/outrider_text).

Here: the backends and their registration; beside it `providers` (which to ask for, what ORT did
with them), `options` (the manifest's options, each provider's options), `saved_forms` (the graph
as ORT opens it fastest), `io_binding` (device buffers reused per shape), `profiles` (TensorRT's).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional

import numpy as np

from outrider import hookimpl
from outrider.artifacts import PROVENANCE, Artifact, ArtifactCache
from outrider.backend import Availability, Backend, Task
from outrider.bake import BakedFiles, BakesModel
from outrider.devices import explain, inventory
from outrider.errors import ArtifactError, BackendUnavailableError, ExecutionError, ManifestError
from outrider.manifest import Manifest
from outrider.onnx.artifact import onnx_model
from outrider.onnx.profiles import concat_rows, profile_bounds, profile_shapes, row_chunks

from outrider.hardware import physical_cores
from .io_binding import IoBinding
from .options import OrtOptions, build_provider_options
from .profiles import onnx_input_dims, ort_profile_options
from .providers import (CPU, CUDA, GPU_PROVIDERS, INSTALL_HINT, TENSORRT, device_id, fallback_report,
                        node_fallback_report, node_placement, providers_to_request)
from .saved_forms import SESSION_DATA, SESSION_FORM_MIN_BYTES, mapped_form, session_form

if TYPE_CHECKING:
    import onnxruntime

__version__ = "0.1.0"

log = logging.getLogger("outrider.onnxruntime")

#: onnxruntime's exception types (onnxruntime.capi.onnxruntime_pybind11_state) that blame the
#: model file, not the moment: opening the same file again fails the same way
_BAD_FILE_ERRORS = frozenset({"InvalidProtobuf", "InvalidGraph", "NoSuchFile", "NoModel", "NotImplemented"})


@hookimpl
def outrider_register_backends(register: Callable[[type], None]) -> None:
    """Register the ONNX Runtime backends."""
    for cls in (OnnxRuntimeBackend, OnnxRuntimeTensorRTBackend, OnnxRuntimeCUDABackend, OnnxRuntimeCPUBackend):
        register(cls)


class OnnxRuntimeBackend(Backend, BakesModel):
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
        self.on_fallback = "warn"
        #: {provider: Counter(op type)} from warmup's profile (GPU sessions), and what it means
        self.node_placement: Optional[dict[str, Counter]] = None
        self.node_fallback: Optional[str] = None
        self.engine_dir: Optional[Path] = None
        self.profile_bounds = None
        self._profile_dir: Optional[str] = None
        self._use_io_binding = False
        self.io_binding: Optional[IoBinding] = None  # the session's bound run, when `_use_io_binding`

    @classmethod
    def bake_files(cls, manifest: Manifest, raw: Mapping[str, Any]) -> BakedFiles:
        """`outrider bake`: the graph (exported now if the cache lacks it) as model.onnx, its initializers
        beside it in model.data (`mapped_form`: opened as it is, nothing built at start). A manifest
        with a `quantize` section is refused: quantizing needs the onnx package at start."""
        if raw.get("quantize"):
            raise ManifestError(f"{manifest.where}: has a 'quantize' section, which needs "
                                "the onnx package at start; serve it from the full image")
        graph = mapped_form(onnx_model(manifest))
        return BakedFiles({"model.onnx": graph, SESSION_DATA: graph.parent / SESSION_DATA}, {"onnx": "model.onnx"},
                          f"the ONNX graph is exported already (model.onnx, its weights in {SESSION_DATA}, mapped "
                          "at start), so serving this directory needs onnxruntime and tokenizers, not torch.")

    # -- availability -------------------------------------------------------------------------

    @classmethod
    def availability(cls, manifest: Optional[Manifest] = None, device: str = "auto") -> Availability:
        """onnxruntime importable, the needed provider in this build, a GPU for 'auto', and an ONNX source."""
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
                f"{onnxruntime.__version__} with {', '.join(built)}); {INSTALL_HINT[needed]}",
            )
        if needed and device == "auto" and not inventory().gpus:
            # 'auto' asks for the best device that is here; an explicit 'cuda' is taken at its word.
            return Availability(False, f"device auto: {inventory().why_none()}")
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
        """'auto' -> 'cuda' when this build has the CUDA provider and the inventory finds a GPU, else 'cpu'."""
        return cls.choose_device(device)[0]

    @classmethod
    def choose_device(cls, device: str) -> tuple[str, str]:
        """(device, why): for 'auto', which GPU(s), or why the CPU."""
        if device != "auto":
            return device, f"{device}: as the manifest asks"
        found = inventory()
        if "cuda" not in cls.device_kinds:
            return "cpu", explain(device, "cpu", found, cls.device_kinds)
        if "cpu" not in cls.device_kinds:
            return "cuda", explain(device, "cuda", found, cls.device_kinds)
        import onnxruntime

        if CUDA not in onnxruntime.get_available_providers():
            if found.gpus:
                return "cpu", (f"cpu: {found.count} GPU(s) found, but this onnxruntime build has no "
                               f"{CUDA} ({INSTALL_HINT[CUDA]})")
            return "cpu", explain(device, "cpu", found, cls.device_kinds)
        chosen = "cuda" if found.gpus else "cpu"
        return chosen, explain(device, chosen, found, cls.device_kinds)

    # -- load ---------------------------------------------------------------------------------

    def source_artifact(self) -> Artifact:
        """The ONNX graph: the manifest's own file, or exported once from its model and cached."""
        return Artifact(onnx_model(self.manifest), "onnx")

    def gate_helpers(self) -> dict[str, Any]:
        # The task turns sentences into feeds and outputs into embeddings for the quality gate.
        return {"feeds": self._gate_feeds, "postprocess": self._gate_outputs}

    def load(self) -> None:
        """Find or export the ONNX graph, then open a session on the requested providers."""
        import onnxruntime

        opts: OrtOptions = self.options
        self.on_fallback = opts.on_fallback
        if self.artifact is None:  # used outside the core (a test, a tool): prepare as the core would
            self.prepare_artifact()
        self.onnx_path = self.artifact.path  # the graph after the manifest's transforms (quantization)
        options = onnxruntime.SessionOptions()
        self.intra_op_threads = int(opts.intra_op_threads or physical_cores())
        options.intra_op_num_threads = self.intra_op_threads
        # One request runs one graph; parallel branches are rare in these models, and a second
        # pool would only compete with the first for the same cores.
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.requested_providers = providers_to_request(
            self.device, self.providers, onnxruntime.get_available_providers(), self.take_what_is_built)
        self.session_path = Path(self.onnx_path)
        if self.requested_providers == [CPU] and self.session_path.stat().st_size >= SESSION_FORM_MIN_BYTES:
            try:
                self.session_path = session_form(Path(self.onnx_path))
            except Exception as exc:  # a read-only cache, a graph ORT cannot save: the file as it is
                log.warning("model %s: serving %s as it is (its CPU session form could not be built: %s: %s)",
                            self.manifest.name, self.onnx_path, type(exc).__name__, exc)
        gpu_asked = any(p in self.requested_providers for p in GPU_PROVIDERS)
        if gpu_asked:
            # The profiler names the provider that ran each node: warmup reads it, then stops it.
            self._profile_dir = tempfile.mkdtemp(prefix="outrider-ort-profile-")
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(self._profile_dir, "warmup")
        profile: dict[str, str] = {}
        if TENSORRT in self.requested_providers:
            profile = self._tensorrt_profile()
            self.engine_dir = self._tensorrt_cache_dir(profile)
        providers = [(p, build_provider_options(p, self.device, opts, self.engine_dir, profile))
                     for p in self.requested_providers]

        start = time.perf_counter()
        try:
            self.session = onnxruntime.InferenceSession(str(self.session_path), options, providers=providers)
        except Exception as exc:
            if type(exc).__name__ in _BAD_FILE_ERRORS:
                # The file itself is what fails (truncated, not ONNX, gone, an op this build lacks):
                # every restart would open the same file, so the model fails once and says so.
                raise ArtifactError(
                    f"model {self.manifest.name!r}: onnxruntime {onnxruntime.__version__} cannot open "
                    f"{self.onnx_path}: {exc}") from None
            if gpu_asked and self.on_fallback == "error":
                raise BackendUnavailableError(
                    f"model {self.manifest.name!r}: options.on_fallback is 'error' and onnxruntime could not open "
                    f"a session on {', '.join(self.requested_providers)}: {exc}") from None
            raise
        self.session_seconds = time.perf_counter() - start
        self.active_providers = list(self.session.get_providers())
        self._input_names = [i.name for i in self.session.get_inputs()]
        self._output_names = [o.name for o in self.session.get_outputs()]
        gpu_active = any(p in self.active_providers for p in GPU_PROVIDERS)
        self._use_io_binding = opts.io_binding if opts.io_binding is not None else gpu_active
        bind_device = ("cuda" if gpu_active else "cpu", device_id(self.device) if gpu_active else 0)
        self.io_binding = IoBinding(self.session, self._output_names, bind_device) if self._use_io_binding else None
        if TENSORRT in self.active_providers and self.engine_dir is not None:
            self._note_engine_cache(profile)

        self.fallback = fallback_report(self.requested_providers, self.active_providers)
        self._on_fallback(self.fallback)

    def _tensorrt_profile(self) -> dict[str, str]:
        """The TensorRT provider's explicit profile from the manifest (needs `onnx` to read the inputs)."""
        bounds = profile_bounds(self.manifest, (self.task.max_length if self.task else None), self.accelerators.batch_policy)
        self.profile_bounds = bounds
        dims = onnx_input_dims(self.onnx_path)
        if dims is None:
            log.warning("model %s: the onnx package is not installed, so no TensorRT profile is set: TensorRT "
                        "builds a new engine whenever a larger shape arrives (pip install onnx)", self.manifest.name)
            return {}
        return ort_profile_options(profile_shapes(dims, bounds, where=str(self.onnx_path)))

    def _tensorrt_cache_dir(self, profile: dict[str, str]) -> Path:
        """A directory of the artifact cache for this graph's engines on this GPU, with these options."""
        gpu = inventory().gpu(self.device)
        where = f"{gpu.name} sm{gpu.compute_capability}" if gpu else f"{self.device} (not in the inventory)"
        cache = ArtifactCache()
        self._engine_key = cache.key(
            "ort-tensorrt", sources=[self.onnx_path],
            versions=["onnxruntime-gpu", "onnxruntime", "tensorrt", "tensorrt-cu12", "tensorrt-cu13"],
            device=where, options={"fp16": self.options.fp16, **profile,
                                   **self.options.provider_options.get(TENSORRT, {})})
        directory = cache.entry("ort-tensorrt", self._engine_key[0])
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def _on_fallback(self, report: Optional[str]) -> None:
        """Log a fall-back (of the session, or of some nodes) and refuse it under `on_fallback: error`."""
        if not report:
            return
        log.warning("model %s on %s: %s", self.manifest.name, self.device, report)
        if self.on_fallback == "error":
            raise BackendUnavailableError(f"model {self.manifest.name!r}: options.on_fallback is 'error': {report}")

    def _note_engine_cache(self, profile: dict[str, str]) -> None:
        # ORT writes the engines itself; the provenance file makes `outrider cache` list the entry.
        target = self.engine_dir / PROVENANCE
        if target.exists():
            return
        digest, parts = self._engine_key
        record = {"kind": "ort-tensorrt", "label": f"{self.manifest.name} TensorRT provider engines",
                  "key": digest, **parts, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, target)

    def _gate_feeds(self, sentences: list[str]) -> dict[str, np.ndarray]:
        if self.task is None:
            raise ExecutionError(f"model {self.manifest.name!r}: a quality gate on text needs a task")
        return self.task.preprocess({self.manifest.inputs[0].name: np.array(sentences, dtype=object)})

    def _gate_outputs(self, outputs: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
        result = self.task.postprocess(outputs, feeds) if self.task else outputs
        return next(iter(result.values()))

    # -- warmup -------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Run the warmup inputs; on a GPU, then read from the profiler which provider ran each node."""
        super().warmup()
        if self._profile_dir is None or self.session is None:
            return
        try:
            path = self.session.end_profiling()  # stops profiling: later calls pay nothing for it
            with open(path) as f:
                self.node_placement = node_placement(json.load(f))
        except (OSError, ValueError) as exc:
            log.warning("model %s: could not read which provider ran each node: %s", self.manifest.name, exc)
            return
        finally:
            for leftover in Path(self._profile_dir).glob("*"):
                leftover.unlink(missing_ok=True)
            os.rmdir(self._profile_dir)
            self._profile_dir = None
        self.node_fallback = node_fallback_report(self.node_placement, self.active_providers)
        self._on_fallback(self.node_fallback)

    # -- execute ------------------------------------------------------------------------------

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Task feeds -> session -> task outputs; an empty batch never reaches the session."""
        if self.session is None:
            raise ExecutionError(f"model {self.manifest.name!r}: execute() before load()")
        feeds = self.task.preprocess(inputs) if self.task else inputs
        outputs = self.task.empty_outputs(feeds) if self.task else None
        if outputs is None:
            missing = [n for n in self._input_names if n not in feeds]
            if missing:
                raise ExecutionError(
                    f"model {self.manifest.name!r}: the ONNX graph needs inputs {missing}; got {sorted(feeds)}"
                )
            # Only what the graph declares: exports often drop an input they never use.
            graph_feeds = {name: feeds[name] for name in self._input_names}
            run = self.io_binding.run if self._use_io_binding else self._run
            if self.profile_bounds is not None and TENSORRT in self.active_providers:
                # Past the profile's batch TensorRT would build another engine: run in pieces.
                outputs = concat_rows([run(piece) for piece in row_chunks(graph_feeds, self.profile_bounds.max_batch)])
            else:
                outputs = run(graph_feeds)
        return self.task.postprocess(outputs, feeds) if self.task else outputs

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._output_names, self.session.run(self._output_names, feeds)))

    # -- health -------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """Providers asked for and active, any silent fallback (session or nodes), and the engine cache."""
        report: dict[str, Any] = {
            "healthy": self.session is not None,
            "device": self.device,
            "requested_providers": self.requested_providers,
            "active_providers": self.active_providers,
            "fallback": self.fallback,
            "intra_op_threads": self.intra_op_threads,
            "onnx": str(self.onnx_path) if self.onnx_path else None,
            "io_binding": self._use_io_binding,
        }
        if self.node_placement is not None:
            report["nodes_by_provider"] = {p: sum(c.values()) for p, c in self.node_placement.items()}
            report["node_fallback"] = self.node_fallback
        if self.engine_dir is not None:
            report["tensorrt_engine_cache"] = str(self.engine_dir)
        return report

    def metadata(self) -> dict[str, Any]:
        """What `models` replies show about this instance."""
        return {"framework": "onnxruntime", "providers": self.active_providers,
                "fallback": self.fallback or self.node_fallback}

    def unload(self) -> None:
        """Drop the session and its device buffers; ORT frees their memory with them."""
        if self.io_binding is not None:
            self.io_binding.close()
        self.session = None
        if self._profile_dir is not None:  # load or warmup failed before warmup read the profile
            shutil.rmtree(self._profile_dir, ignore_errors=True)
            self._profile_dir = None


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
