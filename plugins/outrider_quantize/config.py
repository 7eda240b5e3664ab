"""The manifest's `quantize` section, validated by pydantic at start (no torch, no onnxruntime).

    quantize:
      mode: int8              # int8 | int4 | bf16 | fp16 | auto
      method: dynamic         # ONNX Runtime int8: dynamic | static (QDQ, calibrated)
      per_channel: true
      exclude: [...]          # ONNX node names (fnmatch patterns) kept in float
      group_size: 32          # int4 weights: values per scale/zero group
      kernel: auto            # LLM matmul kernel: auto (measured at load) or a named one
      weights: auto           # ONNX int8 weight encoding: auto | int8 | int7 | uint8
      by_cpu:                 # ONNX int8: what differs on one class of CPU (vnni | avx2 | arm | other)
        avx2: {weights: int7, outlier_channels: 64}
      gate:                   # quality gate, measured when the artifact is built
        min_cosine: 0.99      # embedding models: against the float model, held-out sentences
        mean_cosine: 0.995
        min_top1_agreement: 0.9   # LLMs: teacher-forced top-1 agreement with the float model
        max_ppl_ratio: 1.05       # LLMs: perplexity ratio on held-out code and prose
        on_fail: fail         # fail: the model is not ready, health says why; warn: serve and report
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)  # schema built on first use


class QualityGate(_Strict):
    min_cosine: Optional[float] = Field(None, ge=-1.0, le=1.0)
    mean_cosine: Optional[float] = Field(None, ge=-1.0, le=1.0)
    min_top1_agreement: Optional[float] = Field(None, ge=0.0, le=1.0)
    max_ppl_ratio: Optional[float] = Field(None, ge=1.0)
    on_fail: Literal["fail", "warn"] = "fail"

    def failures(self, figures: dict) -> list[str]:
        """What the measured `figures` miss, as readable lines (empty: the gate passes)."""
        out = []
        checks = (("min_cosine", ">=", self.min_cosine), ("mean_cosine", ">=", self.mean_cosine),
                  ("top1_agreement", ">=", self.min_top1_agreement), ("ppl_ratio", "<=", self.max_ppl_ratio))
        for name, op, bound in checks:
            if bound is None or name not in figures:
                continue
            value = figures[name]
            ok = value >= bound if op == ">=" else value <= bound
            if not ok:
                out.append(f"{name} {value:.4f} (needs {op} {bound:g})")
        return out


#: classes of CPU whose ONNX Runtime int8 MatMul kernels compute differently (outrider_quantize.onnx_recipe.cpu_class):
#: vnni: x86 with AVX512-VNNI or AVX-VNNI (vpdpbusd, 32-bit sums, AMX CPUs too); avx2: other x86 with AVX2
#: (AVX-512 without VNNI included), whose u8s8 kernel adds pairs of products in 16 bits with saturation;
#: arm: aarch64; other: anything else (x86 without AVX2, unknown)
CpuClass = Literal["vnni", "avx2", "arm", "other"]
#: ONNX int8 weights: int8 (u8s8 kernels), int7 (int8 within [-64, 63], onnxruntime's reduce_range: the
#: u8s8 kernels' 16-bit pair sums cannot saturate), uint8 (u8u8 kernels: 16-bit products, no saturation)
WeightEncoding = Literal["auto", "int8", "int7", "uint8"]


class CpuRecipe(_Strict):
    """ONNX int8 fields that differ on one class of CPU; a field left out keeps the section's value."""

    weights: Optional[WeightEncoding] = None
    per_channel: Optional[bool] = None
    exclude: Optional[list[str]] = None
    keep_sensitive: Optional[bool] = None
    outlier_channels: Optional[int] = Field(None, ge=1, le=256)
    smooth_alpha: Optional[float] = Field(None, ge=0.0, le=1.0)


class QuantizeConfig(_Strict):
    mode: Literal["int8", "int4", "bf16", "fp16", "auto"] = "auto"
    method: Literal["dynamic", "static"] = "dynamic"
    per_channel: bool = True
    exclude: list[str] = Field(default_factory=list)
    # ONNX int8: also keep the linear MatMuls fed by an activation (BERT's FFN output projections)
    # in float; found by graph structure, so it survives any exporter's node naming.
    keep_sensitive: bool = True
    # ONNX int8, method dynamic: quantize those sensitive MatMuls too, except the N input channels
    # with the largest calibrated max |x| (LLM.int8()'s decomposition: an outlier channel alone
    # would set the per-tensor activation scale); those N stay float beside the int8 MatMul.
    # None: the sensitive MatMuls stay float whole (with keep_sensitive).
    outlier_channels: Optional[int] = Field(None, ge=1, le=256)
    # ONNX int8, method dynamic: SmoothQuant strength (None: off). Moves activation outliers into
    # the weights (x / s, W * s, s = max|x|^a / max|W|^(1-a), from the calibration sentences).
    smooth_alpha: Optional[float] = Field(None, ge=0.0, le=1.0)
    group_size: int = Field(32, ge=16, le=1024)
    # LLM weights (the llm backend's kernels, outrider_llm/linear.py): auto = measured at load;
    # "+bf16" adds a dense bf16 copy for calls of many rows; the others name one kernel.
    # int4native: outrider's own int4 kernel (flat in rows: for speculative verification); w4a8:
    # outrider's own int4 kernel with int8 activations, as llama.cpp computes, and the head in GGUF
    # Q8_0, on every CPU class (outrider_llm/native.py); each where it runs here, else as auto.
    kernel: Literal["auto", "auto+bf16", "int4pack", "int8pack", "dense", "int4pack+bf16", "int8pack+bf16",
                    "int4native", "w4a8"] = "auto"
    # ONNX int8: how weights are stored, which decides the kernel ONNX Runtime runs (see WeightEncoding).
    # auto: int8 on VNNI CPUs; uint8 on every other, where int8 would meet a saturating u8s8 kernel
    # (x86 without VNNI) or an unmeasured one (ARM): u8u8 sums are exact on every kernel, so the result
    # is the one measured on a VNNI CPU. int7 keeps the faster u8s8 kernel at one bit of weight precision.
    weights: WeightEncoding = "auto"
    # ONNX int8: per class of CPU, the fields that differ there (e.g. avx2: {weights: int7}); the recipe
    # actually used, and the class, are part of the artifact's cache key.
    by_cpu: dict[CpuClass, CpuRecipe] = Field(default_factory=dict)
    calibration_sentences: int = Field(64, ge=1, le=100_000)
    gate: QualityGate = Field(default_factory=QualityGate)
