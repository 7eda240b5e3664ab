"""GGUF's quantized block types as the native kernels' affine groups: w = q * d + m.

Every type the kernels serve is, per group of inputs, an unsigned integer q times a scale d plus
a minimum m; the kernels hold d and m in fp16 (csrc/kernels.h). So each block type maps onto 4-,
5- or 8-bit groups without going through fp32, and each maps exactly (the dequantized weights equal
gguf-py's own dequantization bit for bit):

| type | block | here | exact |
|---|---|---|---|
| Q4_0 | d, 4-bit q; w = (q - 8) d | 4-bit, group 32, m = -8 d | yes |
| Q4_1 | d, m, 4-bit q; w = q d + m | 4-bit, group 32 | yes |
| Q5_0 | d, 5-bit q; w = (q - 16) d | 5-bit, group 32, m = -16 d | yes |
| Q5_1 | d, m, 5-bit q | 5-bit, group 32 | yes |
| Q8_0 | d, int8 q; w = q d | 8-bit (q + 128), group 32, m = -128 d | yes |
| Q4_K | super-block of 256: fp16 d, dmin; 8 x (6-bit scale, 6-bit min); 4-bit q | 4-bit, group 32, d = d sc, m = -dmin mn | yes |
| Q5_K | the same with 5-bit q | 5-bit, group 32 | yes |
| Q6_K | fp16 d; 16 x int8 scale; 6-bit q; w = d sc (q - 32) | 8-bit (0..63), group 16 | yes |

A K type's sub-block scale d * sc has up to 17 (Q6_K: 18) significant bits: exact in fp32, not in
fp16. So a K tensor's d and m tables are fp16 where every value fits and fp32 otherwise (the
kernels take either: kF32Scales in csrc/kernels.h), at 2 more bits per group of 32 inputs than
fp16. Other quantized types (Q2_K, Q3_K, the IQ types, ...) have no affine form here: the caller
dequantizes and requantizes them (see `to_affine`).

Numpy only (gguf-py's reader hands over numpy blocks); no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

QK_K = 256  # elements per K-type super-block


@dataclass
class AffineGroups:
    """One weight [out, in] as groups of `group` inputs: w = q * d + m (d, m exact)."""

    bits: int  # 4, 5 or 8: the kernel layout the values fit
    q: np.ndarray  # uint8 [out, in], values 0 .. 2^bits - 1
    d: np.ndarray  # float16 [out, in / group], or float32 where fp16 would round a K type's scales
    m: np.ndarray  # the same shape and dtype
    group: int
    exact: bool  # the dequantized weights equal the file's (gguf-py's dequantization) bit for bit
    source: str  # the GGUF type name

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    def dequantize(self) -> np.ndarray:
        """fp32 [out, in]: q * d + m, as the kernels' definition computes it (one rounding, in fp32)."""
        out, inp = self.q.shape
        q = self.q.astype(np.float32).reshape(out, inp // self.group, self.group)
        d = self.d.astype(np.float32)[..., None]
        m = self.m.astype(np.float32)[..., None]
        return (q * d + m).reshape(out, inp)

    def rows(self, index: np.ndarray) -> "AffineGroups":
        """The groups of rows `index` only (embedding lookups)."""
        return AffineGroups(self.bits, self.q[index], self.d[index], self.m[index], self.group, self.exact,
                            self.source)


def supported(type_name: str) -> bool:
    """Whether `type_name` (a GGMLQuantizationType name) has an affine form here."""
    return type_name in _CONVERTERS


def to_affine(blocks: np.ndarray, type_name: str, shape: tuple[int, int]) -> Optional[AffineGroups]:
    """The affine groups of a GGUF tensor's raw blocks (uint8 [rows, row_bytes], as gguf-py's
    reader gives `tensor.data`) of type `type_name` and logical `shape` (out, in); None for a type
    without an affine form."""
    convert = _CONVERTERS.get(type_name)
    if convert is None:
        return None
    out, inp = shape
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(out, -1)
    return convert(raw, out, inp)


def _half(raw: np.ndarray, start: int) -> np.ndarray:
    """fp16 at byte `start` of every block: raw [..., block_bytes] -> float16 [...]."""
    return np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-element nibble order (16 bytes: element j low, j + 16 high) -> uint8 [..., 32]."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _scales(values: np.ndarray) -> np.ndarray:
    """K-type group scales (exact fp32 products): as fp16 where every one fits, else kept fp32
    (the kernels read either; fp16 tables are half the bytes)."""
    values = values.astype(np.float32)
    half = values.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), values) else values


def _q4_0(raw: np.ndarray, out: int, inp: int) -> AffineGroups:
    b = raw.reshape(out, inp // 32, 18)
    d = _half(b, 0)
    q = _nibbles(b[..., 2:]).reshape(out, inp)
    return AffineGroups(4, q, d, (d.astype(np.float32) * -8).astype(np.float16), 32, True, "Q4_0")


def _q4_1(raw: np.ndarray, out: int, inp: int) -> AffineGroups:
    b = raw.reshape(out, inp // 32, 20)
    return AffineGroups(4, _nibbles(b[..., 4:]).reshape(out, inp), _half(b, 0), _half(b, 2), 32, True, "Q4_1")


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (4 bytes, little-endian: bit j is element j's) -> uint8 [..., 32] of 0/16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits << 4


def _q5_0(raw: np.ndarray, out: int, inp: int) -> AffineGroups:
    b = raw.reshape(out, inp // 32, 22)
    d = _half(b, 0)
    q = (_nibbles(b[..., 6:]) | _fifth_bits(b[..., 2:6])).reshape(out, inp)
    return AffineGroups(5, q, d, (d.astype(np.float32) * -16).astype(np.float16), 32, True, "Q5_0")


def _q5_1(raw: np.ndarray, out: int, inp: int) -> AffineGroups:
    b = raw.reshape(out, inp // 32, 24)
    q = (_nibbles(b[..., 8:]) | _fifth_bits(b[..., 4:8])).reshape(out, inp)
    return AffineGroups(5, q, _half(b, 0), _half(b, 2), 32, True, "Q5_1")


def _q8_0(raw: np.ndarray, out: int, inp: int) -> AffineGroups:
    b = raw.reshape(out, inp // 32, 34)
    d = _half(b, 0)
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(out, inp)
    return AffineGroups(8, q, d, (d.astype(np.float32) * -128).astype(np.float16), 32, True, "Q8_0")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit (scale, min) pairs -> (sc, mn) uint8 [..., 8] each."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_groups(b: np.ndarray, out: int, inp: int) -> tuple[np.ndarray, np.ndarray]:
    """(d, m) of Q4_K/Q5_K super-blocks b [out, in / 256, bytes]: per group of 32,
    d = d_super * sc and m = -dmin * mn (exact in fp32: 11 x 6 significant bits)."""
    d_super = _half(b, 0).astype(np.float32)[..., None]
    d_min = _half(b, 2).astype(np.float32)[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    d = (d_super * sc.astype(np.float32)).reshape(out, inp // 32)
    m = (-(d_min * mn.astype(np.float32))).reshape(out, inp // 32)
    if _scales(np.concatenate([d, m])).dtype == np.float16:
        return d.astype(np.float16), m.astype(np.float16)
    return d, m


def _q4_k(raw: np.ndarray, out: int, inp: int) -> AffineGroups:
    b = raw.reshape(out, inp // QK_K, 144)
    d, m = _k_groups(b, out, inp)
    # 128 bytes of q: four runs of 32 bytes, each holding sub-block 2i in its low nibbles and
    # sub-block 2i + 1 in its high nibbles.
    qs = b[..., 16:].reshape(out, inp // QK_K, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(out, inp)
    return AffineGroups(4, q, d, m, 32, True, "Q4_K")


def _q5_k(raw: np.ndarray, out: int, inp: int) -> AffineGroups:
    b = raw.reshape(out, inp // QK_K, 176)
    d, m = _k_groups(b, out, inp)
    qh = b[..., 16:48]  # bit i of byte j: the fifth bit of element j of sub-block i
    qs = b[..., 48:].reshape(out, inp // QK_K, 4, 1, 32)
    low = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(out, inp // QK_K, 8, 32)
    high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4  # [.., 8, 32]
    return AffineGroups(5, (low | high).reshape(out, inp), d, m, 32, True, "Q5_K")


def _q6_k(raw: np.ndarray, out: int, inp: int) -> AffineGroups:
    b = raw.reshape(out, inp // QK_K, 210)
    ql = b[..., :128].reshape(out, inp // QK_K, 2, 1, 64)  # two halves of 128 elements
    qh = b[..., 128:192].reshape(out, inp // QK_K, 2, 1, 32)
    scales = b[..., 192:208].view(np.int8).astype(np.float32)  # [.., 16]: one per 16 elements
    d_super = _half(b, 208).astype(np.float32)[..., None]
    low = np.concatenate([ql & 15, ql >> 4], axis=-2).reshape(out, inp // QK_K, 2, 4, 32)
    high = (qh >> (np.arange(4, dtype=np.uint8) * 2)[:, None]) & 3  # [.., 2, 4, 32]
    q = (low | (high << 4)).reshape(out, inp)  # 0..63; w = d sc (q - 32)
    scale = (d_super * scales).reshape(out, inp // 16)  # exact in fp32: 11 x 7 significant bits
    d = _scales(scale)
    m = (scale * -32).astype(d.dtype)  # a power of two: exact wherever d is
    return AffineGroups(8, q, d, m, 16, True, "Q6_K")


_CONVERTERS = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}
