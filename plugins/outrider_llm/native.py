"""Outrider's native CPU kernels (csrc/), built at install into `outrider_llm._native` and loaded
as torch ops `outrider::*`.

- `w4a8_mm` / `w8a8_mm`: int4 (or int8) weights times activations quantized to int8 per row and
  block, as llama.cpp computes Q4_1 x Q8_1; `quantize.kernel: w4a8`.
- `w4a8_layers`: every decoder layer of a step in one call, on those matmuls.
- `attend`: attention over exactly the keys each row may see, in key order, so a draft tree's rows
  get bit for bit a one-token step's logits.
- `int4_mm` (x86 only): int4 weights times bf16 activations on AMX or AVX512-BF16;
  `quantize.kernel: int4native`.

All but int4_mm run on every CPU: one kernel set per instruction set (scalar, AVX2, AVX-VNNI,
AVX-512 VNNI, NEON, NEON dotprod; csrc/kernels.h), the best this CPU runs chosen at load, each
equal to the scalar reference bit for bit, so a model computes the same logits on every path.
`OUTRIDER_NATIVE_ISA=avx2` (say) forces a set this CPU runs; `OUTRIDER_NATIVE=0` turns every
native kernel off, `OUTRIDER_NATIVE_INT4_BF16=0` only int4_mm (the old `OUTRIDER_NATIVE_INT4=0`
still does, with a deprecation warning: w4a8 has int4 weights too). The library is compiled when the
package is installed (setup.py), never at first request; where that build was impossible,
`w4a8_kernel()` / `int4_kernel()` say why and the model uses torch's kernels.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from outrider.hardware import cpu_flags

# The weight layouts are packed once, in numpy (native_c_weights: the torch-free binding's packer);
# the torch binding hands its tensors' memory over and takes the packed arrays back without a copy.
from . import native_c_weights as packing

log = logging.getLogger("outrider.llm")

PACKAGE = Path(__file__).parent
CSRC = PACKAGE / "csrc"
BUILD_REPORT = PACKAGE / "_native_build.txt"  # written by setup.py where the build failed
TILE = 16  # outputs per tile (one fp32 zmm)
INT4_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")

_LOCK = threading.Lock()
_LOADED: list[tuple[bool, str]] = []


def library() -> tuple[bool, str]:
    """(loaded, reason): whether the install-built kernel library is loaded (loading it once)."""
    with _LOCK:
        if not _LOADED:
            _LOADED.append(_load())
            if _LOADED[0][0]:
                log.info("native kernels: %s (CPU features: %s)", _LOADED[0][1], cpu_features())
            else:
                log.info("native kernels unavailable: %s", _LOADED[0][1])
        return _LOADED[0]


def _load() -> tuple[bool, str]:
    if os.environ.get("OUTRIDER_NATIVE", "1") == "0":
        return False, "OUTRIDER_NATIVE=0"
    from .native_c import built_library, serving_report

    if not hasattr(torch.ops.outrider, "w4a8_mm"):
        path, why = built_library("_native", BUILD_REPORT)
        if path is None:
            return False, f"{why} (reinstall with a C++ compiler and torch present: pip install --no-build-isolation)"
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as exc:  # built against another torch, a missing libgomp
            return False, f"{path.name} does not load: {exc}"
    return True, serving_report(kernels(), kernel_sets)


def kernels() -> str:
    """The kernel set every native call uses now ("avx2", "avx512_vnni", "neon_dotprod", ...)."""
    return torch.ops.outrider.native_kernels()


def kernel_sets() -> list[str]:
    """Every kernel set this CPU runs, best first; "scalar" (the reference) is always last."""
    return list(torch.ops.outrider.native_kernel_sets())


def select(name: str) -> None:
    """Use kernel set `name` for every native call of this process (tests and benchmarks)."""
    if not torch.ops.outrider.native_select(name):
        raise ValueError(f"kernel set {name!r} does not run on this CPU (it runs: {', '.join(kernel_sets())})")


def cpu_features() -> str:
    """The CPU features the dispatcher read (cpuid on x86, HWCAP on ARM)."""
    return torch.ops.outrider.native_cpu_features()


def int4_kernel() -> tuple[bool, str]:
    """(usable, reason): whether `outrider::int4_mm` (AMX or AVX512-BF16) runs on this CPU, and why not."""
    loaded, why = library()
    if not loaded:
        return False, why
    switch = _int4_bf16_switched_off()
    if switch:
        return False, switch
    missing = [f for f in INT4_FLAGS if f not in cpu_flags()]
    if missing or not hasattr(torch.ops.outrider, "int4_mm"):
        return False, f"the CPU lacks {', '.join(missing) or 'x86 AVX-512'}"
    return True, "AMX" if torch.ops.outrider.int4_mm_has_amx() else "AVX512-BF16"


def _int4_bf16_switched_off() -> str:
    """The environment setting that turns int4_mm off ("" where none does)."""
    if os.environ.get("OUTRIDER_NATIVE_INT4_BF16", "1") == "0":
        return "OUTRIDER_NATIVE_INT4_BF16=0"
    if os.environ.get("OUTRIDER_NATIVE_INT4", "1") == "0":
        if not _DEPRECATION_LOGGED:
            _DEPRECATION_LOGGED.append(True)
            log.warning("OUTRIDER_NATIVE_INT4=0 is deprecated: say OUTRIDER_NATIVE_INT4_BF16=0 (it turns off "
                        "int4_mm, int4 weights x bf16 activations, only; OUTRIDER_NATIVE=0 turns off every "
                        "native kernel)")
        return "OUTRIDER_NATIVE_INT4=0"
    return ""


_DEPRECATION_LOGGED: list[bool] = []


def w4a8_kernel() -> tuple[bool, str]:
    """(usable, reason): whether `outrider::w4a8_mm` (int4 weights x int8 activations) runs here."""
    return library()


def pack_int4_tiles(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor]:
    """The kernel's layout for int4 weights in outrider's format (w = (q - 8) * scale + zero).

    q: uint8 [out, in] values 0..15 (unpacked); scale, zero: [out, in / group]. Returns
    (w uint8 [out/16, in/4, 32], d fp16 [out/16, groups, 16], m fp16 [out/16, groups, 16]) with
    w = q * d + m, so m = zero - 8 * scale. For weights from GGUF Q4_1 blocks (fp16 d and m) both
    are exact in fp16: the kernel multiplies with the file's own weights.
    """
    out, inp = q.shape
    if out % TILE or inp % 4:
        raise ValueError(f"int4 tiles need out % {TILE} == 0 and in % 4 == 0, got {tuple(q.shape)}")
    tiles = q.to(torch.uint8).view(out // TILE, TILE, inp // 4, 2, 2)  # [t, i, quad, half, p]: k = 4j + 2h + p
    low, high = tiles[:, :, :, 0, :], tiles[:, :, :, 1, :]  # [t, i, quad, p]
    packed = (low | (high << 4)).permute(0, 2, 1, 3).contiguous()  # [t, quad, i, p]: byte 2i + p
    return (packed.view(out // TILE, inp // 4, 32), *_tile_scales(scale, zero))


def _tile_scales(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, m) fp16 [out/16, groups, 16] for w = q * d + m, from w = (q - 8) * scale + zero."""
    d = scale.float()
    return per_tile(d, zero.float() - 8 * d)


def per_tile(*values: torch.Tensor, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    """[out, groups] -> `dtype` (fp16, or fp32 for scales fp16 would round) [out/16, groups, 16], each
    (native_c_weights.per_tile, the one packer, on the tensors' memory)."""
    return tuple(torch.from_numpy(t) for t in packing.per_tile(*(_host(v.float()) for v in values),
                                                                dtype=_NUMPY[dtype]))


def table_dtype(*values: torch.Tensor) -> torch.dtype:
    """fp16 when every value of the scale/minimum tables is exact in it, else fp32 (kF32Scales)."""
    return _TORCH[packing.table_dtype(*(_host(v.float()) for v in values))]


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


_NUMPY = {torch.float16: np.float16, torch.float32: np.float32}
_TORCH = {np.float16: torch.float16, np.float32: torch.float32}


def dequantize_tiles(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] weight that `pack_int4_tiles` output stands for (the tests' reference)."""
    return _dequantize_nibble_tiles(w, d, m, 2)


def _dequantize_nibble_tiles(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 [out, in] from tiles whose block holds, per output i, `width` bytes: inputs k0..k0+width-1
    in the low nibbles, the next `width` in the high ones (int4_mm: 2, w4a8: 4)."""
    tiles, blocks, _ = w.shape
    groups = d.shape[1]
    b = w.view(tiles, blocks, TILE, width)
    q = torch.stack([b & 15, b >> 4], dim=3)  # [t, block, i, half, p]
    q = q.permute(0, 2, 1, 3, 4).reshape(tiles * TILE, blocks * 2 * width).float()
    group = blocks * 2 * width // groups
    scale = d.float().transpose(1, 2).reshape(tiles * TILE, groups).repeat_interleave(group, dim=1)
    minimum = m.float().transpose(1, 2).reshape(tiles * TILE, groups).repeat_interleave(group, dim=1)
    return q * scale + minimum


def int4_mm(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int,
            path: int = -1) -> torch.Tensor:
    """fp32 [rows, out] = bf16 x [rows, in] @ W.T (W as `pack_int4_tiles` gives it); `path` forces
    the AVX512-BF16 (0) or AMX (1) path, -1 lets the kernel choose."""
    return torch.ops.outrider.int4_mm(x, w, d, m, group_size, path)


def pack_w4a8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """The w4a8 kernel's layout for int4 weights in outrider's format (w = (q - 8) * scale + zero).

    q: uint8 [out, in] values 0..15 (unpacked); scale, zero: [out, in / group]. Returns
    (w uint8 [out/16, in/8, 64], d fp16 [out/16, groups, 16], m fp16 [out/16, groups, 16]) with
    w = q * d + m; exact in fp16 for weights from GGUF Q4_1 blocks (see `pack_int4_tiles`).
    """
    return (nibble_tiles(q), *_tile_scales(scale, zero))


def nibble_tiles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] values 0..15 -> the w4a8 layout uint8 [out/16, in/8, 64] (csrc/kernels.h)."""
    return torch.from_numpy(packing.nibble_tiles(_host(q.to(torch.uint8))))


def byte_tiles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] values 0..255 -> the w8a8 layout uint8 [out/16, in/4, 64] (csrc/kernels.h)."""
    return torch.from_numpy(packing.byte_tiles(_host(q.to(torch.uint8))))


def dequantize_w4a8(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] weight that `pack_w4a8` output stands for (the tests' reference)."""
    return _dequantize_nibble_tiles(w, d, m, 4)


def w4a8_mm(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 [rows, out] = x (fp32 or bf16 [rows, in], quantized to int8 per row and group) @ W.T
    (W as `pack_w4a8` gives it)."""
    return torch.ops.outrider.w4a8_mm(x, w, d, m, group_size)


def pack_w8a8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout for block-wise int8 weights w = q * scale (GGUF Q8_0: q int8 [out, in],
    scale [out, in / group]): (w uint8 [out/16, in/4, 64], d, m fp16 [out/16, groups, 16]) with
    w = (q + 128) * d + m, m = -128 d. Exact in fp16 for a Q8_0 file's own fp16 scales."""
    return (byte_tiles((q.to(torch.int16) + 128).to(torch.uint8)), *per_tile(scale.float(), -128 * scale.float()))


def pack_affine(groups: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel layout of `gguf_blocks.AffineGroups` (w = q * d + m, q uint8 [out, in] of
    `groups.bits` bits, d and m fp16 [out, in / group]): `nibble_tiles`, `pack_w5` or `byte_tiles`.
    d and m go over unchanged (fp16, or fp32 where fp16 would round them), so the kernel computes
    with the file's weights."""
    return tuple(torch.from_numpy(t) for t in packing.pack_affine(groups))


def five_bit_tiles() -> bool:
    """Whether 5-bit weights (Q5_0, Q5_1, Q5_K) take the w5a8 layout here, or 8-bit groups (the same
    results bit for bit). w5a8 holds 5 bits a weight instead of 8 but spends instructions putting
    the fifth bit back: one on AVX-512 (a mask move), ~12 per 64 weights on AVX2, ~16 on NEON; a
    decode step reads ~100 MB of weights, so the bytes count for more. End to end on AVX2 (SmolLM2
    Q4_K_M, 166 of its matrices Q5_0; `OUTRIDER_NATIVE_W5=0|1 tools/bench_gguf.py --isa avx2
    --types Q4_K_M`, two A/B pairs) w5a8 decoded 143.0 and 138.6 tok/s against 135.3 and 126.2, in
    39 MB less. So w5a8 on x86; NEON keeps 8-bit groups until it is measured on an ARM board.
    `OUTRIDER_NATIVE_W5=1` / `=0` forces either (native_c.five_bit_layout: the one rule, both bindings)."""
    from .native_c import five_bit_layout

    return five_bit_layout(kernels() if library()[0] else "")


def pack_w5(q: torch.Tensor) -> torch.Tensor:
    """5-bit values q uint8 [out, in] (0..31) -> the w5a8 layout uint8 [out/16, in/8, 80] (csrc/kernels.h):
    per tile and 8 inputs, the w4a8 layout's 64 bytes of low nibbles, then 16 bytes of fifth bits."""
    return torch.from_numpy(packing.pack_w5(_host(q.to(torch.uint8))))


def unpack_w5_rows(w: torch.Tensor, t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """uint8 [n, in] values of rows (tile t, lane i) of a w5a8 layout (the inverse of `pack_w5`)."""
    tiles, octs, _ = w.shape
    b = w[..., :64].reshape(tiles, octs, 16, 4)[t, :, i, :]  # [n, oct, p]
    low = torch.stack([b & 15, b >> 4], dim=2)  # [n, oct, half, p]
    plane = w[..., 64:].reshape(tiles, octs, 2, 8)[t]  # [n, oct, half, byte]
    bits = (plane[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [n, oct, half, byte, bit]: lane 8 byte + bit
    lane = bits.reshape(len(t), octs, 2, 64)  # lanes 4i+p
    index = (4 * i)[:, None, None, None] + torch.arange(4)  # [n, 1, 1, 4]
    high = torch.gather(lane, 3, index.expand(len(t), octs, 2, 4))
    return (low | (high << 4)).reshape(len(t), octs * 8)


def affine_mm(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int,
              group_size: int) -> torch.Tensor:
    """fp32 [rows, out] = x @ W.T for W as `pack_affine` gives it (`bits` 4, 5 or 8)."""
    op = {4: torch.ops.outrider.w4a8_mm, 5: torch.ops.outrider.w5a8_mm, 8: torch.ops.outrider.w8a8_mm}[bits]
    return op(x, w, d, m, group_size)


def w8a8_mm(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 [rows, out] = x (fp32 or bf16, quantized to int8 per row and group) @ W.T (W as
    `pack_w8a8` gives it)."""
    return torch.ops.outrider.w8a8_mm(x, w, d, m, group_size)
