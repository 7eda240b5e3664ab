"""`outrider bake` of an llm manifest: the GGUF's packed tiles written into the model directory.

The torch-free runtime serves a GGUF from its "llama-gguf-tiles" artifact (gguf_tiles.py), which a
first start packs from the mapped file into the artifact cache: seconds to tens of seconds, and on a
first start of a model whose tokenizer needs converting, transformers in a child. Baked, that
artifact's files lie in the directory beside the manifest (`model.path: .`), and a start maps them
as they are (gguf_tiles.baked_tiles): a fresh container converts nothing and needs neither the GGUF
nor torch, transformers or gguf.

A draft model the manifest names (`speculative.model.path`) runs on the same runtime
(CausalLM.load_draft_model), so it is baked the same way into draft/; a drafter's other files (an
EAGLE-3 head's folder, an EAGLE head's weights) are copied beside it, their paths rewritten.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping

from outrider.bake import BakedFiles
from outrider.errors import ManifestError
from outrider.generation.contract import DrafterContext
from outrider.manifest import Manifest

#: speculative drafters whose option names a file or folder that must travel with the directory
DRAFTER_FILES = {"eagle3": "path", "eagle": "weights"}


def bake_files(manifest: Manifest, raw: Mapping[str, Any], options: Any, quantized: bool) -> BakedFiles:
    """What the baked directory holds for `manifest` (LlmBackend.bake_files); ManifestError naming
    what cannot be baked, before anything is written."""
    from . import native_c
    from .gguf_tiles import NotCovered, load_gguf_tiles

    where = manifest.where
    if quantized:
        raise ManifestError(f"{where}: has a 'quantize' section, whose artifact is built and its quality gate "
                            "measured at start; bake the GGUF's own blocks (no 'quantize' section) or serve "
                            "the manifest as it is")
    why_not = ("options.runtime: torch" if options.runtime == "torch"
               else "options.weights: float" if options.weights == "float"
               else f"device {manifest.device}" if manifest.device.startswith("cuda") else "")
    loaded, reason = native_c.library()
    if not why_not and not loaded:
        why_not = f"the native kernels' C library: {reason}"
    if why_not:
        raise ManifestError(f"{where}: only the torch-free native runtime's tiles can be baked, and this manifest "
                            f"runs on torch ({why_not})")
    files: dict[str, Path] = {}
    try:
        files.update(_tiles(load_gguf_tiles(manifest.model_path()), ""))
    except NotCovered as exc:
        raise ManifestError(f"{where}: the native runtime does not serve this GGUF from its own blocks ({exc}), "
                            "so there are no tiles to bake; serve the GGUF as it is") from None
    sections = {}
    speculative = raw.get("speculative")
    if isinstance(speculative, Mapping):
        speculative = copy.deepcopy(dict(speculative))
        files.update(_drafter_files(speculative, manifest.directory, where))
        sections["speculative"] = speculative
    note = ("the GGUF is packed already into the native runtime's tiles (tiles.bin, mapped at start"
            f"{'; the draft model in draft/' if 'draft/tiles.bin' in files else ''}), so serving this "
            "directory converts nothing and needs neither the GGUF nor torch, transformers or gguf.")
    return BakedFiles(files, {}, note, sections)


def _tiles(artifact: Any, folder: str) -> dict[str, Path]:
    """The artifact's files (tiles, index, meta, tokenizer, provenance) under `folder` of the directory."""
    return {folder + path.name: path for path in sorted(Path(artifact.path).iterdir()) if path.is_file()}


def _drafter_files(speculative: dict, directory: Path, where: str) -> dict[str, Path]:
    """Files of the drafters in `speculative` (edited in place: paths now inside the baked directory)."""
    from .gguf_tiles import NotCovered, load_gguf_tiles

    files: dict[str, Path] = {}
    draft = speculative.get("model")
    if isinstance(draft, dict) and isinstance(draft.get("path"), str):
        source = _resolve(draft["path"], directory, where, "speculative.model.path")
        try:
            files.update(_tiles(load_gguf_tiles(source), "draft/"))
        except NotCovered as exc:
            raise ManifestError(f"{where}: field 'speculative.model.path': the draft model {source} is not served "
                                f"from its own blocks ({exc}), so it cannot be baked") from None
        draft["path"] = "draft"
    for drafter, key in DRAFTER_FILES.items():
        section = speculative.get(drafter)
        if not (isinstance(section, dict) and isinstance(section.get(key), str)):
            continue
        source = _resolve(section[key], directory, where, f"speculative.{drafter}.{key}")
        if source.is_dir():
            files.update({f"{drafter}/{p.relative_to(source)}": p for p in sorted(source.rglob("*")) if p.is_file()})
            section[key] = drafter
        else:
            files[f"{drafter}/{source.name}"] = source
            section[key] = f"{drafter}/{source.name}"
    return files


def _resolve(given: str, directory: Path, where: str, field: str) -> Path:
    """A drafter's file as the drafter will resolve it (DrafterContext.resolve), which must exist."""
    path = DrafterContext(directory=directory).resolve(given)
    if not path.exists():
        raise ManifestError(f"{where}: field '{field}': {path} does not exist")
    return path
