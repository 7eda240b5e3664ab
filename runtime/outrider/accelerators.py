"""Accelerators: typed roles the core calls at defined points, registered under (role, name).

Roles, and where the core calls them:

- `artifact_transform`: before load. The core takes the backend's source artifact (an ONNX file,
  a weights file: `Backend.source_artifact`) and runs every transform the manifest turns on,
  in order (export -> quantize -> engine build), each through the core `ArtifactCache`. The object
  a factory returns is an `ArtifactTransform`: `apply(artifact, context) -> Artifact`, and
  `weight_format`, what it makes of the weights (a `WeightFormat`, or None), which backends read
  instead of the transform's own config.
- `batch_policy`: between the model's queue and its instances. The object is an
  `outrider.serving.scheduler.Scheduler` (the dynamic batcher). A backend that schedules its own work
  (generation: continuous batching) cannot take one: asking for both is a ManifestError.
- `decode_strategy`: asked by a generating backend at each step; the object implements
  `outrider.generation.contract.DecodeStrategy` (speculative decoding).

An accelerator names the manifest section that turns it on, the backends it applies to
(fnmatch patterns), and the pydantic model of its section, so the whole manifest is validated at
start with errors that name the file and the field. Two accelerators may fill one section for
different backends (ORT int8 and torch int8); two that apply to the same backend conflict.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from pydantic import BaseModel, ValidationError

from .errors import ManifestError, OutriderError
from .manifest import Manifest

@dataclass(frozen=True)
class WeightFormat:
    """What an artifact transform makes of a model's weights, for the backend that loads them."""

    mode: str  # "int8", "int4", ...: the weights' number format after the transform
    group_size: int  # inputs that share one scale (0: one scale per output row)
    kernel: str = "auto"  # the matmul kernel the manifest asks for ("auto": measured at load)


class ArtifactTransform(Protocol):
    """The object an `artifact_transform` factory returns (checked when the factory returns it)."""

    weight_format: Optional[WeightFormat]  # None: nothing a backend needs to know of the weights

    def apply(self, artifact: Any, context: Any) -> Any: ...


#: what the object an accelerator's factory returns must have, by role (checked when it is made)
ROLE_MEMBERS = {
    "artifact_transform": ("apply", "weight_format"),
    "batch_policy": ("next_batch", "execute"),
    "decode_strategy": ("for_instance", "bind_registry", "attach", "start", "propose", "observe", "finish"),
}
ROLE_CONTRACTS = {
    "artifact_transform": "outrider.accelerators.ArtifactTransform",
    "batch_policy": "outrider.serving.scheduler.Scheduler",
    "decode_strategy": "outrider.generation.contract.DecodeStrategy",
}

_NESTED_FIELD = re.compile(r"^field '([^']+)': (.*)$", re.S)
#: in the order the core calls them: transforms before load, the policy between queue and
#: instances, the strategy inside each generation step
ROLES = ("artifact_transform", "batch_policy", "decode_strategy")
_SECTION_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


@dataclass(frozen=True)
class AcceleratorSpec:
    """What a plugin registers for one accelerator (see the module docstring)."""

    name: str
    role: str
    section: str
    factory: Callable[[Any, Any], Any]  # (manifest, validated section) -> the object the core uses
    backends: tuple[str, ...] = ("*",)
    config: Optional[type[BaseModel]] = None
    description: str = ""
    #: among accelerators of one role, lower runs first (artifact transforms chain: an export
    #: before a quantization before an engine build)
    order: int = 50
    #: the object needs the drafters other plugins register: the core calls its
    #: `bind_registry(drafters)` with {name: factory} once it is built
    uses_drafters: bool = False

    def applies_to(self, backend: str) -> bool:
        """Whether this accelerator can be used with the backend named `backend`."""
        return any(fnmatch.fnmatchcase(backend, pattern) for pattern in self.backends)

    def check(self) -> None:
        """Raise OutriderError when the registration itself is malformed."""
        if not isinstance(self.name, str) or not self.name:
            raise OutriderError(f"register_accelerators: name must be a non-empty string, got {self.name!r}")
        if self.role not in ROLES:
            raise OutriderError(f"register_accelerators: {self.name!r}: role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.section, str) or not _SECTION_NAME.match(self.section):
            raise OutriderError(f"register_accelerators: {self.name!r}: section must be a lower-case name "
                                f"(letters, digits, '_'), got {self.section!r}")
        if self.section in Manifest.model_fields:
            raise OutriderError(f"register_accelerators: {self.name!r}: section {self.section!r} is a field of the "
                                f"core manifest")
        if not callable(self.factory):
            raise OutriderError(f"register_accelerators: {self.name!r}: factory is not callable")
        if self.config is not None and not (isinstance(self.config, type) and issubclass(self.config, BaseModel)):
            raise OutriderError(f"register_accelerators: {self.name!r}: config must be a pydantic model class")
        if isinstance(self.backends, str) or not self.backends:
            raise OutriderError(f"register_accelerators: {self.name!r}: backends must be a tuple of names or patterns")


class AcceleratorSet(dict):
    """The accelerators one model uses: {section: object}, plus their specs and validated configs."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: dict[str, AcceleratorSpec] = {}
        self.configs: dict[str, Any] = {}

    def sections_for(self, role: str) -> list[str]:
        """The sections whose accelerators fill `role`, in the order they run (select() inserted them so)."""
        return [section for section, spec in self.specs.items() if spec.role == role]

    def by_role(self, role: str) -> list[Any]:
        """The objects filling `role`, in the order they run."""
        return [self[section] for section in self.sections_for(role)]

    @property
    def batch_policy(self) -> Any:
        found = self.by_role("batch_policy")
        return found[0] if found else None

    @property
    def decode_strategy(self) -> Any:
        found = self.by_role("decode_strategy")
        return found[0] if found else None

    @property
    def artifact_transforms(self) -> list[Any]:
        return self.by_role("artifact_transform")

    def describe(self) -> dict[str, str]:
        """{section: accelerator name}, for health and `models` replies."""
        return {s: spec.name for s, spec in self.specs.items()}


@dataclass
class TransformContext:
    """What an artifact transform gets besides the artifact.

    `helpers` are the backend's own tools a transform may need and cannot import (a transform
    never imports a backend plugin): e.g. `build_model(artifact)` and `tokenize(text)` for an LLM
    quality gate, `embed(path, sentences)` for an embedding model's.
    """

    manifest: Any
    backend: str
    device: str
    cache: Any  # outrider.artifacts.ArtifactCache
    helpers: dict[str, Any] = field(default_factory=dict)
    #: reports of the transforms run so far (name, artifact kind, quality figures), for health
    reports: list[dict[str, Any]] = field(default_factory=list)


def format_validation_error(where: str, prefix: str, exc: ValidationError) -> str:
    """Pydantic errors as 'FILE: field 'SECTION.FIELD': what was expected (got ...)' lines."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        msg = err["msg"].removeprefix("Value error, ")
        nested = _NESTED_FIELD.match(msg)
        if nested:  # a section-level validator that names the sub-field it rejects (and says what it got)
            path, msg = f"{path}.{nested.group(1)}", nested.group(2)
        if err["type"] == "extra_forbidden":
            msg = "unknown field (misspelled?)"
        got = "" if nested or err["type"] in ("missing", "extra_forbidden") else f" (got {err.get('input')!r:.80})"
        lines.append(f"{where}: field '{path}': {msg}{got}")
    return "\n".join(lines)


def validate_section(spec: AcceleratorSpec, value: Any, where: str) -> Any:
    """The manifest section validated by the accelerator's own model (or passed through)."""
    if spec.config is None:
        return value
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if value is None:
        value = {}
    try:
        return spec.config.model_validate(value)
    except ValidationError as exc:
        raise ManifestError(format_validation_error(where, spec.section, exc)) from None


def select(specs: list[AcceleratorSpec], manifest: Any, backend: Any) -> AcceleratorSet:
    """Pick, validate and build the accelerators a manifest turns on, for its chosen backend class.

    Every mistake is a ManifestError naming the file and the section: no plugin provides the
    section, none applies to this backend, two do, or the backend cannot take the role.
    """
    where = manifest.where
    backend_name = backend.name
    chosen: list[tuple[AcceleratorSpec, str, Any]] = []
    for section, value in manifest.sections.items():
        offered = [s for s in specs if s.section == section]
        if not offered:
            provided = sorted({s.section for s in specs})
            raise ManifestError(f"{where}: field '{section}': no loaded plugin provides this accelerator "
                                f"(sections the loaded plugins provide: {', '.join(provided) or 'none'})")
        usable = [s for s in offered if s.applies_to(backend_name)]
        if not usable:
            known = "; ".join(f"{s.name} ({s.role}) applies to {', '.join(s.backends)}" for s in offered)
            raise ManifestError(
                f"{where}: field '{section}': backend {backend_name!r} cannot use it ({known})"
            )
        if len(usable) > 1:
            raise ManifestError(
                f"{where}: field '{section}': accelerators {[s.name for s in usable]} all apply to backend "
                f"{backend_name!r}; only one may"
            )
        spec = usable[0]
        if spec.role == "batch_policy" and backend.generates:
            raise ManifestError(
                f"{where}: field '{section}': backend {backend_name!r} schedules its own work "
                f"(continuous batching); remove this section"
            )
        if spec.role == "decode_strategy" and not backend.generates:
            raise ManifestError(f"{where}: field '{section}': backend {backend_name!r} does not generate text")
        chosen.append((spec, section, validate_section(spec, value, where)))
    for role in ("batch_policy", "decode_strategy"):
        sections = [section for spec, section, _ in chosen if spec.role == role]
        if len(sections) > 1:
            raise ManifestError(f"{where}: fields {sections}: each turns on a {role}; a model takes one")
    out = AcceleratorSet()
    for spec, section, config in sorted(chosen, key=lambda c: (ROLES.index(c[0].role), c[0].order, c[1])):
        made = spec.factory(manifest, config)
        missing = [name for name in ROLE_MEMBERS[spec.role] if not hasattr(made, name)]
        if missing:
            raise OutriderError(f"accelerator {spec.name!r} ({spec.role}): its factory returned a "
                                f"{type(made).__name__} without {', '.join(missing)} (see {ROLE_CONTRACTS[spec.role]})")
        out[section] = made
        out.specs[section] = spec
        out.configs[section] = config
    return out
