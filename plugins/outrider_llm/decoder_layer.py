"""What one decoder layer computes, written once, in `decoder_layer`:

    h = RMSNorm(x);  qkv = h Wqkv (+ b: qwen2);  RMSNorm over each q and k head (qwen3);  RoPE on q, k
    x += attend(qkv) Wo
    h = RMSNorm(x);  x += (silu(h Wgate) * h Wup) Wdown

Its implementations:
- the eager forward (`LlamaModel.forward`) and the CUDA-graph step (`cuda_graphs.padded_forward`) run
  `decoder_layer` itself, each with its own attention (per chunk or batched; padded, all slots);
- `fused_layers._Int4LayerStack`, compiled by TorchScript: every layer for packed int4 weights and bf16
  activations, one body for torch's int4 kernel (one chunk) and outrider's int4_mm (every chunk).
  It restates the layer because TorchScript can call neither the eager kernels (Python objects)
  nor a function passed in; it is built from the same pieces (`rope_qk`, `swiglu`,
  `attention.attend_chunk`), and tests/test_llm_quant.py holds it to the eager forward's bits;
- `outrider::w4a8_layers` (csrc/ops.cpp): the whole stack in one native call.
The two fused stacks compute the plain Llama layer only (FUSED_LAYER_FEATURES); a model using any
other part of `decoder_layer` (`layer_features`) runs `decoder_layer`. So a new architecture
feature is its lines in `decoder_layer` and its name in `layer_features`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .config import LlamaConfig

#: The optional parts of `decoder_layer` the fused stacks also compute (none: plain Llama layers).
FUSED_LAYER_FEATURES: frozenset[str] = frozenset()


class LayerWeights:
    """One decoder layer's norms (fp32 tensors) and projections (callables, x -> x W^T); the
    optional parts are None where the architecture has none."""

    __slots__ = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down", "qkv_bias", "q_norm", "k_norm")


def layer_features(config: LlamaConfig) -> frozenset[str]:
    """The optional parts of `decoder_layer` that `config` turns on."""
    used = {"qkv_bias": config.qkv_bias, "qk_norm": config.qk_norm}
    return frozenset(name for name, on in used.items() if on)


def decoder_layer(config: LlamaConfig, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attend: Callable[[torch.Tensor], torch.Tensor], low: Optional[torch.dtype]) -> torch.Tensor:
    """The residual stream x [T, hidden] after `layer` (x is updated in place).

    `attend(qkv)` is this layer's attention: it takes q | k | v [T, (heads + 2 kv_heads) * head_dim]
    after RoPE, writes k and v into the cache and returns [T, heads * head_dim]. `low` is the matmul
    dtype where it is not fp32: only the matmuls' inputs take it; the residual stream, norms, RoPE,
    attention and the KV cache stay fp32 (bf16 bmm ran 2.5x slower than fp32 here, and fp32 keeps
    accuracy).
    """
    cfg = config
    d, eps, hidden = cfg.head_dim, cfg.rms_norm_eps, (cfg.hidden_size,)
    h = F.rms_norm(x, hidden, layer.attn_norm, eps)
    qkv = layer.qkv(h if low is None else h.to(low))
    if low is not None:
        qkv = qkv.float()
    if layer.qkv_bias is not None:  # qwen2
        qkv = qkv + layer.qkv_bias
    if layer.q_norm is not None:  # qwen3: RMSNorm over each head of q and of k
        total, nq, nk = x.shape[0], cfg.num_heads * d, cfg.num_kv_heads * d
        q, k = qkv[:, :nq].view(total, cfg.num_heads, d), qkv[:, nq:nq + nk].view(total, cfg.num_kv_heads, d)
        q.copy_(F.rms_norm(q, (d,), layer.q_norm, eps))
        k.copy_(F.rms_norm(k, (d,), layer.k_norm, eps))
    rope_qk(qkv, cos, sin, cfg.num_heads + cfg.num_kv_heads, d)  # qkv is now q' | k' | v
    attn = attend(qkv)
    # fp32 += bf16 upcasts inside the add: the same sums, no fp32 copy of the matmul's output.
    x.add_(layer.o(attn if low is None else attn.to(low)))
    h = F.rms_norm(x, hidden, layer.mlp_norm, eps)
    gate_up = layer.gate_up(h if low is None else h.to(low))
    x.add_(layer.down(swiglu(gate_up, cfg.intermediate_size)))
    return x


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_heads: int, head_dim: int) -> None:
    """RoPE on the q and k heads of qkv [n, ...], in place (`sin` signed as `LlamaModel._rope_table` keeps it)."""
    n, d = qkv.shape[0], head_dim
    qk = qkv[:, : qk_heads * d].view(n, qk_heads, d)
    swapped = qk.view(n, qk_heads, 2, d // 2).flip(2).view(n, qk_heads, d)
    torch.addcmul(qk * cos, swapped, sin, out=qk)


def swiglu(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gate) * up, from the fused gate | up projection's output [T, 2 * intermediate]."""
    return F.silu(gate_up[:, :intermediate]).mul_(gate_up[:, intermediate:])
