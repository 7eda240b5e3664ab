"""One artifact cache for everything built before load: ONNX exports, converted or quantized
weights, TensorRT engines.

    cache = ArtifactCache()                       # $OUTRIDER_CACHE_DIR, else ~/.cache/outrider
    art = cache.get_or_build(
        "onnx-int8", build, label="minilm int8",
        sources=[model_onnx], versions=["onnxruntime"], device="cpu", options={"per_channel": True},
    )
    art.path          # a directory holding what `build(directory, progress)` wrote
    art.provenance    # what, from what, with which versions, how long, and build()'s own figures

The key is a sha256 over the kind, the sources' content hashes (memoized by path, size, inode
and mtime, so a restart does not rehash a 100 MB file), the named packages' versions, the device
and the options. A file lock per entry makes two processes that start together build it once;
the build writes into a temporary sibling directory that is renamed into place, so a crash never
leaves a half-written entry. Builds longer than a second show a tqdm bar on a terminal and log
lines otherwise. Imports nothing heavy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

log = logging.getLogger("outrider.artifacts")

CACHE_ENV = "OUTRIDER_CACHE_DIR"
PROVENANCE = "provenance.json"
# Bumped when the cache layout changes: older entries are then simply not found.
LAYOUT = 1


def cache_root() -> Path:
    """$OUTRIDER_CACHE_DIR, or ~/.cache/outrider."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "outrider").expanduser()


def package_version(package: str) -> str:
    """An installed distribution's version from its metadata (imports nothing), or 'absent'.

    The `Version:` header of the METADATA of the first `*.dist-info` directory on the import path
    whose name is the package's, found as importlib.metadata finds it, but without importing it
    (~14 ms at a start, for its email parser and zipfile) nor running the email parser over the
    whole file. An egg-info distribution is left to importlib.metadata."""
    wanted = _normalized_name(package)
    for entry in sys.path:
        for name in metadata_directories(entry) or ():
            if _normalized_name(name.rsplit(".", 1)[0].split("-")[0]) != wanted:
                continue
            if not name.endswith(".dist-info"):
                return _package_version_by_importlib(package)
            try:
                with open(os.path.join(entry or ".", name, "METADATA"), encoding="utf-8") as f:
                    for line in f:
                        line = line.rstrip("\r\n")
                        if not line:  # the headers end at the first blank line
                            break
                        if line[:8].lower() == "version:":
                            return line[8:].strip()
            except OSError:
                pass
            return _package_version_by_importlib(package)
    return "absent"


def metadata_directories(entry: str) -> Optional[list[str]]:
    """The names of the distributions' metadata directories (`*.dist-info`, `*.egg-info`) in one
    import path entry ('' is the current directory), as listed; None where it cannot be listed."""
    try:
        with os.scandir(entry or ".") as listing:
            return [e.name for e in listing if e.name.endswith((".dist-info", ".egg-info"))]
    except OSError:
        return None


def _normalized_name(name: str) -> str:
    """A distribution's name as PEP 503 compares it (and as dist-info directories spell it)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _package_version_by_importlib(package: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(package) or "absent"
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _hash_memo(path: Path, root: Optional[Path]) -> Path:
    stat = path.stat()
    stamp = f"{path.resolve()}|{stat.st_size}|{stat.st_ino}|{stat.st_mtime_ns}"
    return (root or cache_root()) / "sha256" / hashlib.sha256(stamp.encode()).hexdigest()


def hash_remembered(path: Union[str, os.PathLike], root: Optional[Path] = None) -> bool:
    """Whether `file_sha256` of this file (as it is now) is remembered: a file never hashed into
    this cache is, nearly always, one whose artifacts are not built yet (a first start)."""
    return _hash_memo(Path(path), root).is_file()


def file_sha256(path: Union[str, os.PathLike], root: Optional[Path] = None) -> str:
    """sha256 of a file, remembered by path, size, inode and mtime so that restarts skip rehashing."""
    path = Path(path)
    memo = _hash_memo(path, root)
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            hasher.update(chunk)
    value = hasher.hexdigest()
    try:
        _atomic_write(memo, value)
    except OSError:  # a read-only cache only costs the rehash next time
        pass
    return value


def source_hash(source: Union[str, os.PathLike], root: Optional[Path] = None) -> str:
    """Content hash of a file, or of a directory's files (names and contents, sorted)."""
    path = Path(source)
    if path.is_file():
        return file_sha256(path, root)
    if path.is_dir():
        digest = hashlib.sha256()
        for child in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(str(child.relative_to(path)).encode() + b"\0" + file_sha256(child, root).encode() + b"\0")
        return digest.hexdigest()
    raise FileNotFoundError(f"artifact source {path} does not exist")


@dataclass
class Artifact:
    """A built (or given) artifact: a file or directory, what kind it is, and where it came from."""

    path: Path
    kind: str
    provenance: dict[str, Any] = field(default_factory=dict)

    def file(self, name: str) -> Path:
        """A file inside the artifact's directory."""
        return self.path / name


class Progress:
    """What a build reports: a tqdm bar on a terminal after the first second, log lines otherwise."""

    LOG_EVERY_S = 5.0

    def __init__(self, label: str, total: Optional[float] = None) -> None:
        self.label = label
        self.total = total
        self.done = 0.0
        self.started = time.monotonic()
        self._last_log = self.started
        self._bar = None
        self._stop = threading.Event()
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=label, delay=1.0, leave=False, dynamic_ncols=True)
            except ImportError:
                pass
            else:
                # Builds that report no steps (an export subprocess) still show time passing.
                threading.Thread(target=self._tick, name="outrider-progress", daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._bar.refresh()

    def set_total(self, total: float) -> None:
        """Declare how much work there is (unknown until now)."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, amount: float = 1, note: str = "") -> None:
        """Report `amount` more work done."""
        self.done += amount
        if self._bar is not None:
            self._bar.update(amount)
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            return
        now = time.monotonic()
        if now - self._last_log >= self.LOG_EVERY_S:
            self._last_log = now
            of = f"/{self.total:g}" if self.total else ""
            log.info("%s: %g%s %s(%.0f s)", self.label, self.done, of, f"{note} " if note else "", now - self.started)

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()


class ArtifactCache:
    """Content-addressed build cache (see the module docstring)."""

    def __init__(self, root: Optional[Union[str, os.PathLike]] = None) -> None:
        self.root = Path(root).expanduser() if root is not None else cache_root()

    def key(self, kind: str, sources: Iterable[Union[str, os.PathLike]] = (), versions: Iterable[str] = (),
            device: str = "cpu", options: Optional[dict[str, Any]] = None) -> tuple[str, dict[str, Any]]:
        """(hex digest, the parts it was computed from)."""
        parts = {
            "layout": LAYOUT,
            "kind": kind,
            "sources": {str(Path(s).resolve()): source_hash(s, self.root) for s in sources},
            "versions": {name: package_version(name) for name in sorted(set(versions))},
            "device": device,
            "options": options or {},
        }
        # Paths name the sources for people; only their content shapes the key.
        keyed = {**parts, "sources": sorted(parts["sources"].values())}
        digest = hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()
        return digest, parts

    def entry(self, kind: str, digest: str) -> Path:
        """The directory of one entry."""
        return self.root / kind / digest[:24]

    def get_or_build(
        self,
        kind: str,
        build: Callable[[Path, Progress], Optional[dict[str, Any]]],
        *,
        label: str = "",
        sources: Iterable[Union[str, os.PathLike]] = (),
        versions: Iterable[str] = (),
        device: str = "cpu",
        options: Optional[dict[str, Any]] = None,
    ) -> Artifact:
        """The cached artifact for this key, built once (under a file lock) if it is missing.

        `build(directory, progress)` writes the artifact's files into `directory` and may return
        figures (quality gates, sizes) that go into the provenance file.
        """
        sources = list(sources)
        digest, parts = self.key(kind, sources, versions, device, options)
        target = self.entry(kind, digest)
        found = self._read(target, kind)
        if found is not None:
            return found
        label = label or kind
        with self._lock(target):
            found = self._read(target, kind)  # another process may have built it while we waited
            if found is not None:
                return found
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            progress = Progress(label)
            log.info("building %s (first start; cached in %s)", label, target)
            started = time.monotonic()
            try:
                figures = build(tmp, progress) or {}
                seconds = time.monotonic() - started
                provenance = {
                    "kind": kind, "label": label, "key": digest, **parts,
                    "seconds": round(seconds, 2), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "python": sys.version.split()[0], **figures,
                }
                (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n")
                if target.exists():  # a stale or torn entry without provenance
                    shutil.rmtree(target, ignore_errors=True)
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            finally:
                progress.close()
            log.info("built %s in %.1f s", label, seconds)
        return Artifact(target, kind, provenance)

    def entries(self) -> list[dict[str, Any]]:
        """Every complete entry: its provenance plus `path` and `bytes`."""
        out = []
        if not self.root.is_dir():
            return out
        for prov in sorted(self.root.glob(f"*/*/{PROVENANCE}")):
            try:
                data = json.loads(prov.read_text())
            except (OSError, ValueError):
                continue
            size = sum(p.stat().st_size for p in prov.parent.rglob("*") if p.is_file())
            out.append({**data, "path": str(prov.parent), "bytes": size})
        return out

    def clear(self, kind: Optional[str] = None) -> int:
        """Remove every entry (or every entry of `kind`); returns how many were removed."""
        removed = 0
        for entry in self.entries():
            if kind is None or entry.get("kind") == kind:
                shutil.rmtree(entry["path"], ignore_errors=True)
                removed += 1
        if kind is None:
            shutil.rmtree(self.root / "sha256", ignore_errors=True)
        return removed

    @staticmethod
    def _read(target: Path, kind: str) -> Optional[Artifact]:
        try:
            provenance = json.loads((target / PROVENANCE).read_text())
        except (OSError, ValueError):
            return None
        return Artifact(target, kind, provenance)

    @contextmanager
    def _lock(self, target: Path) -> Iterator[None]:
        lock_path = target.parent / f".{target.name}.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another process that is building %s", target)
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield
