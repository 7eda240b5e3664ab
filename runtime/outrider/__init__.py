"""Outrider: a plugin-based inference runtime that runs beside your app.

Importing this package is cheap: no torch, onnxruntime or tensorrt is imported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    BackendUnavailableError,
    BadRequestError,
    CancelledError,
    ExecutionError,
    InsufficientMemoryError,
    InternalError,
    ManifestError,
    ModelNotFoundError,
    ModelNotReadyError,
    OutriderError,
    OverloadedError,
    ProtocolError,
    RequestTimeoutError,
    TooLargeError,
    UnavailableError,
)
from .hookspecs import hookimpl

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .client import AsyncClient, Client, GenerateResult

_LAZY = {"Client": "client", "AsyncClient": "client", "GenerateResult": "client"}


def __getattr__(name: str) -> Any:
    # The client pulls in zmq; keep `import outrider` itself light for plugins and tools.
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'outrider' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "BackendUnavailableError",
    "BadRequestError",
    "CancelledError",
    "Client",
    "ExecutionError",
    "GenerateResult",
    "InsufficientMemoryError",
    "InternalError",
    "ManifestError",
    "ModelNotFoundError",
    "ModelNotReadyError",
    "OutriderError",
    "OverloadedError",
    "ProtocolError",
    "RequestTimeoutError",
    "TooLargeError",
    "UnavailableError",
    "hookimpl",
    "__version__",
]
