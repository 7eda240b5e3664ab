#!/usr/bin/env python3
"""One weight matrix at a real model's shape against 1, 4, 8, 9, 16 and 32 activation rows, on the
native kernels (the C library), per GGUF block type: what verifying a draft (1 + k rows), several
streams (k rows) and a prefill chunk cost against a decode step (1 row).

  python tools/bench_matmul_rows.py                      Llama-3.2-1B's FFN down (8192 -> 2048) and gate_up
  python tools/bench_matmul_rows.py --types Q4_K,Q6_K --shape 2048x8192 --isa avx2,avx512_vnni

The weights are random blocks of each type (valid fp16 scales), packed by the loader's own packer
(`pack_gguf`); their values do not change the time. Calls cycle over copies of the matrix that
together exceed `--footprint-mb` (default 512), so every call reads its weights from memory, as a
model's layers do, not from a cache that one matrix fits in. Per case: median ms of `--repeat` calls, the
ratio to one row, the weight bytes read per call over the time (GB/s: one row is bound by memory
bandwidth) and the multiply-adds per second (many rows are bound by the integer dot products).
A column of the same table on another kernel set comes from `--isa` (forced per call).

  python tools/bench_matmul_rows.py --against /tmp/old/_native_c.cpython-311-x86_64-linux-gnu.so

`--against LIB` compares another build of the C library (a copy of the installed one taken before
a kernel change) with the installed one in the same run: each case is timed on both, the two
alternating call by call, and a line "against" follows each line with that build's times and the
installed build's speed-up over it (the ratio of the two medians) per row count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from outrider_llm import native_c
from outrider_llm.native_c_weights import pack_gguf

# bytes per block and inputs per block of each GGUF type, and where its fp16 scales lie in a block
BLOCKS = {"Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q5_0": (22, 32, (0,)), "Q5_1": (24, 32, (0, 2)),
          "Q8_0": (34, 32, (0,)), "Q4_K": (144, 256, (0, 2)), "Q5_K": (176, 256, (0, 2)), "Q6_K": (210, 256, (208,))}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    size, per, scale_at = BLOCKS[type_name]
    blocks = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    half = np.full((rows, cols // per), 0.01, np.float16).view(np.uint8).reshape(rows, cols // per, 2)
    for at in scale_at:
        blocks[:, :, at:at + 2] = half
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q4_K,Q6_K,Q5_0,Q8_0,Q4_0")
    parser.add_argument("--shape", default="2048x8192,8192x2048", help="comma-separated INxOUT")
    parser.add_argument("--rows", default="1,4,8,9,16,32")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--footprint-mb", type=float, default=512.0)
    parser.add_argument("--isa", default="", help="comma-separated kernel sets (default: the one in use)")
    parser.add_argument("--against", default="", help="another build of the C library to compare with, call by call")
    args = parser.parse_args()
    native_c.set_threads(args.threads)
    libraries = [native_c.loaded_library()]
    if args.against:
        libraries.append(native_c.open_library(args.against))
        libraries[1].outrider_set_threads(args.threads)
    sets = args.isa.split(",") if args.isa else [native_c.kernels()]
    rows_list = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"CPU features: {native_c.cpu_features()}; {args.threads} threads; median of {args.repeat} calls")
    print(f"{'type':<6}{'shape':<11}{'set':<13}{'MB':>7}" + "".join(f"{f'{r} rows':>16}" for r in rows_list)
          + f"{'1 row GB/s':>12}{f'{rows_list[-1]} rows GMAC/s':>18}")
    for shape in args.shape.split(","):
        cols, out = (int(v) for v in shape.split("x"))
        for type_name in args.types.split(","):
            if cols % BLOCKS[type_name][1]:
                continue
            part = pack_gguf(type_name, random_blocks(type_name, out, cols, rng), cols)
            mb = part.w.nbytes / 1e6
            copies = [part] + [pack_gguf(type_name, random_blocks(type_name, out, cols, rng), cols)
                               for _ in range(int(args.footprint_mb / mb))]
            turn = iter(range(1 << 62))
            xs = {r: rng.standard_normal((r, cols), dtype=np.float32) for r in rows_list}
            ys = {r: np.empty((r, part.out), np.float32) for r in rows_list}
            for kernel_set in sets:
                for lib in libraries:
                    if not lib.outrider_select(kernel_set.encode()):
                        raise SystemExit(f"kernel set {kernel_set} does not run here")
                ms = {}
                for r in rows_list:
                    calls = [lambda r=r, lib=lib: copies[next(turn) % len(copies)].matmul(xs[r], ys[r], lib)
                             for lib in libraries]
                    ms[r] = alternating_medians(calls, args.repeat)
                cells = "".join(f"{ms[r][0]:>8.2f} {ms[r][0] / ms[rows_list[0]][0]:>5.2f}x" for r in rows_list)
                last = rows_list[-1]
                print(f"{type_name:<6}{shape:<11}{kernel_set:<13}{mb:>7.1f}{cells}"
                      f"{mb / ms[rows_list[0]][0]:>12.1f}{last * cols * out / ms[last][0] / 1e6:>18.1f}", flush=True)
                if len(libraries) > 1:
                    cells = "".join(f"{ms[r][1]:>8.2f} {ms[r][1] / ms[r][0]:>5.2f}x" for r in rows_list)
                    print(f"{'':<6}{'':<11}{'against':<13}{'':>7}{cells}   (the other build's ms; its time / this build's)",
                          flush=True)


def alternating_medians(calls: list, repeat: int) -> list[float]:
    """Median ms of each call, the calls taking turns (so a slow spell of a shared machine falls
    on all of them alike)."""
    for call in calls:
        call()
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(repeat):
        for call, kept in zip(calls, samples):
            start = time.perf_counter()
            call()
            kept.append(time.perf_counter() - start)
    return [statistics.median(kept) * 1e3 for kept in samples]


if __name__ == "__main__":
    main()
