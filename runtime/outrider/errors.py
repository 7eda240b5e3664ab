"""One family of errors: a code on the wire, an exception class in Python."""

from __future__ import annotations

from typing import Any


class OutriderError(Exception):
    """Base of every error Outrider raises to a caller; carries a stable code."""

    code: str = "internal"
    #: raised while loading a model, would the same load fail again the same way? Then the
    #: supervisor marks the instance failed once, with this error as its reason, and does not
    #: restart it (a restart would only rebuild the same verdict, with back-off, for ever)
    deterministic: bool = False

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def to_wire(self) -> dict:
        """The error as the header of an error reply."""
        return {"code": self.code, "message": self.message}


class BadRequestError(OutriderError):
    """The request is malformed or does not match the model's inputs."""

    code = "bad_request"


class ProtocolError(BadRequestError):
    """The frames themselves are broken: count, type frame, header, sizes."""

    code = "protocol_error"


class TooLargeError(BadRequestError):
    """A size limit on untrusted input was exceeded."""

    code = "too_large"


class ModelNotFoundError(OutriderError):
    """No model of that name is served here."""

    code = "model_not_found"


class ModelNotReadyError(OutriderError):
    """The model exists but is loading, warming up or failed."""

    code = "model_not_ready"


class OverloadedError(OutriderError):
    """The model's queue is full; try again later (not the request's fault)."""

    code = "overloaded"


class RequestTimeoutError(OutriderError):
    """The request did not finish within its deadline."""

    code = "timeout"


class CancelledError(OutriderError):
    """The request was cancelled by its client."""

    code = "cancelled"


class UnavailableError(OutriderError):
    """The server is shutting down or cannot be reached."""

    code = "unavailable"


class InsufficientMemoryError(OutriderError):
    """A model cannot be loaded within `--memory-budget`, even after unloading every idle model;
    the message gives the numbers. Retry once busy models go idle."""

    code = "insufficient_memory"


class ExecutionError(OutriderError):
    """The backend failed while computing this request."""

    code = "execution_error"


class InstanceCrashed(ExecutionError):
    """The instance died (its worker process exited, or was killed because it hung); it will be replaced.

    Schedulers must let it propagate to the instance (never turn it into one request's result),
    so that the instance is failed and replaced; the instance answers the batch. `delivered` is
    False when the work never reached the worker (the reply code is then `unavailable`: retrying
    is safe); a scheduler that had results for part of the batch before the crash puts them in
    `partial` (one entry per request of the batch, None where there is none) so they still reply.
    """

    def __init__(self, message: str, code: str | None = None, delivered: bool = True,
                 reason: str | None = None) -> None:
        super().__init__(message, code)
        self.delivered = delivered
        #: what happened, without the model and instance (health shows it under the instance)
        self.reason = reason or message
        self.partial: list[Any] | None = None


class ManifestError(OutriderError):
    """A manifest is invalid: names the file, the field and what was expected."""

    code = "manifest_error"
    deterministic = True


class BackendUnavailableError(OutriderError):
    """No backend in the manifest's preference list can run here."""

    code = "backend_unavailable"


class LoadFailedError(OutriderError):
    """A model's load failed in a way that retrying repeats: a missed quality gate, an artifact
    that is corrupt or cannot be opened. The model is marked failed once, with this as its
    reason in health; it is not restarted (fix the manifest or the artifact, then restart)."""

    code = "load_failed"
    deterministic = True


class QualityGateError(LoadFailedError):
    """A converted artifact (quantized weights, an engine) missed its manifest's quality gate."""

    code = "quality_gate_failed"


class ArtifactError(LoadFailedError):
    """A built or given artifact is bad: missing, truncated, not what its provenance says, or
    refused by the framework that should open it."""

    code = "bad_artifact"


class InternalError(OutriderError):
    """A bug in the server; the message says where."""

    code = "internal"


_BY_CODE: dict[str, type[OutriderError]] = {
    cls.code: cls
    for cls in (
        BadRequestError,
        ProtocolError,
        TooLargeError,
        ModelNotFoundError,
        ModelNotReadyError,
        OverloadedError,
        RequestTimeoutError,
        CancelledError,
        UnavailableError,
        InsufficientMemoryError,
        ExecutionError,
        ManifestError,
        BackendUnavailableError,
        LoadFailedError,
        QualityGateError,
        ArtifactError,
        InternalError,
    )
}


def error_from_wire(error: dict) -> OutriderError:
    """Rebuild the exception a server sent; unknown codes keep their code on the base class."""
    code = str(error.get("code", "internal"))
    message = str(error.get("message", ""))
    cls = _BY_CODE.get(code)
    if cls is None:
        return OutriderError(message, code=code)
    return cls(message)
