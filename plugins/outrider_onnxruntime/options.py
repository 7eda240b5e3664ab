"""The `options` of an ONNX Runtime manifest (`OrtOptions`), and what they make of each
execution provider's own options."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from outrider.onnx.export import DEFAULT_OPSET  # stdlib only at import: no torch

from .providers import CPU, CUDA, TENSORRT, device_id


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
