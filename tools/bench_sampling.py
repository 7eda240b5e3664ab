#!/usr/bin/env python3
"""What sampling one token costs beside a decode step: `target_distribution` (softmax with
temperature, top-k, top-p) and `draw` (the inverse CDF) on real logits, next to the flat
definitions they replace, in one run.

  python tools/bench_sampling.py                        the packaged SmolLM2-135M (49,152 tokens)
  python tools/bench_sampling.py --gguf MODEL.gguf ...  any GGUF the native runtime serves (Gemma 3: 262,144)

Logits are the model's own rows after a few prompts (a real distribution's shape decides how many
tokens the cuts look at). Per file and knob set: microseconds per call, median of --repeat, for
the runtime's functions and the reference ones (a flat float64 running sum for `draw`; softmax,
then a partition for top-k and a growing sorted top-k for top-p, renormalized after each, for
`target_distribution`), their ratio, the largest difference between the two distributions, and
how many of --draws uniforms pick the same token both ways (they may part only where a uniform
falls within float64 rounding of a boundary).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins")]

from outrider.generation.sampling import draw, target_distribution  # noqa: E402

KNOBS = {"T=1": (1.0, 0, 1.0), "T=0.7, top_p 0.9": (0.7, 0, 0.9), "T=0.8, top_k 40, top_p 0.95": (0.8, 40, 0.95)}
PROMPTS = ["def fibonacci(n):\n    ", "The capital of France is", "Once upon a time, in a small village,"]


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The flat definition: softmax, top-k by a full partition, top-p by a growing sorted top-k."""
    scaled = logits / np.float32(temperature)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    vocab = probs.shape[-1]
    if top_k and top_k < vocab:
        kth = np.partition(probs, vocab - top_k)[vocab - top_k]
        probs = np.where(probs >= kth, probs, np.float32(0))
    if top_p < 1.0:
        total, k = probs.sum(), min(64, vocab)
        while True:
            values = np.sort(np.partition(probs, vocab - k)[vocab - k:])[::-1]
            cumulative = np.cumsum(values)
            if k == vocab or cumulative[-1] >= top_p * total:
                break
            k = min(vocab, k * 4)
        threshold = values[(cumulative - values) < top_p * total].min()
        probs = np.where(probs >= threshold, probs, np.float32(0))
    return probs / probs.sum()


def reference_draw(probs: np.ndarray, u: float) -> int:
    """The flat inverse CDF at uniform `u`."""
    cumulative = np.cumsum(probs, dtype=np.float64)
    index = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    return min(index, int(np.flatnonzero(probs)[-1]))


class _Fixed:
    """A generator whose next uniform is set: both draws see the same one."""

    def __init__(self) -> None:
        self.u = 0.0

    def random(self) -> float:
        return self.u


def _us(call: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def model_rows(path: Path) -> tuple[str, np.ndarray]:
    """(name, the last-position logits of each prompt) from the native runtime."""
    from outrider.generation.contract import Chunk
    from outrider_llm.gguf_tiles import load_gguf_tiles
    from outrider_llm.native_model import load_tiles

    model, tokenizer = load_tiles(load_gguf_tiles(path))
    rows = []
    for prompt in PROMPTS:
        ids = np.asarray(tokenizer.encode(prompt), dtype=np.int64)
        out = model.forward(model.new_cache(1, len(ids) + 1), [Chunk(0, ids, np.arange(len(ids)))])
        rows.append(np.asarray(out.logits, dtype=np.float32)[-1])
    return path.name, np.stack(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, action="append", default=[], help="a GGUF (repeatable)")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--draws", type=int, default=20000)
    args = parser.parse_args(argv)
    files = list(args.gguf)
    if not files:
        from outrider_llm.artifact import smollm2_gguf_path  # torch-free

        files = [Path(smollm2_gguf_path())]
    rng = np.random.default_rng(0)
    print("| model (vocabulary) | knobs | target_distribution us: runtime / reference | ratio | max difference "
          "| draw us: runtime / reference | ratio | same token |\n|---|---|---|---|---|---|---|---|")
    for path in files:
        name, rows = model_rows(path)
        for label, knobs in KNOBS.items():
            t_new = statistics.median(_us(lambda r=r: target_distribution(r, *knobs), args.repeat) for r in rows)
            t_ref = statistics.median(_us(lambda r=r: reference_distribution(r, *knobs), args.repeat) for r in rows)
            probs = [target_distribution(r, *knobs) for r in rows]
            gap = max(float(np.abs(p - reference_distribution(r, *knobs)).max()) for p, r in zip(probs, rows))
            fixed = _Fixed()
            d_new = statistics.median(_us(lambda p=p: draw(p, fixed), args.repeat) for p in probs)
            d_ref = statistics.median(_us(lambda p=p: reference_draw(p, 0.5), args.repeat) for p in probs)
            same = 0
            for i in range(args.draws):
                p = probs[i % len(probs)]
                fixed.u = float(rng.random())
                same += draw(p, fixed) == reference_draw(p, fixed.u)
            print(f"| {name} ({rows.shape[1]}) | {label} | {t_new:.0f} / {t_ref:.0f} | {t_ref / t_new:.1f}x | "
                  f"{gap:.1e} | {d_new:.0f} / {d_ref:.0f} | {d_ref / d_new:.1f}x | {same} of {args.draws} |")


if __name__ == "__main__":
    main()
