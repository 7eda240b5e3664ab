"""Where a manifest's ONNX graph comes from: a file it names, or an export in the artifact cache.

In the core (it was `outrider_onnxruntime.onnx_artifact`) because the ONNX Runtime and TensorRT
backends both build on this graph, and a plugin may not import another.

The export runs `python -m outrider.onnx.export` in a subprocess, so torch never enters
the server process. The result lives in the core artifact cache (`outrider.artifacts`), keyed by
the source weights and config, the torch and transformers versions, the opset, the task and the
export format, so a second start converts nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from ..artifacts import ArtifactCache
from ..errors import ManifestError, OutriderError
from ..manifest import Manifest
from .export import DEFAULT_OPSET, EXPORT_FORMAT  # stdlib only at import: no torch

log = logging.getLogger("outrider.onnx")

# What the exported graph depends on. Tokenizer files do not change the graph.
_SOURCE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_SOURCE_NAMES = ("config.json",)


def onnx_model(manifest: Manifest) -> Path:
    """The ONNX file for this manifest: `options.onnx` if given, else the cached export."""
    where = manifest.where
    given = manifest.options.get("onnx")
    if given:
        path = Path(os.path.expanduser(str(given)))
        path = path if path.is_absolute() else manifest.directory / path
        if not path.is_file():
            raise ManifestError(f"{where}: field 'options.onnx': {path} is not a file")
        return path
    task = manifest.model.task if manifest.model else None
    if not task:
        raise ManifestError(
            f"{where}: field 'options.onnx' or 'model.task' is required to find or export an ONNX graph"
        )
    model_dir = manifest.model_path()
    opset = int(manifest.options.get("opset", DEFAULT_OPSET))
    timeout_s = float(manifest.options.get("export_timeout_s", 900))

    def build(directory: Path, progress: object) -> dict:
        _export(manifest.name, model_dir, task, opset, directory / "model.onnx", timeout_s)
        return {"model_dir": str(model_dir)}

    artifact = ArtifactCache().get_or_build(
        "onnx", build, label=f"{manifest.name} ONNX export", sources=_source_files(model_dir),
        versions=["torch", "transformers"], device="any",
        options={"task": task, "opset": opset, "format": EXPORT_FORMAT},
    )
    return artifact.file("model.onnx")


def _source_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise ManifestError(f"model directory {model_dir} does not exist")
    sources = sorted(p for p in model_dir.iterdir()
                     if p.is_file() and (p.name in _SOURCE_NAMES or p.suffix in _SOURCE_SUFFIXES))
    if not sources:
        raise ManifestError(f"model directory {model_dir} has no config.json or weights to export from")
    return sources


def _export(model: str, model_dir: Path, task: str, opset: int, target: Path, timeout_s: float) -> None:
    import subprocess  # only a first start exports: the others never need it

    command = [sys.executable, "-m", "outrider.onnx.export", "--model-dir", str(model_dir),
               "--task", task, "--out", str(target), "--opset", str(opset)]
    log.info("exporting %s to ONNX (first start; cached in %s)", model, target.parent)
    start = time.monotonic()
    # stderr goes to a file, not a pipe: a chatty exporter cannot fill a pipe and stall.
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr)
        while True:
            try:
                proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - start
                if elapsed > timeout_s:
                    proc.kill()
                    proc.wait()
                    raise OutriderError(f"exporting {model} to ONNX took over {timeout_s:.0f} s; killed",
                                        code="export_failed") from None
                log.info("exporting %s to ONNX... %.0f s", model, elapsed)
        if proc.returncode != 0:
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace")[-3000:]
            raise OutriderError(
                f"exporting {model} to ONNX failed (exit status {proc.returncode}): {' '.join(command)}\n{tail}",
                code="export_failed",
            )
    log.info("exported %s to ONNX in %.1f s", model, time.monotonic() - start)
