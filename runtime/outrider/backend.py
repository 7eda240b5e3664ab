"""What a backend and a task are: the contract between the core and compute plugins."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import numpy as np

from .accelerators import AcceleratorSet
from .errors import BackendUnavailableError, BadRequestError, ManifestError, OutriderError, TooLargeError
from .manifest import Manifest, TensorSpec
from .protocol import TensorFrame, numpy_dtype

log = logging.getLogger("outrider.backend")


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and if not, why (shown by `outrider plugins`)."""

    available: bool
    reason: str = ""


@dataclass
class BackendChoice:
    backend: type["Backend"]
    device: str
    skipped: list[str] = field(default_factory=list)
    #: why this device (for `device: auto`: which GPU, or why none), shown in health
    device_reason: str = ""


class Task:
    """Input and output processing shared by backends (tokenize, pool, detokenize)."""

    name: ClassVar[str] = ""
    #: the longest input (in the task's unit, e.g. tokens) the model takes; None: the task does not
    #: bound it (engine builders size their shape profiles from it)
    max_length: Optional[int] = None

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest

    def empty_outputs(self, feeds: dict[str, np.ndarray]) -> Optional[dict[str, np.ndarray]]:
        """The outputs when there is nothing for the model to compute (e.g. every sentence empty),
        so a backend answers without a call; None (the default): call the model."""
        return None

    def preprocess(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Manifest inputs -> model feeds."""
        return inputs

    def postprocess(
        self, outputs: dict[str, np.ndarray], feeds: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Model results -> manifest outputs."""
        return outputs

    def row_costs(self, inputs: dict[str, np.ndarray]) -> Optional[np.ndarray]:
        """What each row of `inputs` costs in a call (tokens of a sentence), or None: rows cost alike.

        Schedulers may order rows by it to put rows of similar cost in one call (every row of a
        call is padded to the longest). Only the order matters; the unit is the task's own.
        May raise the request's OutriderError (bad input), which then fails the request.
        """
        return None


class Backend:
    """One instance of a model on one device.

    Lifecycle, driven by the core: `load()` -> `warmup()` -> `execute()` many times,
    `health()` at any time -> `unload()`. `execute` may be called from a worker thread;
    a backend that is not thread-safe gets one instance per thread from the core.
    """

    name: ClassVar[str] = ""
    #: devices this backend can use: "cpu", "cuda".
    device_kinds: ClassVar[tuple[str, ...]] = ("cpu",)
    #: pydantic model of the manifest's `options` for this backend (None: any mapping), checked at start.
    options_model: ClassVar[Optional[type]] = None
    #: True only for an `execute` that takes microseconds, never blocks and is thread-safe (echo):
    #: the I/O thread then runs single requests itself while the queue is empty, saving the hand-off
    #: to an instance thread. May be set per instance in `load()` (echo turns it off with a delay).
    runs_inline: bool = False
    #: True for a GeneratingBackend (keeps sequences, answers `generate`, never `infer`)
    generates: ClassVar[bool] = False
    #: whether `kill()` stops a hung execute (a worker process can be killed; a thread cannot)
    killable: ClassVar[bool] = False

    def __init__(self, manifest: Manifest, device: str, task: Optional[Task] = None) -> None:
        self.manifest = manifest
        self.device = device
        self.task = task
        #: the accelerators the manifest turns on, by section; set by the core before `load()`.
        self.accelerators = AcceleratorSet()
        #: the model's ModelStats (set by the core), for backends that count more than requests.
        self.stats: Any = None
        #: what the artifact transforms did (kind, figures, quality gate), shown in health
        self.artifact_reports: list[dict[str, Any]] = []
        #: the source artifact after the manifest's transforms (prepare_artifact), for load()
        self.artifact: Any = None

    @property
    def options(self) -> Any:
        """The manifest's `options`, validated by `options_model` when the backend has one."""
        model = type(self).options_model
        return model.model_validate(self.manifest.options) if model is not None else self.manifest.options

    def source_artifact(self) -> Any:
        """What the manifest's artifact transforms start from (an `outrider.artifacts.Artifact`:
        an exported ONNX graph, a weights file), or None for a backend that takes no artifact.
        The core calls it before `load()` (see `prepare_artifact`)."""
        return None

    def gate_helpers(self) -> dict[str, Any]:
        """Backend tools a transform's quality gate may use (`TransformContext.helpers`): e.g. how
        to build a model from an artifact, or turn sentences into feeds. Called after `source_artifact`."""
        return {}

    def prepare_artifact(self) -> None:
        """Run by the core before `load()`: `source_artifact()`, then every artifact transform the
        manifest turns on, in the order of their roles (export -> quantize -> engine build), each
        through the core `ArtifactCache`; `load()` finds the result in `self.artifact`."""
        from .accelerators import TransformContext
        from .artifacts import ArtifactCache

        transforms = self.accelerators.artifact_transforms
        artifact = self.source_artifact()
        if artifact is None:
            if transforms:
                sections = ", ".join(self.accelerators.sections_for("artifact_transform"))
                raise ManifestError(f"{self.manifest.where}: backend {self.name!r} takes "
                                    f"no artifact, so its {sections} section cannot transform one")
            return
        if transforms:
            context = TransformContext(self.manifest, self.name, self.device, ArtifactCache(), self.gate_helpers())
            for transform in transforms:
                artifact = transform.apply(artifact, context)
            self.artifact_reports = context.reports
        self.artifact = artifact

    @classmethod
    def availability(cls, manifest: Optional[Manifest] = None, device: str = "auto") -> Availability:
        """Can this backend run here for this manifest and device? Must be cheap."""
        kind = device.split(":")[0]
        if kind not in ("auto", *cls.device_kinds):
            return Availability(False, f"{cls.name} runs on {', '.join(cls.device_kinds)}, not {device}")
        return Availability(True)

    @classmethod
    def resolve_device(cls, device: str) -> str:
        """Turn 'auto' into a concrete device: 'cuda' when the backend can use it and the device
        inventory finds a GPU (no torch import), else 'cpu'."""
        if device != "auto":
            return device
        if "cuda" in cls.device_kinds:
            from .devices import inventory

            if inventory().gpus:
                return "cuda"
        return "cpu"

    @classmethod
    def choose_device(cls, device: str) -> tuple[str, str]:
        """(the device `resolve_device` picks, why): the why names the GPU, or why there is none."""
        chosen = cls.resolve_device(device)
        if device != "auto":
            return chosen, f"{chosen}: as the manifest asks"
        from .devices import explain, inventory

        return chosen, explain(device, chosen, inventory(), cls.device_kinds)

    def load(self) -> None:
        """Load weights and build the session or module."""

    def warmup(self) -> None:
        """Run the model on warmup inputs so the first real request pays no first-call cost."""
        inputs = warmup_inputs(self.manifest)
        for _ in range(self.manifest.warmup.iterations):
            self.execute(inputs)

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Compute outputs for one (possibly batched) set of inputs."""
        raise NotImplementedError

    def row_costs(self, inputs: dict[str, np.ndarray]) -> Optional[np.ndarray]:
        """A cost per row of a request's inputs, for grouping rows of similar cost (the task's by default)."""
        return self.task.row_costs(inputs) if self.task is not None else None

    def idle(self) -> None:
        """The instance has had no work for a moment and is about to wait for more (called on its
        own thread, at most a few times a second): hand back per-thread resources that others need
        meanwhile, such as the torch backends' OpenMP team. Must be cheap when there is nothing to
        hand back; the next `execute` rebuilds what it needs."""

    def health(self) -> dict[str, Any]:
        """{'healthy': bool, ...}: anything an operator should see (provider fallbacks, device)."""
        return {"healthy": True, "device": self.device}

    def heartbeat(self) -> dict[str, Any]:
        """`health()` within a bounded time: what the instance asks every second. In process it is
        health(); a worker proxy raises InstanceCrashed when its process does not answer in time."""
        return self.health()

    def exited(self) -> Optional[str]:
        """Why the process running this backend is gone (a worker that crashed or was killed), or None."""
        return None

    def kill(self) -> None:
        """Stop a hung execute now, where `killable` (the supervisor calls it past execute_timeout_ms)."""

    def unload(self) -> None:
        """Free what `load` took."""

    def metadata(self) -> dict[str, Any]:
        """Extra facts for `models` replies (e.g. execution providers)."""
        return {}


class GeneratingBackend(Backend):
    """A backend that generates text (the `llm` backend): it keeps sequences in an engine of its
    own and answers `generate` requests; `infer` is refused.

    The core drives it with the scheduler it brings (`make_scheduler`; usually
    `outrider.generation.engine.GenerationScheduler`), on thread instances only (a worker process
    only answers execute). After `load()`, `engine` is the `GenerationEngine` that scheduler steps
    and `tokenizer` its tokenizer (`outrider.generation.contract` holds the protocols both follow).
    """

    generates: ClassVar[bool] = True
    engine: Any = None
    tokenizer: Any = None

    @classmethod
    def make_scheduler(cls, manifest: Manifest) -> Any:
        """The scheduler (a `outrider.serving.scheduler.Scheduler`) that serves this backend's instances."""
        raise NotImplementedError(f"backend {cls.name!r} generates, so it must bring its scheduler (make_scheduler)")

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise BadRequestError(f"model {self.manifest.name!r} generates text; send a generate request")


def check_backend_class(cls: Any) -> None:
    """Raise OutriderError naming what is missing when `cls` is not a usable backend class (at registration)."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)) or not cls.name:
        raise OutriderError(f"register_backends: {cls!r} is not a Backend subclass with a name")
    if cls.generates and not issubclass(cls, GeneratingBackend):
        raise OutriderError(f"register_backends: backend {cls.name!r} says it generates; subclass "
                            f"outrider.backend.GeneratingBackend (the contract the generation engine needs)")
    if issubclass(cls, GeneratingBackend) and cls.make_scheduler.__func__ is GeneratingBackend.make_scheduler.__func__:
        raise OutriderError(f"register_backends: generating backend {cls.name!r} must implement make_scheduler")


def check_options(manifest: Manifest, backend: type[Backend]) -> None:
    """Validate `options` with the backend's `options_model`: a ManifestError names the field."""
    model = backend.options_model
    if model is None:
        return
    from pydantic import ValidationError

    from .accelerators import format_validation_error
    from .errors import ManifestError

    try:
        model.model_validate(manifest.options)
    except ValidationError as exc:
        raise ManifestError(format_validation_error(manifest.where, "options", exc)) from None


def require_packages(packages: tuple[str, ...], extra: str) -> Availability:
    """Available when every package can be imported; otherwise says which one and how to get it."""
    import importlib.util

    for package in packages:
        if importlib.util.find_spec(package) is None:
            return Availability(False, f"{package} is not installed (pip install 'outrider[{extra}]')")
    return Availability(True)


# Device nodes of an NVIDIA driver (discrete GPUs; Jetson's integrated one): without any, no CUDA
# device can exist, and 'auto' is the CPU without importing torch (~1 s, ~260 MB).
NVIDIA_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvhost-ctrl-gpu", "/dev/nvmap")


def torch_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu' (imports torch where a GPU driver is
    present: call it at load time)."""
    if device != "auto":
        return device
    import os

    if not any(os.path.exists(node) for node in NVIDIA_DEVICE_NODES):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _synth(spec: TensorSpec, batch: int = 1) -> np.ndarray:
    shape = [batch if i == 0 and d == -1 else (1 if d == -1 else d) for i, d in enumerate(spec.shape)]
    if spec.datatype == "BYTES":
        return np.full(shape, b"Outrider warms up with a short sentence.", dtype=object)
    return np.zeros(shape, dtype=numpy_dtype(spec.datatype))


def warmup_inputs(manifest: Manifest) -> dict[str, np.ndarray]:
    """The manifest's warmup inputs, or inputs synthesized from its input specs."""
    given = manifest.warmup.inputs or {}
    out: dict[str, np.ndarray] = {}
    for spec in manifest.inputs:
        if spec.name in given:
            value = given[spec.name]
            if spec.datatype == "BYTES":
                out[spec.name] = np.array(
                    [v.encode() if isinstance(v, str) else v for v in np.ravel(value)], dtype=object
                ).reshape(np.shape(value))
            else:
                out[spec.name] = np.asarray(value, dtype=numpy_dtype(spec.datatype))
        else:
            out[spec.name] = _synth(spec)
    if not manifest.inputs:
        out = {k: np.asarray(v) for k, v in given.items()} or {"x": np.zeros((1, 4), np.float32)}
    return out


def check_request(manifest: Manifest, tensors: list[TensorFrame]) -> None:
    """A request's tensors, before any is decoded: the input contract, then `manifest.limits`.

    O(number of tensors): it reads the header's shapes and the frames' lengths, never a buffer,
    so the I/O thread can refuse an oversized request before anyone pays for decoding it.
    """
    _check_contract(manifest, {t.name: (t.datatype, t.shape) for t in tensors})
    check_limits(manifest, tensors)


def check_shapes(manifest: Manifest, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """What `check_request` can tell from names, datatypes and shapes alone ({name: (datatype,
    shape)}): the input contract, `limits.max_rows` and `limits.max_elements`. A front that must
    build the tensors from text (JSON data) calls it first, so an oversized request is refused
    before its million elements are packed."""
    _check_contract(manifest, shapes)
    limits = manifest.limits
    elements = 0
    for name, (_, shape) in shapes.items():
        if shape and shape[0] > limits.max_rows:
            raise TooLargeError(f"model {manifest.name!r}: input {name!r} has {shape[0]} rows (first dimension); "
                                f"the limit is limits.max_rows = {limits.max_rows}")
        elements += math.prod(shape)
    if elements > limits.max_elements:
        raise TooLargeError(f"model {manifest.name!r}: the request has {elements} elements; the limit is "
                            f"limits.max_elements = {limits.max_elements}")


def check_limits(manifest: Manifest, tensors: list[TensorFrame]) -> None:
    """TooLargeError naming the limit (`limits.*`) and the value, for the first one exceeded."""
    limits = manifest.limits
    elements = size = 0
    for t in tensors:
        if t.shape and t.shape[0] > limits.max_rows:
            raise TooLargeError(
                f"model {manifest.name!r}: input {t.name!r} has {t.shape[0]} rows (first dimension); the limit is "
                f"limits.max_rows = {limits.max_rows}"
            )
        elements += t.count
        size += len(t.buffer)
    if elements > limits.max_elements:
        raise TooLargeError(
            f"model {manifest.name!r}: the request has {elements} elements; the limit is "
            f"limits.max_elements = {limits.max_elements}"
        )
    if size > limits.max_request_bytes:
        raise TooLargeError(
            f"model {manifest.name!r}: the request's tensors hold {size} bytes; the limit is "
            f"limits.max_request_bytes = {limits.max_request_bytes}"
        )
    for t in tensors:
        # Each BYTES element costs a 4-byte length; if the rest cannot fit in `count` elements of
        # at most max_element_bytes, one is over the limit (which one is found when decoding).
        if t.datatype == "BYTES" and t.nbytes - 4 * t.count > t.count * limits.max_element_bytes:
            raise TooLargeError(
                f"model {manifest.name!r}: input {t.name!r} carries {t.nbytes - 4 * t.count} bytes in {t.count} "
                f"BYTES element(s); the limit is limits.max_element_bytes = {limits.max_element_bytes} per element"
            )


def _check_contract(manifest: Manifest, inputs: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    if not manifest.inputs:
        return
    declared = {t.name for t in manifest.inputs}
    for name in inputs:
        if name not in declared:
            raise BadRequestError(
                f"model {manifest.name!r} has no input {name!r}; its inputs are {sorted(declared)}"
            )
    for spec in manifest.inputs:
        if spec.name not in inputs:
            raise BadRequestError(f"model {manifest.name!r}: input {spec.name!r} is missing")
        datatype, shape = inputs[spec.name]
        if datatype != spec.datatype:
            raise BadRequestError(
                f"model {manifest.name!r}: input {spec.name!r} is {datatype}; expected {spec.datatype}"
            )
        if len(shape) != len(spec.shape) or any(d != -1 and d != s for d, s in zip(spec.shape, shape)):
            raise BadRequestError(
                f"model {manifest.name!r}: input {spec.name!r} has shape {list(shape)}; "
                f"expected {spec.shape} (-1 = any size)"
            )


def choose_backend(manifest: Manifest, backends: dict[str, type[Backend]]) -> BackendChoice:
    """Walk the manifest's preference list; the first available backend wins, the rest say why."""
    skipped: list[str] = []
    for name in manifest.backend_preferences:
        cls = backends.get(name)
        if cls is None:
            skipped.append(f"{name}: no plugin registers this backend (known: {sorted(backends)})")
            continue
        try:
            avail = cls.availability(manifest, manifest.device)
        except Exception as exc:  # a broken probe must not hide the other candidates
            avail = Availability(False, f"availability check failed: {exc!r}")
        if avail.available:
            device, why = cls.choose_device(manifest.device)
            for reason in skipped:
                log.warning("model %s: skipped backend %s", manifest.name, reason)
            log.info("model %s: backend %s on %s", manifest.name, name, why)
            return BackendChoice(cls, device, skipped, why)
        skipped.append(f"{name}: {avail.reason}")
    raise BackendUnavailableError(
        f"{manifest.where}: no backend in {manifest.backend_preferences} can run here: "
        + "; ".join(skipped)
    )
