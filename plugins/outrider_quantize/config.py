"""The manifest's `quantize` section, validated by pydantic at start (no torch, no onnxruntime).

    quantize:
      mode: int8              # int8 | int4 | bf16 | fp16 | auto
      method: dynamic         # ONNX Runtime int8: dynamic | static (QDQ, calibrated)
      per_channel: true
      exclude: [...]          # ONNX node names (fnmatch patterns) kept in float
      group_size: 32          # int4 weights: values per scale/zero group
      kernel: auto            # LLM matmul kernel: auto (measured at load) or a named one
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
    model_config = ConfigDict(extra="forbid")


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
    # outrider's own int4 kernel with int8 activations on AVX512-VNNI, as llama.cpp computes, and
    # the head in GGUF Q8_0; each where it runs here, else as auto.
    kernel: Literal["auto", "auto+bf16", "int4pack", "int8pack", "dense", "int4pack+bf16", "int8pack+bf16",
                    "int4native", "w4a8"] = "auto"
    calibration_sentences: int = Field(64, ge=1, le=100_000)
    gate: QualityGate = Field(default_factory=QualityGate)
