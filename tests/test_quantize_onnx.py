"""ONNX int8 quantization of MiniLM: quality on held-out sentences, the gate, the cache, bad modes.

Runs on the real all-MiniLM-L6-v2 export (cached in the default artifact cache, or
$OUTRIDER_CACHE_DIR); the quantized entries go to a temporary cache, built once per module.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from outrider.accelerators import TransformContext
from outrider.artifacts import Artifact, ArtifactCache
from outrider.errors import ManifestError, QualityGateError

from conftest import MANIFESTS

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from outrider_quantize.config import QuantizeConfig  # noqa: E402
from outrider_quantize.onnx import OnnxQuantizer  # noqa: E402
from outrider_quantize.onnx_graph import choose_nodes, sensitive_matmuls  # noqa: E402
from outrider_quantize.onnx_int8 import activation_ranges, quantize_onnx, split_outlier_channels  # noqa: E402
from outrider_quantize.onnx_quality import embedding_quality  # noqa: E402
from outrider_quantize.onnx_recipe import cpu_class, recipe_for  # noqa: E402
from outrider_quantize.onnx_sentences import CALIBRATION_SENTENCES, HELDOUT_SENTENCES, calibration_feeds  # noqa: E402


class CountingCache(ArtifactCache):
    """The real cache, counting how many times it had to call a build."""

    builds = 0

    def get_or_build(self, kind: str, build: Any, **kwargs: Any) -> Artifact:
        def counted(directory: Path, progress: Any) -> Any:
            type(self).builds += 1
            return build(directory, progress)

        return super().get_or_build(kind, counted, **kwargs)


def load_manifest_int8():
    from outrider.manifest import load_manifest

    return load_manifest(MANIFESTS / "minilm-int8.yaml")


@pytest.fixture(scope="module")
def manifest():
    return load_manifest_int8()


@pytest.fixture(scope="module")
def task(manifest):
    from outrider_text import SentenceEmbeddingTask

    return SentenceEmbeddingTask(manifest)


@pytest.fixture(scope="module")
def fp32(manifest) -> Path:
    pytest.importorskip("torch")  # the fp32 graph is exported from the safetensors once, then cached
    from outrider.onnx.artifact import onnx_model

    return onnx_model(manifest)


@pytest.fixture(scope="module")
def helpers(task) -> dict[str, Any]:
    # What the ORT backend hands a transform: its task's tokenizer and output step.
    return {"feeds": lambda sentences: task.preprocess({"text": np.array(sentences, dtype=object)}),
            "postprocess": task.postprocess}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> CountingCache:
    return CountingCache(tmp_path_factory.mktemp("artifacts"))


def _context(manifest, cache, helpers) -> TransformContext:
    return TransformContext(manifest=manifest, backend="onnxruntime-cpu", device="cpu", cache=cache, helpers=helpers)


def _config(manifest, **changes: Any) -> QuantizeConfig:
    data = {**manifest.section("quantize"), **changes}
    return QuantizeConfig.model_validate(data)


@pytest.fixture(scope="module")
def quantized(manifest, fp32, cache, helpers) -> tuple[Artifact, TransformContext]:
    context = _context(manifest, cache, helpers)
    out = OnnxQuantizer(manifest, _config(manifest)).apply(Artifact(fp32, "onnx"), context)
    return out, context


def test_calibration_and_heldout_sets_are_disjoint_and_varied():
    assert not set(CALIBRATION_SENTENCES) & set(HELDOUT_SENTENCES)
    assert len(CALIBRATION_SENTENCES) >= 60 and len(HELDOUT_SENTENCES) >= 60
    for sentences in (CALIBRATION_SENTENCES, HELDOUT_SENTENCES):
        assert any(len(s.split()) <= 2 for s in sentences)          # very short
        assert any(len(s.split()) >= 20 for s in sentences)         # long
        assert any("def " in s or "SELECT" in s or "UPDATE" in s for s in sentences)  # code
        assert any("ü" in s or "ä" in s or "ö" in s for s in sentences)  # German
        assert any(ord(c) > 0x1F000 for s in sentences for c in s)  # emoji
        assert any(s.endswith("?") for s in sentences)              # questions


def test_int8_meets_the_gate_on_heldout_sentences(quantized, fp32, helpers):
    artifact, context = quantized
    assert artifact.kind == "onnx" and artifact.path.name == "model.onnx" and artifact.path.is_file()
    assert artifact.provenance["min_cosine"] >= 0.99
    assert context.reports[-1]["transform"] == "quantize" and context.reports[-1]["gate"] == "passed"
    # Measured again here, not only trusted from the provenance file.
    quality = embedding_quality(fp32, artifact.path, HELDOUT_SENTENCES, feeds=helpers["feeds"],
                                postprocess=helpers["postprocess"])
    assert quality["min_cosine"] >= 0.99 and quality["mean_cosine"] >= 0.995
    assert quality["compared"] == 2 * len(HELDOUT_SENTENCES)  # each alone and in batches of 32


def test_int8_keeps_the_contract_and_the_planned_nodes(quantized, fp32):
    import onnx
    import onnxruntime

    artifact, _ = quantized
    graph = onnx.load(str(artifact.path))
    ops = {n.op_type for n in graph.graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops
    kept = artifact.provenance["float_nodes"]
    sensitive = sensitive_matmuls(onnx.load(str(fp32)))
    assert len(sensitive) == 6
    # The shipped recipe splits the FFN output projections: their few outlier input channels
    # stay in a float MatMul of their own, the rest is quantized. How many depends on the class of
    # this CPU (16 with VNNI, 64 on AVX2 with 7-bit weights): derived from the detection.
    channels = recipe_for(_config(load_manifest_int8()), cpu_class()).outlier_channels
    assert artifact.provenance["outlier_channels"] == channels and artifact.provenance["cpu_class"] == cpu_class()
    assert kept == [f"{n}_outlier" for n in sensitive]
    assert all(n.op_type == "MatMul" for n in graph.graph.node if n.name in kept)
    weights = {i.name: i for i in graph.graph.initializer}
    assert all(list(weights[n.input[1]].dims) == [channels, 384] for n in graph.graph.node if n.name in kept)
    session = onnxruntime.InferenceSession(str(artifact.path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["embedding"]
    assert {i.name for i in session.get_inputs()} <= {"input_ids", "attention_mask", "token_type_ids"}


def test_second_apply_builds_nothing(quantized, manifest, fp32, cache, helpers):
    first, _ = quantized
    builds = CountingCache.builds
    again = OnnxQuantizer(manifest, _config(manifest)).apply(Artifact(fp32, "onnx"), _context(manifest, cache, helpers))
    assert CountingCache.builds == builds
    assert again.path == first.path
    assert again.provenance["created"] == first.provenance["created"]


def test_gate_set_impossibly_high_fails_and_warn_serves(quantized, manifest, fp32, cache, helpers, caplog):
    builds = CountingCache.builds
    strict = _config(manifest, gate={"min_cosine": 1.0, "on_fail": "fail"})
    context = _context(manifest, cache, helpers)
    with pytest.raises(QualityGateError, match=r"min_cosine 0\.9\d+ \(needs >= 1\)"):
        OnnxQuantizer(manifest, strict).apply(Artifact(fp32, "onnx"), context)
    assert context.reports[-1]["gate"].startswith("failed: min_cosine")

    lenient = _config(manifest, gate={"min_cosine": 1.0, "on_fail": "warn"})
    with caplog.at_level(logging.WARNING, logger="outrider.quantize"):
        served = OnnxQuantizer(manifest, lenient).apply(Artifact(fp32, "onnx"), context)
    assert served.path == quantized[0].path
    assert "missed its quality gate" in caplog.text
    assert context.reports[-1]["gate"].startswith("failed:")
    assert CountingCache.builds == builds  # the gate is checked against the cached figures


@pytest.mark.parametrize("mode", ["int4", "bf16", "fp16"])
def test_modes_other_than_int8_are_manifest_errors(manifest, mode):
    with pytest.raises(ManifestError, match=r"quantize\.mode.*int8"):
        OnnxQuantizer(manifest, _config(manifest, mode=mode))


def test_auto_mode_means_int8(manifest):
    assert OnnxQuantizer(manifest, _config(manifest, mode="auto")).options()["mode"] == "int8"


def test_bad_exclude_pattern_and_static_smoothing_are_manifest_errors(fp32, tmp_path):
    import onnx

    model = onnx.load(str(fp32))
    with pytest.raises(ManifestError, match=r"quantize\.exclude.*match no quantizable MatMul"):
        choose_nodes(model, QuantizeConfig(mode="int8", exclude=["*/ffn_out/*"]))
    with pytest.raises(ManifestError, match=r"quantize\.smooth_alpha.*dynamic"):
        quantize_onnx(fp32, tmp_path / "x.onnx", QuantizeConfig(mode="int8", method="static", smooth_alpha=0.5))


def test_exclude_patterns_stay_float_after_quantize_dynamic(fp32, tmp_path):
    import onnx

    config = QuantizeConfig(mode="int8", keep_sensitive=False, exclude=["*/layer.0/attention/self/query/MatMul"])
    done = quantize_onnx(fp32, tmp_path / "q.onnx", config)
    assert done["float_nodes"] == ["/encoder/encoder/layer.0/attention/self/query/MatMul"]
    out = onnx.load(str(tmp_path / "q.onnx"))
    assert [n.op_type for n in out.graph.node if n.name in done["float_nodes"]] == ["MatMul"]
    assert done["quantized_nodes"] == 35  # 6 layers x (Q, K, V, attention out, FFN in, FFN out) - 1


def test_outlier_split_is_exact_in_float_and_keeps_the_largest_channels(fp32, helpers):
    import onnx
    import onnxruntime

    model = onnx.load(str(fp32))
    sensitive = sensitive_matmuls(model)
    inputs = {n.name: n.input[0] for n in model.graph.node if n.name in sensitive}
    feeds = calibration_feeds(helpers["feeds"], 8)
    amax = activation_ranges(model, sorted(inputs.values()), feeds)
    inliers, outliers = split_outlier_channels(model, sensitive, amax, 4)
    assert inliers == [f"{n}_inlier" for n in sensitive] and outliers == [f"{n}_outlier" for n in sensitive]
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for name, tensor in inputs.items():
        index = inits[f"{name}_outlier_index"]
        # The four channels with the largest calibrated max |x|, and only those, are taken out.
        assert set(index) == set(np.argsort(amax[tensor])[-4:])
        assert set(np.flatnonzero(inits[f"{name}_inlier_mask"] == 0)) == set(index)
    # Before quantization the split graph computes the same function: (x * mask) W + x[idx] W[idx].
    original = onnxruntime.InferenceSession(str(fp32), providers=["CPUExecutionProvider"])
    split = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in original.get_inputs()]
    for batch in feeds[-2:]:
        feed = {n: batch[n] for n in names}
        np.testing.assert_allclose(split.run(None, feed)[0], original.run(None, feed)[0], atol=2e-5)


def test_outlier_split_options_are_checked(fp32, tmp_path):
    import onnx

    with pytest.raises(ManifestError, match=r"quantize\.outlier_channels.*dynamic"):
        quantize_onnx(fp32, tmp_path / "x.onnx", QuantizeConfig(mode="int8", method="static", outlier_channels=8))
    with pytest.raises(ManifestError, match=r"quantize\.outlier_channels.*keep_sensitive: true"):
        quantize_onnx(fp32, tmp_path / "x.onnx", QuantizeConfig(mode="int8", keep_sensitive=False, outlier_channels=8))
    with pytest.raises(ManifestError, match=r"outlier_channels needs calibration feeds"):
        quantize_onnx(fp32, tmp_path / "x.onnx", QuantizeConfig(mode="int8", outlier_channels=8))
    model = onnx.load(str(fp32))
    sensitive = sensitive_matmuls(model)[:1]
    with pytest.raises(ManifestError, match=r"not fewer than the 1536 input channels"):
        split_outlier_channels(model, sensitive, {}, 1536)


# -- one recipe per class of CPU -----------------------------------------------------------------


@pytest.mark.parametrize(("flags", "machine", "expected"), [
    ({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, "x86_64", "vnni"),   # Cascade Lake, Zen 4/5
    ({"avx2", "avx512_vnni", "amx_int8", "amx_tile"}, "x86_64", "vnni"),  # Sapphire Rapids (AMX)
    ({"avx2", "avx_vnni"}, "x86_64", "vnni"),                             # Alder Lake, N100 has none: below
    ({"avx2", "fma"}, "x86_64", "avx2"),                                  # Zen 2/3, Haswell, N100/N305
    ({"avx2", "avx512f", "avx512bw"}, "x86_64", "avx2"),                  # Skylake-SP: AVX-512, no VNNI
    ({"sse4_1", "sse4_2"}, "x86_64", "other"),                            # pmaddubsw saturates too
    (set(), "x86_64", "other"),                                           # no /proc/cpuinfo: the safe recipe
    (set(), "aarch64", "arm"),
    ({"avx512_vnni"}, "riscv64", "other"),
])
def test_cpu_class_from_flags_and_machine(flags, machine, expected):
    assert cpu_class(flags, machine) == expected


def test_cpu_class_here_agrees_with_the_flags():
    import platform

    from outrider.hardware import cpu_flags

    assert cpu_class() == cpu_class(cpu_flags(), platform.machine())


# The recipes documented in manifests/minilm-int8.yaml and docs/ACCELERATORS.md, per class.
DOCUMENTED = {
    "vnni": {"weights": "int8", "outlier_channels": 16},
    "avx2": {"weights": "int7", "outlier_channels": 64},
    "arm": {"weights": "uint8", "outlier_channels": 16},
    "other": {"weights": "uint8", "outlier_channels": 16},
}


@pytest.mark.parametrize("cls", sorted(DOCUMENTED))
def test_the_recipe_chosen_for_each_class_is_the_documented_one(manifest, monkeypatch, cls):
    import outrider_quantize.onnx as onnx_quantize

    monkeypatch.setattr(onnx_quantize, "cpu_class", lambda *a, **k: cls)  # this CPU taken for one of class cls
    quantizer = OnnxQuantizer(manifest, _config(manifest))
    assert quantizer.cpu == cls
    options = quantizer.options()
    assert {k: options[k] for k in DOCUMENTED[cls]} == DOCUMENTED[cls]
    # What every class shares: dynamic, per channel, SmoothQuant 0.5, the FFN output projections split.
    assert (options["method"], options["per_channel"], options["smooth_alpha"], options["keep_sensitive"]) == \
        ("dynamic", True, 0.5, True)
    assert options["cpu_class"] == cls


def test_weights_auto_is_int8_only_with_vnni():
    config = QuantizeConfig(mode="int8")
    assert {cls: recipe_for(config, cls).weights for cls in DOCUMENTED} == \
        {"vnni": "int8", "avx2": "uint8", "arm": "uint8", "other": "uint8"}
    # by_cpu fields replace the section's only on their class; an explicit null is a value too.
    config = QuantizeConfig(mode="int8", outlier_channels=16, smooth_alpha=0.5,
                            by_cpu={"arm": {"weights": "int8", "outlier_channels": None}})
    assert (recipe_for(config, "arm").weights, recipe_for(config, "arm").outlier_channels) == ("int8", None)
    assert recipe_for(config, "vnni").outlier_channels == 16 and recipe_for(config, "arm").smooth_alpha == 0.5


def test_by_cpu_is_checked_for_every_class_at_start(manifest):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        QuantizeConfig(mode="int8", by_cpu={"sse": {"weights": "uint8"}})
    with pytest.raises(ValidationError):
        QuantizeConfig(mode="int8", by_cpu={"avx2": {"weights": "int4"}})
    # Wrong only for ARM (a split needs keep_sensitive), found on any machine.
    bad = _config(manifest, by_cpu={"arm": {"keep_sensitive": False}})
    with pytest.raises(ManifestError, match=r"minilm-int8\.yaml.*outlier_channels.*keep_sensitive"):
        OnnxQuantizer(manifest, bad)


def test_cache_key_differs_by_cpu_class_onnxruntime_version_and_recipe(manifest, fp32, tmp_path, monkeypatch):
    import outrider.artifacts as artifacts
    import outrider_quantize.onnx as onnx_quantize

    cache = ArtifactCache(tmp_path)

    def key(cls: str, config: QuantizeConfig) -> str:
        monkeypatch.setattr(onnx_quantize, "cpu_class", lambda *a, **k: cls)
        options = OnnxQuantizer(manifest, config).options()
        return cache.key("onnx-int8", [fp32], ["onnxruntime", "onnx"], "cpu", options)[0]

    shipped = _config(manifest)
    keys = {cls: key(cls, shipped) for cls in DOCUMENTED}
    assert len(set(keys.values())) == 4  # arm and other share a recipe, not a key
    # The same recipe forced on two classes still keys apart: the kernels differ, so do the figures.
    same = _config(manifest, weights="uint8", by_cpu={})
    assert key("avx2", same) != key("other", same)
    # Another onnxruntime: another key (its kernels, and so its figures, may differ).
    real = artifacts.package_version
    monkeypatch.setattr(artifacts, "package_version", lambda name: "0.0.0" if name == "onnxruntime" else real(name))
    assert key("vnni", shipped) != keys["vnni"]


def test_a_damaged_cache_entry_is_an_artifact_error_not_a_pass(quantized, manifest, fp32, helpers, tmp_path):
    import json
    import shutil

    from outrider.errors import ArtifactError

    # A copy of the module's built entry in a cache of its own, damaged three ways in turn.
    built, _ = quantized
    cache = ArtifactCache(tmp_path / "cache")
    entry = tmp_path / "cache" / "onnx-int8" / built.path.parent.name
    shutil.copytree(built.path.parent, entry)
    context = _context(manifest, cache, helpers)
    quantizer = OnnxQuantizer(manifest, _config(manifest))
    assert quantizer.apply(Artifact(fp32, "onnx"), context).path == entry / "model.onnx"  # intact: served

    provenance = json.loads((entry / "provenance.json").read_text())
    with open(entry / "model.onnx", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ArtifactError, match=r"model\.onnx has sha256 .* \(changed or truncated\)") as caught:
        quantizer.apply(Artifact(fp32, "onnx"), context)
    assert caught.value.deterministic and "outrider cache clear --kind onnx-int8" in caught.value.message
    (entry / "model.onnx").unlink()
    with pytest.raises(ArtifactError, match="has no model.onnx"):
        quantizer.apply(Artifact(fp32, "onnx"), context)
    # Figures gone from the provenance must not make the gate pass by having nothing to check.
    shutil.copy(built.path, entry / "model.onnx")
    del provenance["min_cosine"]
    (entry / "provenance.json").write_text(json.dumps(provenance))
    with pytest.raises(ArtifactError, match=r"provenance\.json lacks \['min_cosine'\]"):
        quantizer.apply(Artifact(fp32, "onnx"), context)


@pytest.mark.parametrize("cls", ["avx2", "arm"])
def test_the_non_saturating_recipes_pass_the_gate_on_any_cpu(manifest, fp32, helpers, tmp_path, cls):
    # int7 and uint8 sums cannot saturate, so every kernel computes them exactly: the figures for
    # the AVX2 (and ARM/other) recipe measured here are the ones an AVX2-only CPU measures (checked
    # under qemu -cpu Haswell, see docs/ACCELERATORS.md); the VNNI recipe is gated above, only where
    # this CPU is of that class.
    quantizer = OnnxQuantizer(manifest, _config(manifest), cpu=cls)
    out = quantizer.apply(Artifact(fp32, "onnx"), _context(manifest, ArtifactCache(tmp_path), helpers))
    assert out.provenance["cpu_class"] == cls and out.provenance["weights"] == DOCUMENTED[cls]["weights"]
    assert out.provenance["min_cosine"] >= 0.992 and out.provenance["mean_cosine"] >= 0.997
