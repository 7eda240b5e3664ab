"""fp32 vs int8 MiniLM on ONNX Runtime: sentences/s at batch 1 and 32, and min/mean cosine.

    .venv/bin/python tools/bench_quantize_onnx.py                    # the recipe in minilm-int8.yaml for this CPU
    .venv/bin/python tools/bench_quantize_onnx.py --by-cpu           # that manifest's recipe for each class of CPU
    .venv/bin/python tools/bench_quantize_onnx.py --all              # every candidate recipe, one table
    .venv/bin/python tools/bench_quantize_onnx.py --method static --no-keep-sensitive

As an AVX2-only CPU computes them (ONNX Runtime picks its kernels from CPUID, which qemu-user
emulates; /proc/cpuinfo stays the host's, so name the class with --cpu or use --by-cpu):

    qemu-x86_64-static -cpu Haswell .venv/bin/python tools/bench_quantize_onnx.py --by-cpu --no-speed

Under emulation only the cosines mean anything (--no-speed skips the timing); each recipe takes
a few minutes there.

Sessions use 2 intra-op threads (the target machines have 2 cores). Throughput is timed in
alternating rounds (fp32, int8, fp32, ...) and the best round of each is kept, so a neighbour
process stealing a core skews both sides alike; compare the ratio, not the absolute figures.
Cosines are on the held-out sentences of outrider_quantize.onnx_sentences, each alone and in
batches of 32.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins")]

from outrider.manifest import load_manifest  # noqa: E402
from outrider.onnx.artifact import onnx_model  # noqa: E402
from outrider.artifacts import package_version  # noqa: E402
from outrider_quantize.config import QuantizeConfig  # noqa: E402
from outrider_quantize.onnx_int8 import quantize_onnx  # noqa: E402
from outrider_quantize.onnx_quality import embedding_quality, session  # noqa: E402
from outrider_quantize.onnx_recipe import cpu_class, needs_calibration, recipe_for  # noqa: E402
from outrider_quantize.onnx_sentences import HELDOUT_SENTENCES, calibration_feeds  # noqa: E402

CLASSES = ("vnni", "avx2", "arm", "other")
from outrider_text import SentenceEmbeddingTask  # noqa: E402

#: candidate recipes for --all: (label, QuantizeConfig fields)
CANDIDATES = (
    ("dynamic, per-tensor, all linear", {"method": "dynamic", "per_channel": False, "keep_sensitive": False}),
    ("dynamic, per-channel, all linear", {"method": "dynamic", "keep_sensitive": False}),
    ("dynamic, per-channel, FFN out fp32", {"method": "dynamic"}),
    ("static QDQ, per-channel, all linear", {"method": "static", "keep_sensitive": False}),
    ("static QDQ, per-channel, FFN out fp32", {"method": "static"}),
    ("dynamic, per-channel, SmoothQuant 0.7, all linear", {"method": "dynamic", "smooth_alpha": 0.7,
                                                            "keep_sensitive": False}),
    ("dynamic, per-channel, SmoothQuant 0.5, FFN out fp32", {"method": "dynamic", "smooth_alpha": 0.5}),
    # The last layer's FFN output projection costs the least cosine when quantized alone.
    ("dynamic, per-channel, SmoothQuant 0.5, FFN out of layers 0-4 fp32",
     {"method": "dynamic", "smooth_alpha": 0.5, "keep_sensitive": False,
      "exclude": ["/encoder/encoder/layer.[0-4]/output/dense/MatMul"]}),
    # FFN output projections quantized too, but for their N largest input channels (LLM.int8()).
    ("dynamic, per-channel, SmoothQuant 0.5, FFN out split, 4 float channels",
     {"method": "dynamic", "smooth_alpha": 0.5, "outlier_channels": 4}),
    ("dynamic, per-channel, SmoothQuant 0.5, FFN out split, 8 float channels",
     {"method": "dynamic", "smooth_alpha": 0.5, "outlier_channels": 8}),
    ("dynamic, per-channel, SmoothQuant 0.5, FFN out split, 16 float channels",
     {"method": "dynamic", "smooth_alpha": 0.5, "outlier_channels": 16}),
    ("dynamic, per-channel, FFN out split, 8 float channels", {"method": "dynamic", "outlier_channels": 8}),
    # The weight encodings, on the shipped recipe: int8 saturates on x86 without VNNI (u8s8 by
    # vpmaddubsw), int7 (reduce_range) and uint8 (u8u8) do not; run these under qemu -cpu Haswell.
    ("dynamic, per-channel, SmoothQuant 0.5, FFN out split, 16 float channels, int8 weights",
     {"method": "dynamic", "smooth_alpha": 0.5, "outlier_channels": 16, "weights": "int8"}),
    ("dynamic, per-channel, SmoothQuant 0.5, FFN out split, 16 float channels, int7 weights",
     {"method": "dynamic", "smooth_alpha": 0.5, "outlier_channels": 16, "weights": "int7"}),
    ("dynamic, per-channel, SmoothQuant 0.5, FFN out split, 64 float channels, int7 weights",
     {"method": "dynamic", "smooth_alpha": 0.5, "outlier_channels": 64, "weights": "int7"}),
    ("dynamic, per-channel, SmoothQuant 0.5, FFN out split, 16 float channels, uint8 weights",
     {"method": "dynamic", "smooth_alpha": 0.5, "outlier_channels": 16, "weights": "uint8"}),
)


def throughput(paths: dict[str, Path], feeds: Callable[[list[str]], dict], batch: int, rounds: int = 5,
               seconds: float = 1.0) -> dict[str, float]:
    """Best-of-`rounds` sentences/s per model at `batch` rows, models timed in alternation."""
    sentences = list(HELDOUT_SENTENCES[:batch]) if batch > 1 else ["How long should I boil an egg?"]
    feed = feeds(sentences)
    sessions = {name: session(path, threads=2) for name, path in paths.items()}
    runs = {}
    for name, sess in sessions.items():
        names = [i.name for i in sess.get_inputs()]
        runs[name] = (sess, {n: feed[n] for n in names})
        sess.run(None, runs[name][1])  # warm-up: first run allocates and packs weights
    best = {name: 0.0 for name in paths}
    for _ in range(rounds):
        for name, (sess, inputs) in runs.items():
            count, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds:
                sess.run(None, inputs)
                count += 1
            best[name] = max(best[name], count * len(sentences) / elapsed)
    return best


def bench_rows(configs: list[tuple[str, dict[str, Any]]], rounds: int = 5, speed: bool = True) -> list[dict[str, Any]]:
    """One row per recipe: fp32 and int8 sentences/s at batch 1 and 32, their ratios, cosines
    (`speed` False: the cosines only, NaN for the rest)."""
    manifest = load_manifest(ROOT / "manifests" / "minilm.yaml")
    task = SentenceEmbeddingTask(manifest)

    def feeds(sentences: list[str]) -> dict:
        return task.preprocess({"text": np.array(sentences, dtype=object)})

    fp32 = onnx_model(manifest)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, fields in configs:
            config = QuantizeConfig(mode="int8", **fields)
            dst = Path(tmp) / f"{len(rows)}.onnx"
            calibration = calibration_feeds(feeds, config.calibration_sentences) if needs_calibration(config) else None
            done = quantize_onnx(fp32, dst, config, calibration)
            quality = embedding_quality(fp32, dst, HELDOUT_SENTENCES, feeds=feeds, threads=2)
            nan = {"fp32": float("nan"), "int8": float("nan")}
            b1 = throughput({"fp32": fp32, "int8": dst}, feeds, 1, rounds) if speed else nan
            b32 = throughput({"fp32": fp32, "int8": dst}, feeds, 32, rounds) if speed else nan
            rows.append({"recipe": label, "weights": done["weights"], "float_nodes": len(done["float_nodes"]), **quality,
                         "fp32_b1": b1["fp32"], "int8_b1": b1["int8"], "ratio_b1": b1["int8"] / b1["fp32"],
                         "fp32_b32": b32["fp32"], "int8_b32": b32["int8"], "ratio_b32": b32["int8"] / b32["fp32"]})
            print(_format([rows[-1]], header=len(rows) == 1), flush=True)
    return rows


def _format(rows: list[dict[str, Any]], header: bool = True) -> str:
    cols = ("recipe", "weights", "float_nodes", "min_cosine", "mean_cosine", "fp32_b1", "int8_b1", "ratio_b1",
            "fp32_b32", "int8_b32", "ratio_b32")
    lines = [" | ".join(cols)] if header else []
    for row in rows:
        lines.append(" | ".join(f"{row[c]:.4f}" if c.endswith("cosine") else f"{row[c]:.2f}"
                                if isinstance(row[c], float) else str(row[c]) for c in cols))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every candidate recipe")
    parser.add_argument("--by-cpu", action="store_true", help="minilm-int8.yaml's recipe for each class of CPU")
    parser.add_argument("--cpu", choices=CLASSES, help="the class whose recipe to run (default: this CPU's)")
    parser.add_argument("--weights", choices=("int8", "int7", "uint8"), help="weight encoding (int7: reduce_range)")
    parser.add_argument("--no-speed", action="store_true", help="cosines only (under emulation)")
    parser.add_argument("--method", choices=("dynamic", "static"))
    parser.add_argument("--no-keep-sensitive", action="store_true", help="quantize the FFN output projections too")
    parser.add_argument("--per-tensor", action="store_true")
    parser.add_argument("--smooth-alpha", type=float, help="SmoothQuant strength (dynamic only)")
    parser.add_argument("--outlier-channels", type=int, help="split the FFN output projections, N float channels")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import platform

    import onnxruntime

    here = cpu_class()
    print(f"# {platform.machine()}, cpu_class {here} (from /proc/cpuinfo; under qemu-user that is the host's), "
          f"onnxruntime {package_version('onnxruntime')} ({onnxruntime.get_device()})", flush=True)
    shipped = _shipped()
    if args.all:
        configs = list(CANDIDATES)
    elif args.by_cpu:
        # One row per distinct recipe; which classes share it is in the label.
        recipes: dict[str, list[str]] = {}
        resolved: dict[str, dict[str, Any]] = {}
        for cls in CLASSES:
            fields = _fields(recipe_for(QuantizeConfig(mode="int8", **shipped), cls))
            key = repr(sorted(fields.items()))
            recipes.setdefault(key, []).append(cls)
            resolved[key] = fields
        configs = [(f"minilm-int8 for {'/'.join(classes)}: weights {resolved[key]['weights']}, "
                    f"{resolved[key]['outlier_channels']} float channels", resolved[key])
                   for key, classes in recipes.items()]
    else:
        fields: dict[str, Any] = {}
        if args.method is None:
            fields = _fields(recipe_for(QuantizeConfig(mode="int8", **shipped), args.cpu or here))
        else:
            fields["method"] = args.method
        if args.weights is not None:
            fields["weights"] = args.weights
        if args.no_keep_sensitive:
            fields["keep_sensitive"] = False
        if args.smooth_alpha is not None:
            fields["smooth_alpha"] = args.smooth_alpha
        if args.outlier_channels is not None:
            fields["outlier_channels"] = args.outlier_channels
        if args.per_tensor:
            fields["per_channel"] = False
        configs = [(", ".join(f"{k}={v}" for k, v in fields.items()) or "default", fields)]
    bench_rows(configs, args.rounds, speed=not args.no_speed)


def _shipped() -> dict[str, Any]:
    """manifests/minilm-int8.yaml's quantize section, without mode and gate."""
    import yaml

    fields = yaml.safe_load((ROOT / "manifests" / "minilm-int8.yaml").read_text())["quantize"]
    return {k: v for k, v in fields.items() if k not in ("mode", "gate")}


def _fields(config: QuantizeConfig) -> dict[str, Any]:
    """A resolved recipe as QuantizeConfig fields (no gate, no by_cpu)."""
    keep = ("method", "per_channel", "exclude", "keep_sensitive", "outlier_channels", "smooth_alpha", "weights",
            "calibration_sentences")
    return {k: getattr(config, k) for k in keep}


if __name__ == "__main__":
    main()
