"""`outrider bake MANIFEST OUTDIR`: a manifest's model written into a directory that serves as it is.

    outrider bake manifests/minilm.yaml /models/minilm

writes

    /models/minilm/manifest.yaml   the manifest, with `model.path: .` and options pointing at the baked files
    /models/minilm/model.onnx      what the backend baked (ONNX Runtime: the exported graph, from the
                                   artifact cache, exported if absent)
    /models/minilm/*.json, ...     every file of the model directory except the weights
                                   (tokenizer, configs: what the task reads)

A GGUF on the llm backend bakes into the native runtime's packed tiles (tiles.bin, tiles.json,
meta.json, tokenizer.json) with `model.path: .`, and a draft model named by the manifest into
draft/: the directory serves without the GGUF, torch, transformers or gguf.

`outrider serve /models/minilm/manifest.yaml` then converts nothing at start, so the image that
serves it needs none of the converters (docker/Dockerfile.cpu bakes in a build stage that has
torch, and copies only the directory). The same directory works on a mounted volume or as a
KServe `storageUri`. The model name stays the manifest's.

Baking is a capability a backend class declares by subclassing `BakesModel`: the backend names
the files its model needs and the options that point at them; this module copies and writes.
"""

from __future__ import annotations

import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from .errors import ManifestError
from .manifest import Manifest, load_manifest

#: model-directory files left out of the baked directory: the backend's baked files replace them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


@dataclass(frozen=True)
class BakedFiles:
    """What a backend's model needs in the baked directory."""

    #: name in the baked directory -> the file to copy there
    files: Mapping[str, Path]
    #: manifest `options` that point the backend at those files
    options: Mapping[str, Any]
    #: for the baked manifest's header: what is baked, what serving the directory needs
    note: str
    #: top-level manifest sections replaced in the baked manifest (a drafter's file moved into the
    #: directory: its section with the path rewritten)
    sections: Mapping[str, Any] = field(default_factory=dict)


class BakesModel:
    """Mixin of a backend class whose model `outrider bake` can write into a directory."""

    @classmethod
    def bake_files(cls, manifest: Manifest, raw: Mapping[str, Any]) -> BakedFiles:
        """Build (or find) what serving `manifest` needs; `raw` is the manifest as written. A manifest
        that cannot be baked raises ManifestError saying why."""
        raise NotImplementedError


def bake(manifest_path: Path, out: Path, backends: Mapping[str, type]) -> Path:
    """Write the model directory `out` for `manifest_path` with a backend of `backends` (the
    registry's); return the baked manifest's path."""
    raw = yaml.safe_load(manifest_path.read_text())
    manifest = load_manifest(manifest_path)
    baker = _baker(manifest_path, manifest, backends)
    baked_files = baker.bake_files(manifest, raw)
    model_dir = manifest.model_path() if manifest.model else None

    out.mkdir(parents=True, exist_ok=True)
    if model_dir is not None and model_dir.is_dir():
        for path in sorted(model_dir.rglob("*")):
            relative = path.relative_to(model_dir)
            if path.is_file() and path.suffix not in WEIGHT_SUFFIXES and not relative.parts[0].startswith("."):
                (out / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, out / relative)
    for name, source in baked_files.files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, out / name)

    model = dict(raw.get("model") or {})
    model.pop("package", None)
    model["path"] = "."
    raw["model"] = model
    raw["options"] = {**(raw.get("options") or {}), **baked_files.options}
    raw.update(baked_files.sections)
    baked = out / "manifest.yaml"
    header = textwrap.fill(f"Baked from {manifest_path.name} by `outrider bake`: {baked_files.note}", width=98,
                           initial_indent="# ", subsequent_indent="# ")
    baked.write_text(header + "\n" + yaml.safe_dump(raw, sort_keys=False))
    load_manifest(baked)  # the result must validate
    return baked


def _baker(manifest_path: Path, manifest: Manifest, backends: Mapping[str, type]) -> type[BakesModel]:
    """The class that bakes: every backend the manifest may run on must bake (the first one does)."""
    can_bake = ", ".join(sorted(name for name, cls in backends.items() if issubclass(cls, BakesModel)))
    for name in manifest.backend_preferences:
        cls = backends.get(name)
        if cls is None:
            raise ManifestError(f"{manifest_path}: no loaded plugin registers backend {name!r} (load it through "
                                f"OUTRIDER_PLUGINS or --plugin MODULE; backends that bake: {can_bake or 'none'})")
        if not issubclass(cls, BakesModel):
            raise ManifestError(f"{manifest_path}: backend {name!r} cannot bake a model directory "
                                f"(backends that can: {can_bake or 'none'})")
    return backends[manifest.backend_preferences[0]]
