"""Where a manifest's ONNX graph comes from: a file it names, or an export cached on disk.

The export runs `python -m outrider_torch.onnx_export` in a subprocess, so torch never enters
the server process. The result is cached under $OUTRIDER_CACHE_DIR (default ~/.cache/outrider),
keyed by a hash of the source weights and config, the torch and transformers versions, the
opset, the task and the export format, so a second start converts nothing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from outrider.errors import ManifestError, OutriderError
from outrider.manifest import Manifest
from outrider_torch.onnx_export import DEFAULT_OPSET, EXPORT_FORMAT  # stdlib-only module: no torch

log = logging.getLogger("outrider.onnx")

CACHE_ENV = "OUTRIDER_CACHE_DIR"
# What the exported graph depends on. Tokenizer files do not change the graph.
_SOURCE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_SOURCE_NAMES = ("config.json",)


def cache_dir() -> Path:
    """$OUTRIDER_CACHE_DIR, or ~/.cache/outrider."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "outrider").expanduser()


def onnx_model(manifest: Manifest) -> Path:
    """The ONNX file for this manifest: `options.onnx` if given, else the cached export."""
    where = manifest.source_file or manifest.name
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
    key = export_key(model_dir, task, opset)
    target = cache_dir() / "onnx" / f"{task}-{key[:20]}" / "model.onnx"
    if target.is_file():
        return target
    with _exclusive(target.with_suffix(".lock")):
        if not target.is_file():  # another process may have exported while we waited
            _export(manifest.name, model_dir, task, opset, target, manifest.options.get("export_timeout_s", 900))
            _write_provenance(target, model_dir, task, opset, key)
    return target


def export_key(model_dir: Path, task: str, opset: int) -> str:
    """sha256 over the source files and everything else that shapes the exported graph."""
    digest = hashlib.sha256()
    for part in (f"format={EXPORT_FORMAT}", f"task={task}", f"opset={opset}",
                 f"torch={_version('torch')}", f"transformers={_version('transformers')}"):
        digest.update(part.encode() + b"\0")
    sources = _source_files(model_dir)
    if not sources:
        raise ManifestError(f"model directory {model_dir} has no config.json or weights to export from")
    for path in sources:
        digest.update(path.name.encode() + b"\0" + file_sha256(path).encode() + b"\0")
    return digest.hexdigest()


def _source_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise ManifestError(f"model directory {model_dir} does not exist")
    return sorted(p for p in model_dir.iterdir()
                  if p.is_file() and (p.name in _SOURCE_NAMES or p.suffix in _SOURCE_SUFFIXES))


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)  # reads metadata; imports nothing
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered by path, size, inode and mtime so restarts skip rehashing."""
    stat = path.stat()
    stamp = f"{path.resolve()}|{stat.st_size}|{stat.st_ino}|{stat.st_mtime_ns}"
    memo = cache_dir() / "sha256" / hashlib.sha256(stamp.encode()).hexdigest()
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


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """One exporter per cache entry across processes (two instances starting together)."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is exporting %s", lock_path.parent.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _export(model: str, model_dir: Path, task: str, opset: int, target: Path, timeout_s: float) -> None:
    command = [sys.executable, "-m", "outrider_torch.onnx_export", "--model-dir", str(model_dir),
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


def _write_provenance(target: Path, model_dir: Path, task: str, opset: int, key: str) -> None:
    # For a person looking at the cache: what produced this file.
    _atomic_write(target.parent / "source.json", json.dumps({
        "model_dir": str(model_dir), "task": task, "opset": opset, "key": key,
        "export_format": EXPORT_FORMAT, "torch": _version("torch"), "transformers": _version("transformers"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }, indent=2) + "\n")
