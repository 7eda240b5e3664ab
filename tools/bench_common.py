"""What several benchmarks share: an `outrider serve` child process, waiting for it to be ready, and
the MiniLM ONNX Runtime backend loaded in this process (no server)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_server(manifests: list[str], address: str, env_extra: dict | None = None,
                 args: list[str] | None = None) -> subprocess.Popen:
    """`outrider serve` (its output discarded: an unread pipe would block a server that logs much)."""
    from outrider.harness import ServerProcess

    return ServerProcess.start(manifests, address, args=args, env=env_extra, cwd=ROOT).proc


def wait_ready(address: str, timeout: float = 120.0) -> float:
    from outrider import Client, OutriderError

    with Client(address, timeout=0.5) as client:
        try:
            client.wait_ready(timeout, interval=0.005)
        except OutriderError as exc:
            raise RuntimeError(exc.message) from None
    return time.monotonic()


def offline_backend(manifest_path: str, sets: list[str]):
    """The minilm ORT backend in this process: no server, no queue, no sockets."""
    from outrider.manifest import load_manifest
    from outrider.plugins import create_registry

    registry = create_registry(modules=["outrider_text", "outrider_onnxruntime"], load_entry_points=False)
    manifest = load_manifest(manifest_path, sets)
    choice = registry.choose_backend(manifest)
    backend = choice.backend(manifest, choice.device, registry.make_task(manifest))
    backend.load()
    backend.warmup()
    return manifest, backend
