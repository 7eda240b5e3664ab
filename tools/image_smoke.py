#!/usr/bin/env python3
"""Run a built Outrider image's entrypoint and check it serves what its Dockerfile promises.

  python tools/image_smoke.py --image localhost/outrider:cpu --kind cpu
  python tools/image_smoke.py --image localhost/outrider:full --kind full

(tools/image_check.sh builds the images and calls this.) The image runs as its users run it:
its ENTRYPOINT and CMD, its environment, as its USER, its root file system read-only, with the
cache and socket directories on volumes (fresh host directories). Where `podman run` works, with
that; where it cannot start a container (these machines refuse crun's setrlimit), the image is
mounted (`podman image mount`) and the same command runs chrooted into it, which is said in the
output. The HTTP address in CMD is moved to a loopback port; nothing else changes.

Checks, each against the source tree serving the same manifest on this machine:
- cpu: ready (HTTP /v2/health/ready and `outrider health` over the socket), a MiniLM embedding over
  ZeroMQ and over HTTP /v1/embeddings, equal to each other and to the source tree's.
- full: ready, the MiniLM embedding as above, and a SmolLM2 greedy generate with speculation
  whose text and token ids equal the source tree's.
Figures printed: image size and the size of each layer, cold start inside the image (process start
to ready) with an empty cache volume and again with the cache the first start filled, idle RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins")]

import numpy as np  # noqa: E402

from outrider import Client, entry_index  # noqa: E402
from outrider.harness import ServerProcess, free_port  # noqa: E402

SENTENCE = "Outrider serves models beside your application."
PROMPT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]


def podman(*args: str, check: bool = True) -> str:
    return subprocess.run(["podman", *args], check=check, capture_output=True, text=True).stdout.strip()


class Container:
    """The image's entrypoint running with fresh cache and socket volumes; `podman run` or chroot."""

    def __init__(self, image: str, cache: Path, run: Path, port: int,
                 volumes: Optional[dict[str, str]] = None, command: Optional[list[str]] = None,
                 writable: Optional[dict[str, str]] = None) -> None:
        """`volumes`: host directory -> an existing directory of the image (mounted read-only);
        `writable`: the same, mounted read-write (owned by the image's user); `command`: arguments
        instead of the image's CMD."""
        self.image, self.cache, self.run, self.port = image, cache, run, port
        self.volumes = dict(volumes or {})
        self.writable = dict(writable or {})
        config = json.loads(podman("image", "inspect", image))[0]["Config"]
        self.env = dict(item.split("=", 1) for item in config.get("Env") or [])
        self.user = config.get("User") or "0:0"
        self.workdir = config.get("WorkingDir") or "/"
        command = list(config.get("Entrypoint") or []) + list(command or config.get("Cmd") or [])
        if "--http" in command:  # loopback only: a smoke test listens on nothing else
            command[command.index("--http") + 1] = f"127.0.0.1:{port}"
        self.command = command
        self.root: Optional[str] = None
        self.mounts: list[str] = []  # bind mounts into the mounted image, undone by stop()
        self.process: Optional[subprocess.Popen] = None
        self.how = ""

    def start(self, log: Path) -> float:
        """Start it; returns the time.monotonic() of the start."""
        uid, gid = self.user.split(":")
        for path in (self.cache, self.run, *map(Path, self.writable)):
            os.chown(path, int(uid), int(gid))
        if podman_run_works(self.image):
            self.how = "podman run (read-only root, volumes for the cache and socket)"
            extra = [arg for host, inside in self.volumes.items() for arg in ("-v", f"{host}:{inside}:ro")]
            extra += [arg for host, inside in self.writable.items() for arg in ("-v", f"{host}:{inside}")]
            argv = ["podman", "run", "--rm", "--read-only", "--network", "host", *extra,
                    "-v", f"{self.cache}:/var/cache/outrider", "-v", f"{self.run}:/run/outrider", self.image,
                    *self.command[1:]]
        else:
            self.how = ("chroot into `podman image mount` (podman run cannot start a container here: crun's "
                        "setrlimit is refused); the image's env, user and workdir, root read-only")
            self.root = podman("image", "mount", self.image)
            self._bind("/proc", "proc")
            self._bind("/dev", "dev")
            self._bind(str(self.cache), "var/cache/outrider")
            self._bind(str(self.run), "run/outrider")
            for host, inside in self.volumes.items():
                self._bind(host, inside.lstrip("/"), read_only=True)
            for host, inside in self.writable.items():
                self._bind(host, inside.lstrip("/"))
            scratch = Path(tempfile.mkdtemp(prefix="image-tmp-"))
            scratch.chmod(0o1777)
            self._bind(str(scratch), "tmp")
            env = [f"{k}={v}" for k, v in self.env.items()] + ["HOME=/home/outrider"]
            shell = f"cd {self.workdir} && exec " + " ".join(self.command)
            argv = ["chroot", f"--userspec={self.user}", self.root, "/usr/bin/env", "-i", *env, "sh", "-c", shell]
        started = time.monotonic()
        self.process = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
        return started

    def _bind(self, source: str, target: str, read_only: bool = False) -> None:
        subprocess.run(["mount", "--bind", *(["-o", "ro"] if read_only else []), source, f"{self.root}/{target}"],
                       check=True)
        self.mounts.append(f"{self.root}/{target}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for mount in reversed(self.mounts):
            subprocess.run(["umount", "-l", mount], check=False)
        self.mounts = []
        if self.root is not None:
            podman("image", "umount", self.image, check=False)
            self.root = None

    def maps_torch(self) -> Optional[bool]:
        """Whether the server process has libtorch mapped (None under podman run: not our child)."""
        if self.root is None:
            return None
        return "libtorch" in Path(f"/proc/{self.process.pid}/maps").read_text()

    def rss_mb(self) -> float:
        if self.root is None:  # podman run: the process here is podman's client, not the server
            return float("nan")
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024


_RUN_WORKS: dict[str, bool] = {}


def podman_run_works(image: str) -> bool:
    if image not in _RUN_WORKS:
        probe = subprocess.run(["podman", "run", "--rm", image, "--version"], capture_output=True, text=True)
        _RUN_WORKS[image] = probe.returncode == 0
    return _RUN_WORKS[image]


def wait_ready(port: int, process: subprocess.Popen, timeout: float) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if process.poll() is not None:
            raise SystemExit(f"the image's server exited with status {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"not ready within {timeout:.0f} s")


def embeddings(address: str, port: int) -> tuple[np.ndarray, np.ndarray]:
    import httpx

    with Client(address, timeout=60) as client:
        over_zmq = client.infer("minilm", {"text": np.array([SENTENCE], dtype=object)})["embedding"][0]
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"model": "minilm", "input": SENTENCE},
                        timeout=60)
    answer.raise_for_status()
    return over_zmq, np.array(answer.json()["data"][0]["embedding"], dtype=np.float32)


def generate(address: str) -> tuple[str, list[int], dict]:
    with Client(address, timeout=600) as client:
        result = client.generate("smollm2", messages=PROMPT, max_tokens=48, temperature=0)
    return result.text, result.token_ids, result.stats


def source_tree(kind: str, work: Path) -> dict:
    """The same requests against the source tree's server (this checkout's manifests)."""
    manifests = [ROOT / "manifests/minilm.yaml"] + ([ROOT / "manifests/smollm2.yaml"] if kind == "full" else [])
    port = free_port()
    address = f"ipc://{work}/source.sock"
    plugins = ["outrider_text", "outrider_onnxruntime", "outrider_batching", "outrider_http"]
    if kind == "full":
        plugins += ["outrider_llm", "outrider_speculative", "outrider_quantize"]
    started = time.monotonic()
    server = ServerProcess.start(manifests, address, plugins=plugins, args=["--http", f"127.0.0.1:{port}"],
                                 log_path=work / "source.log", cwd=ROOT)
    try:
        server.wait_ready(timeout=900)
        out = {"embedding": embeddings(address, port)[0], "ready": time.monotonic() - started}
        print(f"source tree ({', '.join(m.name for m in manifests)}, this machine's artifact cache): ready "
              f"{out['ready']:.2f} s")
        if kind == "full":
            out["generate"] = generate(address)
        return out
    finally:
        server.stop()


def serve_in_image(args: argparse.Namespace, cache: Path, run: Path, volumes: dict[str, str], manifest: str,
                   log: Path) -> tuple[float, list[int], Container]:
    """The image serving `manifest` (its path inside the container) with `volumes` mounted: seconds
    from start to ready, the greedy token ids of PROMPT from model "user", and the running container,
    which the caller stops once it has read what it needs."""
    port = free_port()
    container = Container(args.image, cache, run, port, volumes,
                          ["serve", manifest, "--http", f"127.0.0.1:{port}", "--http-insecure"])
    try:
        started = container.start(log)
        wait_ready(port, container.process, args.timeout)
        ready = time.monotonic() - started
        with Client(f"ipc://{run}/outrider.sock", timeout=300) as client:
            got = client.generate("user", messages=PROMPT, max_tokens=32, temperature=0)
    except BaseException:
        container.stop()
        raise
    return ready, got.token_ids, container


def gguf_check(args: argparse.Namespace, work: Path) -> None:
    """A user's GGUF from a read-only volume (/media) with a plain manifest (/mnt), on the image's
    torch-free native runtime: ready, the same greedy tokens as the source tree, torch not loaded."""
    manifests = work / "gguf-manifest"
    manifests.mkdir()
    (manifests / "user.yaml").write_text(f"name: user\nbackend: llm\nmodel: {{path: /media/{args.gguf.name}}}\n")
    (work / "user.yaml").write_text(f"name: user\nbackend: llm\nmodel: {{path: {args.gguf.resolve()}}}\n")
    port, address = free_port(), f"ipc://{work}/gguf-source.sock"
    source = ServerProcess.start([work / "user.yaml"], address, plugins=["outrider_llm", "outrider_http"],
                                 log_path=work / "gguf-source.log", cwd=ROOT)
    try:
        source.wait_ready(timeout=900)
        with Client(address, timeout=300) as client:
            expected = client.generate("user", messages=PROMPT, max_tokens=32, temperature=0)
    finally:
        source.stop()
    cache, run = work / "gguf-cache", Path(tempfile.mkdtemp(prefix="image-run-"))
    cache.mkdir()
    for label in ("empty cache volume", "cache from the first start"):
        log = work / "gguf-image.log"
        ready, got, container = serve_in_image(args, cache, run, {str(args.gguf.resolve().parent): "/media",
                                                                   str(manifests): "/mnt"}, "/mnt/user.yaml", log)
        try:
            assert got == expected.token_ids, "the GGUF's greedy output in the image differs from the source tree's"
            native = "torch-free native runtime" in log.read_text()
            torch = container.maps_torch()
            print(f"GGUF {args.gguf.name} from a volume, {label}: ready {ready:.2f} s; greedy output equal to the "
                  f"source tree's; {'torch-free native runtime' if native else 'torch runtime'}; libtorch "
                  f"{'mapped' if torch else 'not mapped' if torch is False else 'unknown (podman run)'}; idle RSS "
                  f"{container.rss_mb():.0f} MB")
            assert native, "the image served the GGUF on the torch runtime: " + log.read_text()[-400:]
        finally:
            container.stop()
    baked_check(args, work, manifests, run, expected.token_ids)
    shutil.rmtree(run, ignore_errors=True)


def baked_check(args: argparse.Namespace, work: Path, manifests: Path, run: Path, expected: list[int]) -> None:
    """`outrider bake` of the GGUF's manifest, run by the image into a volume, then that directory
    served by the image with an empty cache volume and without the GGUF: ready, the same greedy
    tokens, nothing written into the cache."""
    gguf_volume = {str(args.gguf.resolve().parent): "/media"}
    started = time.monotonic()
    baker = Container(args.image, work / "bake-cache", run, 0, gguf_volume, ["bake", "/mnt/user.yaml", "/mnt/baked"],
                      writable={str(manifests): "/mnt"})
    (work / "bake-cache").mkdir()
    try:
        baker.start(work / "bake.log")
        status = baker.process.wait(args.timeout)
    finally:
        baker.stop()
    assert status == 0, "outrider bake in the image failed: " + (work / "bake.log").read_text()[-600:]
    size = sum(p.stat().st_size for p in (manifests / "baked").rglob("*") if p.is_file())
    print(f"GGUF {args.gguf.name} baked by the image (`outrider bake`): {time.monotonic() - started:.1f} s, "
          f"{size / 1e6:.0f} MB directory (the file: {args.gguf.stat().st_size / 1e6:.0f} MB)")
    cache = work / "baked-cache"
    cache.mkdir()
    ready, got, container = serve_in_image(args, cache, run, {str(manifests / "baked"): "/mnt"}, "/mnt/manifest.yaml",
                                           work / "baked-image.log")
    try:
        assert got == expected, "the baked GGUF's greedy output in the image differs from the source tree's"
        written = [p for p in cache.rglob("*") if p.is_file() and p.parent.name != "sha256"
                   and p.name != entry_index.INDEX_FILE]
        assert not written, f"serving the baked directory built {written}"
        torch = container.maps_torch()
        print(f"baked GGUF, empty cache volume, no GGUF mounted: ready {ready:.2f} s; greedy output equal to the "
              f"source tree's; nothing written into the cache; libtorch "
              f"{'mapped' if torch else 'not mapped' if torch is False else 'unknown (podman run)'}; idle RSS "
              f"{container.rss_mb():.0f} MB")
    finally:
        container.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True)
    parser.add_argument("--kind", choices=["cpu", "full"], required=True)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take to get ready")
    parser.add_argument("--gguf", type=Path, help="full image: also serve this GGUF from a mounted volume with a "
                                                  "plain manifest, and compare with the source tree")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix=f"image-{args.kind}-"))
    print(f"image {args.image}: {int(podman('image', 'inspect', args.image, '--format', '{{.Size}}')) / 1e6:.0f} MB")
    for line in podman("image", "history", args.image, "--format", "{{.Size}}\t{{.CreatedBy}}").splitlines():
        size, created = line.split("\t", 1)
        if size not in ("0 B", "0B"):
            print(f"  layer {size:>9}  {created[:100]}")
    reference = source_tree(args.kind, work)
    cache, results = work / "cache", []
    cache.mkdir()
    for label in ("empty cache volume", "cache from the first start"):
        run = Path(tempfile.mkdtemp(prefix="image-run-"))
        port = free_port()
        container = Container(args.image, cache, run, port)
        try:
            started = container.start(work / f"server-{len(results)}.log")
            wait_ready(port, container.process, args.timeout)
            ready = time.monotonic() - started
            address = f"ipc://{run}/outrider.sock"
            health = subprocess.run([sys.executable, "-m", "outrider.cli", "health", "--connect", address],
                                    capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:2])})
            assert health.returncode == 0, f"outrider health over the socket: {health.stdout}{health.stderr}"
            over_zmq, over_http = embeddings(address, port)
            assert np.array_equal(over_zmq, over_http), "the embedding differs between ZeroMQ and HTTP"
            cosine = float(over_zmq @ reference["embedding"] / np.linalg.norm(over_zmq)
                           / np.linalg.norm(reference["embedding"]))
            assert cosine > 0.9999, f"the image's embedding is not the source tree's (cosine {cosine:.6f})"
            line = f"{label}: ready {ready:.2f} s; MiniLM embedding equal over ZeroMQ and HTTP, cosine {cosine:.6f} to the source tree's"
            if args.kind == "full":
                text, ids, stats = generate(address)
                assert (text, ids) == reference["generate"][:2], "SmolLM2's greedy output differs from the source tree's"
                line += (f"; SmolLM2 greedy generate equal to the source tree's ({len(ids)} tokens, "
                         f"{stats['draft_tokens']} drafted, {stats['accepted_tokens']} accepted)")
            time.sleep(2)  # idle
            line += f"; idle RSS {container.rss_mb():.0f} MB"
            results.append(line)
            print(line)
        finally:
            container.stop()
            shutil.rmtree(run, ignore_errors=True)
    if args.gguf:
        gguf_check(args, work)
    print(f"ran as: {container.how}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
