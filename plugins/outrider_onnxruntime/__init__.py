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
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Literal, Mapping, Optional

import numpy as np

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from outrider import hookimpl
from outrider.artifacts import PROVENANCE, Artifact, ArtifactCache
from outrider.backend import Availability, Backend, Task
from outrider.bake import BakedFiles, BakesModel
from outrider.devices import explain, inventory
from outrider.errors import ArtifactError, BackendUnavailableError, ExecutionError, ManifestError
from outrider.hardware import cpu_fingerprint
from outrider.manifest import Manifest
from outrider.onnx.artifact import onnx_model
from outrider.onnx.export import DEFAULT_OPSET  # stdlib only at import: no torch
from outrider.onnx.profiles import concat_rows, profile_bounds, profile_shapes, row_chunks

from outrider.hardware import physical_cores
from .profiles import onnx_input_dims, ort_profile_options

if TYPE_CHECKING:
    import onnxruntime

__version__ = "0.1.0"

log = logging.getLogger("outrider.onnxruntime")

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
_GPU_PROVIDERS = (TENSORRT, CUDA)
_INSTALL_HINT = {TENSORRT: "install onnxruntime-gpu and TensorRT", CUDA: "install onnxruntime-gpu"}
#: ops whose place on the CPU, in a GPU session, costs real time (shape ops are put there on purpose)
COMPUTE_OPS = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Attention", "MultiHeadAttention", "GroupQueryAttention",
    "FusedMatMul", "MatMulInteger", "QLinearMatMul", "MatMulNBits", "LSTM", "GRU", "Softmax",
    "LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization", "BiasGelu", "FastGelu", "Gelu",
})
#: device buffer sets kept per instance, one per distinct set of input shapes (least recently used goes)
BOUND_SHAPES_KEPT = 16
#: part of the saved forms' keys ("onnx-session", "onnx-mapped"): bumped when what `_saved_form` writes changes
SESSION_FORM = 2
SESSION_DATA = "model.data"
#: a graph file smaller than this opens fast as it is: its initializers are in a side file already
#: (a baked or saved form), or there is little to copy
SESSION_FORM_MIN_BYTES = 1 << 20


def session_form(onnx_path: Path, cache: Optional[ArtifactCache] = None) -> Path:
    """The graph as a CPU session opens it fastest, built once into the artifact cache ("onnx-session"):
    optimized at ORT's EXTENDED level (the CPU provider's fusions; the layout passes of ENABLE_ALL
    still run at each start) and saved with its initializers in a side file, which ORT maps instead
    of copying out of the protobuf, and with the MatMul weights already packed for this CPU's
    kernels (`session.save_external_prepacked_constant_initializers`), mapped too, so no start packs
    them again. Packed layouts differ between CPU classes, so the entry is keyed by this CPU's
    features (outrider.hardware.cpu_fingerprint). MiniLM's session start: 0.13 -> 0.045 s here
    with mapped initializers, 0.052 -> 0.034 s (another machine) with packed ones; the packed
    weights are shared page cache rather than each process's heap. The same graph, the same
    fusions, the same packing: the outputs are the original file's, bit for bit."""
    return _saved_form(onnx_path, "onnx-session", "extended", cache)


def mapped_form(onnx_path: Path, cache: Optional[ArtifactCache] = None) -> Path:
    """The graph unoptimized (any provider may open it), its initializers in a side file that ORT maps:
    what `outrider bake` writes, so a baked model opens fast with nothing built at start."""
    return _saved_form(onnx_path, "onnx-mapped", "none", cache)


def _saved_form(onnx_path: Path, kind: str, level: str, cache: Optional[ArtifactCache]) -> Path:
    import onnxruntime

    levels = {"extended": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "none": onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL}
    # The CPU form carries this CPU's packed weights; the unoptimized one stays portable (any
    # provider, any machine: what `outrider bake` ships).
    prepacked = level != "none"
    keyed = {"format": SESSION_FORM, "level": level, **({"cpu": cpu_fingerprint()} if prepacked else {})}

    def build(directory: Path, progress: Any) -> dict:
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = levels[level]
        options.optimized_model_filepath = str(directory / "model.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", SESSION_DATA)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        if prepacked:
            options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        options.intra_op_num_threads = 1
        onnxruntime.InferenceSession(str(onnx_path), options, providers=[CPU])
        data = directory / SESSION_DATA
        if not data.exists():  # nothing was large enough to move: an empty side file keeps the layout whole
            data.touch()
        return {"graph_bytes": (directory / "model.onnx").stat().st_size, "initializer_bytes": data.stat().st_size}

    artifact = (cache or ArtifactCache()).get_or_build(
        kind, build, label=f"{onnx_path.name} -> {kind}", sources=[onnx_path], versions=["onnxruntime"],
        device="cpu" if prepacked else "any", options=keyed)
    return artifact.file("model.onnx")


def providers_to_request(device: str, providers: Iterable[str], built: Iterable[str],
                         take_what_is_built: bool) -> list[str]:
    """The providers to ask ORT for: CPU on a CPU device; else the backend's, or those this build has."""
    if not device.startswith("cuda"):
        return [CPU]
    if take_what_is_built:
        built = set(built)
        return [p for p in providers if p in built] or [CPU]
    return list(providers)


def device_id(device: str) -> int:
    """'cuda:3' -> 3; 'cuda' and 'cpu' -> 0."""
    return int(device.split(":")[1]) if ":" in device else 0


def build_provider_options(provider: str, device: str, options: OrtOptions,
                           engine_dir: Optional[Path] = None,
                           profile: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """One provider's options: placement's device_id, Outrider's defaults, then the manifest's own."""
    extra = dict(options.provider_options.get(provider, {}))
    if provider == TENSORRT:
        # Engines take minutes to build: keep them, and the timing cache, in the artifact cache.
        cache = {} if engine_dir is None else {
            "trt_engine_cache_enable": True, "trt_engine_cache_path": str(engine_dir),
            "trt_timing_cache_enable": True, "trt_timing_cache_path": str(engine_dir)}
        return {"device_id": device_id(device), **cache, "trt_fp16_enable": options.fp16,
                **(profile or {}), **extra}
    if provider == CUDA:
        return {"device_id": device_id(device), **extra}
    return extra


def fallback_report(requested: list[str], active: list[str]) -> Optional[str]:
    """What ORT left out of the providers asked for, in words, or None when it took them all."""
    missing = [p for p in requested if p not in active]
    if not missing:
        return None
    return (f"asked for {', '.join(requested)}; onnxruntime activated only {', '.join(active)} "
            f"({', '.join(missing)} failed to load or is not in this build)")


def node_placement(events: list[dict[str, Any]]) -> dict[str, Counter]:
    """{provider: Counter(op type)} of the nodes ORT's profiler saw run (each node once)."""
    seen: dict[str, tuple[str, str]] = {}
    for event in events:
        args = event.get("args") or {}
        if event.get("cat") == "Node" and "provider" in args and "op_name" in args:
            seen[event.get("name", "").removesuffix("_kernel_time")] = (args["provider"], args["op_name"])
    placement: dict[str, Counter] = {}
    for provider, op in seen.values():
        placement.setdefault(provider, Counter())[op] += 1
    return placement


def node_fallback_report(placement: dict[str, Counter], active: list[str]) -> Optional[str]:
    """Compute nodes (COMPUTE_OPS) that ran on the CPU in a session led by a GPU provider, or None."""
    if not active or active[0] == CPU:
        return None
    on_cpu = {op: n for op, n in placement.get(CPU, Counter()).items() if op in COMPUTE_OPS}
    if not on_cpu:
        return None
    listed = ", ".join(f"{op} x{n}" for op, n in sorted(on_cpu.items()))
    return f"{sum(on_cpu.values())} compute node(s) ran on CPUExecutionProvider, not {active[0]}: {listed}"




#: onnxruntime's exception types (onnxruntime.capi.onnxruntime_pybind11_state) that blame the
#: model file, not the moment: opening the same file again fails the same way
_BAD_FILE_ERRORS = frozenset({"InvalidProtobuf", "InvalidGraph", "NoSuchFile", "NoModel", "NotImplemented"})

class OrtOptions(BaseModel):
    """The `options` of an ONNX Runtime manifest, validated at start."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # schema built on first use

    onnx: Optional[str] = Field(None, description="an ONNX file (relative to the manifest); else exported")
    opset: int = Field(DEFAULT_OPSET, ge=7, le=30)
    export_timeout_s: float = Field(900, gt=0)
    intra_op_threads: Optional[int] = Field(None, ge=1, le=1024)
    fp16: bool = Field(False, description="TensorRT provider: allow fp16 kernels (trt_fp16_enable)")
    max_batch: Optional[int] = Field(None, ge=1, le=65536, description="TensorRT provider: the profile's largest batch")
    provider_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    max_seq_length: Optional[int] = Field(None, ge=2, description="text task: longest input in tokens")
    # The text task's own (plugins/outrider_text): what it does with a text past max_seq_length,
    # and the shortened embeddings (`dimensions`) of a model trained for them (Matryoshka).
    truncate: Optional[StrictBool] = Field(None, description="text task: cut a longer text (true, the default) or refuse it")
    matryoshka: Optional[StrictBool] = Field(None, description="text task: the model gives shortened embeddings")
    matryoshka_dimensions: Optional[list[int]] = Field(None, description="text task: the shortened widths allowed")
    on_fallback: Literal["warn", "error"] = Field(
        "warn", description="when ORT runs the session, or compute nodes, on a later provider than asked: "
                            "'warn' (log it, show it in health) or 'error' (the model does not become ready)")
    io_binding: Optional[bool] = Field(None, description="bind inputs and outputs to reused device buffers "
                                                         "(default: on when a GPU provider runs the session)")

    @field_validator("provider_options")
    @classmethod
    def _known_providers(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        unknown = sorted(set(value) - {TENSORRT, CUDA, CPU})
        if unknown:
            raise ValueError(f"expected provider names among {[TENSORRT, CUDA, CPU]} (got {unknown})")
        placed = sorted(p for p, opts in value.items() if "device_id" in opts)
        if placed:
            raise ValueError(f"{placed}: 'device_id' comes from the manifest's device and instances "
                             "(placement spreads instances over GPUs); set `device: cuda:N` instead")
        return value


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
        self._bind_device = ("cpu", 0)
        self._binding: Any = None
        #: input shapes -> (input OrtValues, output OrtValues or None): device buffers kept for reuse
        self._bound: OrderedDict[tuple, tuple[dict[str, Any], Optional[list[Any]]]] = OrderedDict()
        self._bind_lock = threading.Lock()

    @classmethod
    def bake_files(cls, manifest: Manifest, raw: Mapping[str, Any]) -> BakedFiles:
        """`outrider bake`: the graph (exported now if the cache lacks it) as model.onnx, its initializers
        beside it in model.data (`mapped_form`: opened as it is, nothing built at start). A manifest
        with a `quantize` section is refused: quantizing needs the onnx package at start."""
        if raw.get("quantize"):
            raise ManifestError(f"{manifest.source_file or manifest.name}: has a 'quantize' section, which needs "
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
                f"{onnxruntime.__version__} with {', '.join(built)}); {_INSTALL_HINT[needed]}",
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
                               f"{CUDA} ({_INSTALL_HINT[CUDA]})")
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
        gpu_asked = any(p in self.requested_providers for p in _GPU_PROVIDERS)
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
        gpu_active = any(p in self.active_providers for p in _GPU_PROVIDERS)
        self._use_io_binding = opts.io_binding if opts.io_binding is not None else gpu_active
        self._bind_device = ("cuda" if gpu_active else "cpu", device_id(self.device) if gpu_active else 0)
        self._binding = self.session.io_binding() if self._use_io_binding else None
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
            run = self._run_bound if self._use_io_binding else self._run
            if self.profile_bounds is not None and TENSORRT in self.active_providers:
                # Past the profile's batch TensorRT would build another engine: run in pieces.
                outputs = concat_rows([run(piece) for piece in row_chunks(graph_feeds, self.profile_bounds.max_batch)])
            else:
                outputs = run(graph_feeds)
        return self.task.postprocess(outputs, feeds) if self.task else outputs

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._output_names, self.session.run(self._output_names, feeds)))

    def _run_bound(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run through I/O binding: inputs copied into device buffers kept per set of input shapes
        (`update_inplace`, no new allocation), outputs written into buffers kept the same way."""
        from onnxruntime import OrtValue

        kind, index = self._bind_device
        feeds = {name: np.ascontiguousarray(a) for name, a in feeds.items()}
        shapes = tuple((name, a.shape, a.dtype.str) for name, a in feeds.items())
        with self._bind_lock:
            buffers = self._bound.pop(shapes, None)
            if buffers is None:
                # Buffers of their own: on the CPU, ortvalue_from_numpy would alias the caller's
                # array, and the next call's update_inplace would overwrite it.
                buffers = ({name: OrtValue.ortvalue_from_shape_and_type(a.shape, a.dtype, kind, index)
                            for name, a in feeds.items()}, None)
            for name, a in feeds.items():
                buffers[0][name].update_inplace(a)
            binding = self._binding
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            for name, value in buffers[0].items():
                binding.bind_ortvalue_input(name, value)
            for i, name in enumerate(self._output_names):
                if buffers[1] is None:
                    binding.bind_output(name, kind, index)  # ORT allocates it once, on this device
                else:
                    binding.bind_ortvalue_output(name, buffers[1][i])
            self.session.run_with_iobinding(binding)
            if buffers[1] is None:
                buffers = (buffers[0], binding.get_outputs())
            self._bound[shapes] = buffers
            while len(self._bound) > BOUND_SHAPES_KEPT:
                self._bound.popitem(last=False)
            return dict(zip(self._output_names, binding.copy_outputs_to_cpu()))

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
        with self._bind_lock:
            self._bound.clear()
            self._binding = None
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
