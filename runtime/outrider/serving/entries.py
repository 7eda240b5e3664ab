"""A repository entry (`ModelEntry`: one model the server may serve and what is loaded of it) and
the fingerprints that tell when its manifest or model file changed (the watch scan compares them)."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import ManifestError
from ..manifest import Manifest, SectionCheck, load_manifest
from .request import ModelState
from .served_model import ServedModel

AVAILABLE, LOADING, READY, UNLOADING, FAILED = "available", "loading", "ready", "unloading", "failed"
_MANIFEST_SUFFIXES = (".yaml", ".yml")


@dataclass(eq=False)
class ModelEntry:
    """One model the server may serve: its manifest file, what is loaded of it, and why not."""

    name: str
    path: Optional[Path]  # the manifest file (None for a manifest built in process)
    manifest: Optional[Manifest]  # None when its file does not validate (`reason` says why)
    fingerprint: str = ""
    served: Optional[ServedModel] = None
    #: a newer version loading beside `served` (a reload); takes the name once ready
    pending: Optional[ServedModel] = None
    version: int = 0
    unloading: bool = False
    reason: str = ""  # why the last load or reload failed, or why the file does not validate
    #: RSS at the load's start; its resident cost is measured once it is ready (`measured`)
    rss_before_load: int = 0
    measured: bool = True
    #: whether the load's backend had loaded a model in this process before it (its libraries
    #: imported, its arenas made): such a load costs only what the model itself holds
    warm_load: bool = False
    #: (fingerprint and warmth, estimate) of `MemoryBudget.estimate`: health asks for it on
    #: every call, and finding it reads the cost file and walks the model's directory
    estimate_memo: Optional[tuple[str, Optional[tuple[int, str]]]] = None
    #: a load under way before its ServedModel exists (making room, building)
    loader: Optional[Any] = None  # a pending_load.PendingLoad
    #: guards the fields above; held only to decide, never while loading or draining
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state(self) -> str:
        if self.unloading:
            return UNLOADING
        if self.served is None:
            return LOADING if self.loader is not None else (FAILED if self.reason else AVAILABLE)
        state = self.served.state
        if state in (ModelState.READY, ModelState.DEGRADED):
            return READY if self.served.ready else FAILED
        return {ModelState.LOADING: LOADING, ModelState.FAILED: FAILED}.get(state, AVAILABLE)


def manifest_files(directory: Path) -> list[Path]:
    """The manifest files of a `--models` directory, in name order."""
    return sorted(p for p in directory.iterdir() if p.suffix in _MANIFEST_SUFFIXES and p.is_file())


def read_entry(path: Path, overrides: list[str], check_section: Optional[SectionCheck]) -> ModelEntry:
    """The entry of one manifest file; a file that does not validate becomes a failed entry
    named after the file, so the index says why it is not served."""
    try:
        manifest = load_manifest(path, overrides, check_section)
    except ManifestError as exc:
        return ModelEntry(path.stem, path, None, entry_fingerprint(path, None), reason=exc.message)
    return ModelEntry(manifest.name, path, manifest, entry_fingerprint(path, manifest))


def raw_part(fingerprint: str) -> str:
    return fingerprint.split("+", 1)[0]


def entry_fingerprint(path: Optional[Path], manifest: Optional[Manifest]) -> str:
    """The manifest file's bytes hash, then (for a manifest) its model file's size and mtime."""
    raw = ""
    if path is not None:
        try:
            raw = hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
        except OSError:
            raw = "unreadable"
    if manifest is None:
        return raw
    return raw + "+" + artifact_stamp(manifest)


def model_path(manifest: Manifest) -> Optional[Path]:
    if manifest.model is None:
        return None
    base = Path(manifest.source_file).parent if manifest.source_file else Path.cwd()
    try:
        return manifest.model.resolve(base)
    except ManifestError:
        return None


def artifact_stamp(manifest: Manifest) -> str:
    path = model_path(manifest)
    if path is None or not path.is_file():
        return ""  # a package directory is versioned by pip, not watched file by file
    try:
        st = path.stat()
    except OSError:
        return ""
    return f"{st.st_size}:{st.st_mtime_ns}"


def artifact_changed(entry: ModelEntry) -> bool:
    if entry.manifest is None:
        return False
    return entry.fingerprint.split("+", 1)[-1] != artifact_stamp(entry.manifest)


def artifact_bytes(manifest: Manifest) -> int:
    path = model_path(manifest)
    if path is None:
        return 0
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix != ".py")
    except OSError:
        return 0
    return 0
