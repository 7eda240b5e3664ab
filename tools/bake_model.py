#!/usr/bin/env python3
"""Bake an ONNX Runtime manifest into a self-contained model directory that needs no torch.

    python tools/bake_model.py manifests/minilm.yaml /models/minilm

writes

    /models/minilm/manifest.yaml   the manifest, with `model.path: .` and `options.onnx: model.onnx`
    /models/minilm/model.onnx      the exported graph (from the artifact cache, exported if absent)
    /models/minilm/*.json, ...     every file of the model directory except the weights
                                   (tokenizer, configs: what the text task reads)

`outrider serve /models/minilm/manifest.yaml` then loads the graph as it is: no export, so no
torch, transformers or onnx in the image that serves it (docker/Dockerfile.cpu runs this in a
build stage that has torch, and copies only the directory). The same directory works on a
mounted volume or as a KServe `storageUri`. The model name stays the manifest's.

Manifests with a `quantize` section are refused: quantizing needs the `onnx` package at start;
serve those from the full image (docker/Dockerfile.full) or install `onnx` beside the slim one.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
ORT_BACKENDS = {"onnxruntime", "onnxruntime-cpu", "onnxruntime-cuda", "onnxruntime-tensorrt"}


def bake(manifest_path: Path, out: Path) -> Path:
    """Write the model directory `out` for `manifest_path`; return the baked manifest's path."""
    from outrider.manifest import load_manifest
    from outrider_onnxruntime.onnx_artifact import onnx_model

    raw = yaml.safe_load(manifest_path.read_text())
    manifest = load_manifest(manifest_path)
    if not set(manifest.backend_preferences) <= ORT_BACKENDS:
        raise SystemExit(f"{manifest_path}: backend {manifest.backend!r} is not ONNX Runtime; only those bake to a graph")
    if raw.get("quantize"):
        raise SystemExit(f"{manifest_path}: has a 'quantize' section, which needs the onnx package at start; "
                         "serve it from the full image")
    source = onnx_model(manifest)  # the artifact cache's export, or options.onnx as given
    model_dir = manifest.model_path() if manifest.model else None

    out.mkdir(parents=True, exist_ok=True)
    if model_dir is not None and model_dir.is_dir():
        for path in sorted(model_dir.rglob("*")):
            relative = path.relative_to(model_dir)
            if path.is_file() and path.suffix not in WEIGHT_SUFFIXES and not relative.parts[0].startswith("."):
                (out / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, out / relative)
    shutil.copyfile(source, out / "model.onnx")

    model = dict(raw.get("model") or {})
    model.pop("package", None)
    model["path"] = "."
    raw["model"] = model
    raw["options"] = {**(raw.get("options") or {}), "onnx": "model.onnx"}
    baked = out / "manifest.yaml"
    header = (f"# Baked from {manifest_path.name} by tools/bake_model.py: the ONNX graph is exported already\n"
              f"# (model.onnx), so serving this directory needs onnxruntime and tokenizers, not torch.\n")
    baked.write_text(header + yaml.safe_dump(raw, sort_keys=False))
    load_manifest(baked)  # the result must validate
    return baked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifest", type=Path)
    parser.add_argument("out", type=Path, help="model directory to write (created)")
    args = parser.parse_args()
    baked = bake(args.manifest, args.out)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{baked}: {size / 1e6:.1f} MB in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
