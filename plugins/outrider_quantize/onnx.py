"""Int8 quantization of an ONNX embedding model with ONNX Runtime, gated on embedding quality.

    quantize:
      mode: int8
      method: dynamic            # or static (QDQ, calibrated on CALIBRATION_SENTENCES)
      per_channel: true
      keep_sensitive: true       # FFN output projections stay float...
      outlier_channels: 16       # ...or are quantized but for their 16 largest input channels
      smooth_alpha: 0.5          # SmoothQuant before dynamic quantization (calibrated)
      weights: auto              # int8 on VNNI CPUs, uint8 elsewhere (see below)
      by_cpu:                    # what differs on one class of CPU
        avx2: {weights: int7, outlier_channels: 64}
      gate: {min_cosine: 0.99, on_fail: fail}

Only the "linear" MatMuls (those whose B input is a weight initializer) are quantized; the
attention score MatMuls, LayerNorm, GELU, Softmax, the residual Adds and the pooling stay in
float, as optimum leaves them. On top of that the FFN output projections (the MatMul fed by
the GELU) stay in float by default: their input is the GELU output, whose long positive tail
is what per-tensor uint8 activations represent worst (see `sensitive_matmuls`). That tail
sits in a few channels (one channel's calibrated max is 14-25 in MiniLM's first four layers,
the next largest 5-7), so `outlier_channels: N` quantizes those MatMuls after all, except their
N largest input channels, which stay float beside them (`split_outlier_channels`). With
`smooth_alpha`, SmoothQuant first divides the few huge LayerNorm-output channels out of each
quantized MatMul's input (a Mul before its DynamicQuantizeLinear) and multiplies them into its
weight rows, so the per-tensor activation scale no longer wastes its 256 levels on them.

The nodes to quantize are passed to ONNX Runtime as an explicit `nodes_to_quantize` list, and
the written graph is checked afterwards: `quantize_dynamic` renames nodes it rewrites
(onnxruntime#19503, Gemm), which silently defeats `nodes_to_exclude`; a list of what to
quantize plus a check of what came out cannot drift that way.

The same int8 graph does not compute the same thing on every CPU. ONNX Runtime's u8s8 MatMul
(uint8 activations, int8 weights) runs vpdpbusd on VNNI CPUs, with 32-bit sums; on x86 without
VNNI it runs vpmaddubsw, which adds each pair of u8 x s8 products in 16 bits and saturates
(2 x 255 x 127 > 32767): MiniLM's recipe that scores min cosine 0.994 on a VNNI CPU scores 0.963
there. So the recipe is chosen per class of CPU (`cpu_class`: vnni, avx2, arm, other) from
`weights` and `by_cpu` (`recipe_for`), and the class, the recipe and onnxruntime's version are in
the artifact's cache key: a cache copied from another machine never lends its gate figures.

This module is the accelerator (`OnnxQuantizer`: build through the cache, gate, report); the work is
in `onnx_recipe.py` (the class of CPU, its recipe, which options go together), `onnx_graph.py`
(which MatMuls to quantize, found by structure, and the check of the written graph), `onnx_int8.py`
(quantize_onnx: ONNX Runtime's quantizers, SmoothQuant, the outlier-channel split),
`onnx_quality.py` (the embedding cosines the gate reads) and `onnx_sentences.py` (the calibration
and held-out sentences). onnxruntime and onnx are imported inside functions: importing these
modules costs nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from outrider.artifacts import Artifact, file_sha256, package_version
from outrider.errors import ArtifactError, ManifestError, QualityGateError
from outrider.manifest import Manifest

from .config import CpuClass, QuantizeConfig
from .onnx_int8 import quantize_onnx
from .onnx_quality import embedding_quality
from .onnx_recipe import check_config, check_mode, cpu_class, needs_calibration, recipe_for
from .onnx_sentences import HELDOUT_SENTENCES, calibration_feeds

log = logging.getLogger("outrider.quantize")

#: bump when the quantization recipe changes in a way the cache options cannot see
RECIPE = 1


class OnnxQuantizer:
    """Artifact transform: an fp32 ONNX file -> its int8 version, cached and quality-gated."""

    kind = "onnx-int8"
    #: the quantized graph carries its own quantize/dequantize nodes: nothing for a backend to choose
    weight_format = None

    def __init__(self, manifest: Manifest, config: QuantizeConfig, cpu: Optional[CpuClass] = None) -> None:
        self.manifest = manifest
        self.config = config
        #: the class of CPU whose kernels this artifact is built and gated for (detected by default)
        self.cpu: CpuClass = cpu or cpu_class()
        where = manifest.where
        try:
            # Every class's recipe is checked at start, not only this CPU's: a manifest that is
            # wrong for an ARM box should not wait for one to say so.
            for cls in ("vnni", "avx2", "arm", "other"):
                check_config(recipe_for(config, cls))  # type: ignore[arg-type]
            #: the recipe that runs here: the section with by_cpu[this class] applied, weights resolved
            self.recipe = recipe_for(config, self.cpu)
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc.message}") from None

    def options(self) -> dict[str, Any]:
        """What shapes the built model and its figures (part of the cache key): the recipe that
        runs here, and the class of CPU it runs on. onnxruntime's version is keyed by `apply`."""
        c = self.recipe
        return {"mode": check_mode(c), "method": c.method, "per_channel": c.per_channel, "exclude": sorted(c.exclude),
                "keep_sensitive": c.keep_sensitive, "smooth_alpha": c.smooth_alpha,
                "outlier_channels": c.outlier_channels, "weights": c.weights, "cpu_class": self.cpu,
                "recipe": RECIPE, "calibration_sentences": c.calibration_sentences if needs_calibration(c) else None}

    def apply(self, artifact: Artifact, context: Any) -> Artifact:
        """Quantize `artifact` (kind 'onnx', a .onnx file) through the cache; check the gate."""
        if artifact.kind != "onnx" or not Path(artifact.path).is_file():
            raise ManifestError(f"quantize: expected an 'onnx' artifact that is a .onnx file, got "
                                f"{artifact.kind!r} at {artifact.path}")
        for name in ("feeds", "postprocess"):
            if not callable(context.helpers.get(name)):
                raise ManifestError(f"quantize: backend {context.backend!r} gives no '{name}' helper, "
                                    "which the quality gate needs")
        src = Path(artifact.path)
        feeds, postprocess = context.helpers["feeds"], context.helpers["postprocess"]

        recipe = self.recipe

        def build(directory: Path, progress: Any) -> dict[str, Any]:
            progress.set_total(2)
            calibration = None
            if needs_calibration(recipe):
                calibration = calibration_feeds(feeds, recipe.calibration_sentences)
            done = quantize_onnx(src, directory / "model.onnx", recipe, calibration)
            progress.update(1, "quantized")
            quality = embedding_quality(src, directory / "model.onnx", HELDOUT_SENTENCES, feeds=feeds,
                                        postprocess=postprocess)
            progress.update(1, "measured")
            return {**done, **quality, "heldout_sentences": len(HELDOUT_SENTENCES), "cpu_class": self.cpu,
                    "onnxruntime": package_version("onnxruntime"),
                    "model_sha256": file_sha256(directory / "model.onnx", context.cache.root)}

        built = context.cache.get_or_build(
            self.kind, build, label=f"{self.manifest.name} int8", sources=[src],
            versions=["onnxruntime", "onnx"], device=context.device, options=self.options(),
        )
        self._check_entry(built, context.cache.root)
        figures = {k: built.provenance[k] for k in ("min_cosine", "mean_cosine") if k in built.provenance}
        failures = recipe.gate.failures(figures)
        verdict = "passed" if not failures else "failed: " + "; ".join(failures)
        context.reports.append({"transform": "quantize", "mode": "int8", **figures, "gate": verdict,
                                "cpu_class": self.cpu, "weights": recipe.weights})
        if failures:
            message = (f"model {self.manifest.name!r}: int8 ({recipe.method}, {recipe.weights} weights, for "
                       f"{self.cpu} CPUs) missed its quality gate on {len(HELDOUT_SENTENCES)} held-out sentences: "
                       f"{'; '.join(failures)} (measured {figures}; artifact {built.path})")
            if recipe.gate.on_fail == "fail":
                raise QualityGateError(message)
            log.warning("%s; serving it anyway (quantize.gate.on_fail: warn)", message)
        return Artifact(built.path / "model.onnx", "onnx", built.provenance)

    def _check_entry(self, built: Artifact, root: Path) -> None:
        """ArtifactError unless the cache entry holds the model its provenance describes, with the
        figures the gate reads: an entry damaged on disk, or copied half, must not be served, and a
        gate that finds no figure to check would pass it."""
        where = f"model {self.manifest.name!r}: cached int8 artifact {built.path}"
        fix = f"remove that directory (or run `outrider cache clear --kind {self.kind}`) and restart to rebuild it"
        model = built.path / "model.onnx"
        if not model.is_file():
            raise ArtifactError(f"{where} has no model.onnx; {fix}")
        missing = [k for k in ("min_cosine", "mean_cosine", "model_sha256") if k not in built.provenance]
        if missing:
            raise ArtifactError(f"{where}: its provenance.json lacks {missing}; {fix}")
        found = file_sha256(model, root)
        if found != built.provenance["model_sha256"]:
            raise ArtifactError(f"{where}: model.onnx has sha256 {found[:12]}..., its provenance says "
                                f"{str(built.provenance['model_sha256'])[:12]}... (changed or truncated); {fix}")
