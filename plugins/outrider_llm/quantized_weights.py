"""Quantized weights as the llm backend's torch model holds them: `QuantTensor` (int4 groups, int8
per channel, or a GGUF file's own affine groups), their state-dict entries, and the embedding
tables that look rows up from such weights (`Int8BlockTable`, `AffineTable`).

The quantized tensor format is `outrider.generation.weights` (shared with outrider_quantize).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from outrider.generation.weights import dequantize_int4, dequantize_int8, pack_int4, unpack_int4


# ---- lookup tables -------------------------------------------------------------------------------


class Int8BlockTable:
    """An fp32 [rows, cols] lookup table held as int8 values times one fp32 scale per `block` columns.

    Only built by `exact`, when that form holds every value exactly: GGUF's Q8_0 embeddings
    (w = q * d, d fp16, |q| <= 127) dequantized to fp32 are such a table, so lookups return the
    same fp32 rows bit for bit at a quarter of the memory (SmolLM2: 113 -> 30 MB).
    """

    __slots__ = ("q", "scale", "block", "shape")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, block: int) -> None:
        self.q, self.scale, self.block = q, scale, block
        self.shape = q.shape

    @staticmethod
    def exact(table: torch.Tensor, block: int = 32, chunk_rows: int = 4096) -> Optional["Int8BlockTable"]:
        """The int8 form of `table` if it holds every value exactly, else None."""
        if table.dim() != 2 or table.dtype != torch.float32 or table.shape[1] % block or table.device.type != "cpu":
            return None
        rows, cols = table.shape
        q = torch.empty(rows, cols, dtype=torch.int8)
        scale = torch.empty(rows, cols // block, dtype=torch.float32)
        for start in range(0, rows, chunk_rows):  # chunks: the check's temporaries stay small
            part = table[start:start + chunk_rows].reshape(-1, cols // block, block)
            d = part.abs().amax(dim=2) / 127  # Q8_0 puts 127 at each block's largest magnitude
            d = torch.where(d > 0, d, torch.ones_like(d))
            values = torch.round(part / d[..., None])
            if values.abs().max() > 127 or not torch.equal(values * d[..., None], part):
                return None
            q[start:start + chunk_rows] = values.to(torch.int8).reshape(-1, cols)
            scale[start:start + chunk_rows] = d
        return Int8BlockTable(q, scale, block)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` (dim 0 only), exactly as the table they came from."""
        if dim != 0:
            raise ValueError("Int8BlockTable looks up rows only")
        q, d = self.q.index_select(0, index), self.scale.index_select(0, index)
        n, cols = q.shape
        return (q.view(n, cols // self.block, self.block).float() * d[..., None]).view(n, cols)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.q.numel() + self.scale.numel() * 4


# ---- quantized tensors (format above) ----------------------------------------------------------


@dataclass
class QuantTensor:
    """One linear weight in quantized form: "int4" (q packed, scale, zero), "int8" (q, scale), or
    "affine" (a GGUF file's own blocks, see `gguf_blocks`: q uint8 [out, in] of `bits` bits,
    scale = d and zero = m fp16-exact [out, in / group], w = q * d + m)."""

    mode: str
    q: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor] = None
    bits: int = 0  # affine only: 4, 5 or 8
    source: str = ""  # affine only: the GGUF type it came from

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of the weight it stands for."""
        rows, cols = self.q.shape
        return (rows, cols * 2) if self.mode == "int4" else (rows, cols)

    @property
    def group_size(self) -> Optional[int]:
        """Input columns per scale/zero group (int4, affine), None for per-channel int8."""
        return self.shape[1] // self.scale.shape[1] if self.mode in ("int4", "affine") else None

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight it stands for."""
        if self.mode == "affine":
            out, inp = self.shape
            group = self.group_size
            q = self.q.view(out, inp // group, group).float()
            return (q * self.scale.float()[..., None] + self.zero.float()[..., None]).view(out, inp)
        if self.mode == "int4":
            return dequantize_int4(self.q, self.scale, self.zero)
        return dequantize_int8(self.q, self.scale)

    def params_in(self, dtype: torch.dtype) -> "QuantTensor":
        """The same weight with scales and zeros rounded to `dtype`, as the packed kernels hold them."""
        zero = None if self.zero is None else self.zero.to(dtype).float()
        return QuantTensor(self.mode, self.q, self.scale.to(dtype).float(), zero, self.bits, self.source)

    def scaled(self, factor: float) -> "QuantTensor":
        """The weight times `factor` (scales and zeros scale; q stays). An affine weight whose d and
        m fit fp16 keeps them in fp16 (rounded when `factor` is not a power of two: the model folds
        1/sqrt(head_dim) into q this way, as for every quantized format), so its kernel keeps fp16
        tables and the fused layer stack."""
        scale, zero = self.scale.float() * factor, None if self.zero is None else self.zero.float() * factor
        if self.mode == "affine" and all(torch.equal(t.half().float(), t) for t in (self.scale, self.zero)):
            scale, zero = scale.half().float(), zero.half().float()
        return QuantTensor(self.mode, self.q, scale, zero, self.bits, self.source)

    def format(self) -> tuple:
        """What two weights must share to be concatenated into one kernel."""
        return self.mode, self.bits, self.shape[1], self.group_size

    @staticmethod
    def cat(parts: list["QuantTensor"]) -> "QuantTensor":
        """Concatenate along out-features (fused QKV, gate/up); formats must agree (`format`)."""
        formats = {p.format() for p in parts}
        if len(formats) != 1:
            raise ValueError(f"cannot fuse quantized weights of different formats: {formats}")
        zero = None if parts[0].zero is None else torch.cat([p.zero.float() for p in parts])
        return QuantTensor(parts[0].mode, torch.cat([p.q for p in parts]),
                           torch.cat([p.scale.float() for p in parts]), zero, parts[0].bits,
                           "+".join(sorted({p.source for p in parts if p.source})))

    @staticmethod
    def from_state_dict(sd: dict[str, torch.Tensor], name: str) -> Optional["QuantTensor"]:
        """The quantized form of weight `name` in `sd`, or None when it is not stored quantized."""
        if name + ".affine.q" in sd:
            return _affine_from_state_dict(sd, name)
        if name + ".int4.q" in sd:
            try:
                q, scale, zero = sd[name + ".int4.q"], sd[name + ".int4.scale"], sd[name + ".int4.zero"]
            except KeyError as exc:
                raise ValueError(f"{name}: int4 weights need .int4.q, .int4.scale and .int4.zero; {exc} missing")
            if q.dtype != torch.uint8 or q.dim() != 2 or scale.shape != zero.shape or scale.dim() != 2:
                raise ValueError(f"{name}: expected int4.q uint8 [out, in/2] and scale/zero [out, in/group], got "
                                 f"{q.dtype} {tuple(q.shape)}, {tuple(scale.shape)}, {tuple(zero.shape)}")
            if scale.shape[0] != q.shape[0] or (2 * q.shape[1]) % scale.shape[1]:
                raise ValueError(f"{name}: int4 scale {tuple(scale.shape)} does not fit q {tuple(q.shape)}")
            return QuantTensor("int4", q, scale, zero)
        if name + ".int8.q" in sd:
            q, scale = sd[name + ".int8.q"], sd.get(name + ".int8.scale")
            if scale is None or q.dtype != torch.int8 or q.dim() != 2 or tuple(scale.shape) != (q.shape[0],):
                raise ValueError(f"{name}: expected int8.q int8 [out, in] and int8.scale [out], got "
                                 f"{q.dtype} {tuple(q.shape)}, {None if scale is None else tuple(scale.shape)}")
            return QuantTensor("int8", q, scale)
        return None


AFFINE_KEYS = ("q", "d", "m", "bits")  # N.affine.*: see `affine_state_dict`


def affine_state_dict(name: str, groups: "object") -> dict[str, torch.Tensor]:
    """State-dict entries of weight `name` held as a GGUF file's own groups (`gguf_blocks.AffineGroups`):
    N.affine.q uint8 [out, in] (4-bit values packed two to a byte, as `pack_int4`), N.affine.d and
    N.affine.m fp16 [out, in / group], N.affine.bits uint8 [1] (4, 5 or 8; 5 and 8 held a byte each)."""
    import numpy as np

    q = torch.from_numpy(np.ascontiguousarray(groups.q))
    return {
        f"{name}.affine.q": pack_int4(q) if groups.bits == 4 else q,
        f"{name}.affine.d": torch.from_numpy(np.ascontiguousarray(groups.d)),
        f"{name}.affine.m": torch.from_numpy(np.ascontiguousarray(groups.m)),
        f"{name}.affine.bits": torch.tensor([groups.bits], dtype=torch.uint8),
    }


def _affine_from_state_dict(sd: dict[str, torch.Tensor], name: str) -> QuantTensor:
    try:
        q, d, m, bits = (sd[f"{name}.affine.{k}"] for k in AFFINE_KEYS)
    except KeyError as exc:
        raise ValueError(f"{name}: affine weights need .affine.q, .d, .m and .bits; {exc} missing") from None
    bits = int(bits.reshape(-1)[0])
    if bits not in (4, 5, 8) or q.dtype != torch.uint8 or q.dim() != 2 or d.shape != m.shape or d.dim() != 2:
        raise ValueError(f"{name}: expected affine.q uint8 2-D, d/m of one 2-D shape and 4, 5 or 8 bits, got "
                         f"{q.dtype} {tuple(q.shape)}, {tuple(d.shape)}, {tuple(m.shape)}, {bits} bits")
    values = unpack_int4(q) if bits == 4 else q
    if d.shape[0] != values.shape[0] or values.shape[1] % d.shape[1]:
        raise ValueError(f"{name}: affine d {tuple(d.shape)} does not fit q {tuple(values.shape)}")
    return QuantTensor("affine", values, d.float(), m.float(), bits)


class AffineTable:
    """An embedding table held as a GGUF file's own groups: lookups dequantize just the rows asked
    for (w = q * d + m in fp32), bit for bit what the tied head's kernel multiplies with."""

    __slots__ = ("q", "d", "m", "group", "shape")

    def __init__(self, weight: QuantTensor) -> None:
        # Our own copy: q may point into the artifact's safetensors mmap, whose touched pages all
        # stay resident while any tensor holds the mapping (+110 MB RSS for SmolLM2).
        self.q = weight.q.clone(memory_format=torch.contiguous_format)
        from .native import table_dtype

        # fp16 where the file's d and m fit it, else fp32 (a K type's sub-block scales): exact either way.
        dtype = table_dtype(weight.scale, weight.zero)
        self.d, self.m = weight.scale.to(dtype), weight.zero.to(dtype)
        self.group = weight.group_size
        self.shape = weight.q.shape

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` (dim 0 only)."""
        if dim != 0:
            raise ValueError("AffineTable looks up rows only")
        q = self.q.index_select(0, index).float()
        n, cols = q.shape
        q = q.view(n, cols // self.group, self.group)
        d = self.d.index_select(0, index).float()[..., None]
        m = self.m.index_select(0, index).float()[..., None]
        return (q * d + m).view(n, cols)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.q.numel() + self.d.nbytes + self.m.nbytes
