"""The quantized weight format shared by weight quantizers and the kernels that read it.

A linear weight with Hugging Face name N (the LM head is `lm_head.weight`, also when tied):

  N.int4.q      uint8 [out, in // 2]: two 4-bit values 0..15 per byte, column 2j in the low
                nibble, column 2j + 1 in the high nibble
  N.int4.scale  fp32 [out, in // group]      N.int4.zero  fp32, same shape
                w = (q - 8) * scale + zero, per group of `group` input columns
  N.int8.q      int8 [out, in]               N.int8.scale fp32 [out];  w = q * scale

Embeddings and norms stay fp32. The `quantize` accelerator writes this format, a generating
backend's kernels read it; neither imports the other.
"""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] values 0..15 -> uint8 [out, in // 2] (column 2j low nibble, 2j+1 high)."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {tuple(q.shape)}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in // 2] -> uint8 [out, in] values 0..15 (inverse of `pack_int4`)."""
    packed = packed.to(torch.uint8)
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> dict[str, torch.Tensor]:
    """Round-to-nearest group-wise asymmetric int4 of an fp32 [out, in] weight: {q, scale, zero}."""
    out_features, in_features = weight.shape
    if in_features % group_size or group_size % 2:
        raise ValueError(f"int4: in-features {in_features} must be a multiple of an even group_size {group_size}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0 gives `low`
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return {"q": pack_int4(q.reshape(out_features, in_features)), "scale": scale, "zero": low + 8 * scale}


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] weight of packed int4 (`q` uint8 [out, in // 2]): (q - 8) * scale + zero."""
    values = unpack_int4(q).float()
    group = values.shape[1] // scale.shape[1]
    scale = scale.float().repeat_interleave(group, dim=1)
    zero = zero.float().repeat_interleave(group, dim=1)
    return (values - 8) * scale + zero


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] weight of per-channel int8: q * scale."""
    return q.float() * scale.float()[:, None]
