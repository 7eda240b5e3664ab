"""`quantize` accelerator: artifact transforms that quantize a model before it loads.

Registers two accelerators for the manifest section `quantize` (validated by `QuantizeConfig`):

- `onnx-int8` for the ONNX Runtime backends: int8 with `onnxruntime.quantization` on the
  exported graph, gated on the cosine of its embeddings against the float model (`onnx.py`);
- `llm-weights` for the `llm` backend: int4 / int8 / bf16 weights for the compact Llama
  forward, gated on teacher-forced top-1 agreement and the perplexity ratio (`llm.py`).

Both build through the core artifact cache (so a second start quantizes nothing) and record the
quality-gate figures in the artifact's provenance. A model that misses its gate is not ready and
health says why (or, with `gate.on_fail: warn`, serves and reports the figures). Importing this
package imports neither torch nor onnxruntime.
"""

from __future__ import annotations

from typing import Any, Callable

from outrider import hookimpl
from outrider.accelerators import AcceleratorSpec

from .config import QualityGate, QuantizeConfig

__version__ = "0.1.0"
__all__ = ["QualityGate", "QuantizeConfig"]


def make_onnx_quantizer(manifest: Any, config: QuantizeConfig) -> Any:
    """Accelerator factory: int8 quantization of an ONNX graph."""
    from .onnx import OnnxQuantizer

    return OnnxQuantizer(manifest, config)


def make_llm_quantizer(manifest: Any, config: QuantizeConfig) -> Any:
    """Accelerator factory: quantized weights for the `llm` backend's Llama forward."""
    from .llm import LlmWeightQuantizer

    return LlmWeightQuantizer(manifest, config)


@hookimpl
def outrider_register_accelerators(register: Callable[..., None]) -> None:
    """Register the two quantizers, each for the backends whose artifacts it understands."""
    register(AcceleratorSpec(
        name="onnx-int8", role="artifact_transform", section="quantize", factory=make_onnx_quantizer,
        backends=("onnxruntime-*",), config=QuantizeConfig,
        description="int8 ONNX graph (onnxruntime.quantization), gated on embedding cosine",
    ))
    register(AcceleratorSpec(
        name="llm-weights", role="artifact_transform", section="quantize", factory=make_llm_quantizer,
        backends=("llm",), config=QuantizeConfig,
        description="int4/int8/bf16 Llama weights, gated on top-1 agreement and perplexity ratio",
    ))
