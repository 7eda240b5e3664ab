"""Every decoder layer of a step in one call, for packed int4 weights: the TorchScript stack on
torch's or outrider's int4 kernels, or the native w4a8 stack (see decoder_layer.py for what the
layer computes and which stacks restate it)."""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from .attention import CAUSAL, BatchPlan, ChunkPlan, NativeChunks, attend_chunk
from .config import LlamaConfig
from .decoder_layer import FUSED_LAYER_FEATURES, LayerWeights, layer_features, rope_qk, swiglu

log = logging.getLogger("outrider.llm")


class _AtenInt4Matmul(torch.nn.Module):
    """torch's packed int4 kernel: bf16 in, bf16 out (no minimums: its zeros are in `scales`)."""

    def forward(self, x: torch.Tensor, i: int, packed: List[torch.Tensor], scales: List[torch.Tensor],
                minimums: List[torch.Tensor], group_size: int) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed[i], group_size, scales[i])


class _NativeInt4Matmul(torch.nn.Module):
    """outrider's int4_mm (native.py): bf16 in, fp32 out."""

    def forward(self, x: torch.Tensor, i: int, packed: List[torch.Tensor], scales: List[torch.Tensor],
                minimums: List[torch.Tensor], group_size: int) -> torch.Tensor:
        return torch.ops.outrider.int4_mm(x, packed[i], scales[i], minimums[i], group_size)


class _OneChunkAttention(torch.nn.Module):
    """The step's one chunk (`slot`, `length` committed, `mask`) through torch ops; `chunks` and
    `visible` unused."""

    def forward(self, qkv: torch.Tensor, kv: torch.Tensor, chunks: torch.Tensor, visible: torch.Tensor, slot: int,
                length: int, mask: Optional[torch.Tensor], num_heads: int, num_kv_heads: int,
                head_dim: int) -> torch.Tensor:
        return attend_chunk(qkv, kv[:, slot], length, mask, num_heads, num_kv_heads, head_dim)


class _NativeAttention(torch.nn.Module):
    """Every chunk of the step through `outrider::attend` (`chunks` / `visible` as `NativeChunks`
    holds them); `slot`, `length` and `mask` unused."""

    def forward(self, qkv: torch.Tensor, kv: torch.Tensor, chunks: torch.Tensor, visible: torch.Tensor, slot: int,
                length: int, mask: Optional[torch.Tensor], num_heads: int, num_kv_heads: int,
                head_dim: int) -> torch.Tensor:
        return torch.ops.outrider.attend(qkv, kv, chunks, visible, num_heads, num_kv_heads)


class _Int4LayerStack(torch.nn.Module):
    """Every layer of a step, all linears packed int4 with bf16 activations: `decoder_layer` for
    FUSED_LAYER_FEATURES, the matmul and the attention fixed when TorchScript compiles it (which
    then runs the ~40 small operations per layer without the interpreter between them).

    Layer i's weights are norms[2i:2i+2] and packed/scales/minimums[4i:4i+4] (qkv, o, gate_up,
    down); kv is the cache's [layers, 2, slots, kv_heads, capacity, head_dim]. x is updated in place.
    """

    def __init__(self, matmul: torch.nn.Module, attention: torch.nn.Module) -> None:
        super().__init__()
        self.matmul, self.attention = matmul, attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, chunks: torch.Tensor,
                visible: torch.Tensor, slot: int, length: int, mask: Optional[torch.Tensor], norms: List[torch.Tensor],
                packed: List[torch.Tensor], scales: List[torch.Tensor], minimums: List[torch.Tensor], group_size: int,
                num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float) -> torch.Tensor:
        hidden = [x.shape[1]]
        for li in range(kv.shape[0]):
            h = F.rms_norm(x, hidden, norms[2 * li], eps).to(torch.bfloat16)
            qkv = self.matmul(h, 4 * li, packed, scales, minimums, group_size).float()
            rope_qk(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
            attn = self.attention(qkv, kv[li], chunks, visible, slot, length, mask, num_heads, num_kv_heads, head_dim)
            x.add_(self.matmul(attn.to(torch.bfloat16), 4 * li + 1, packed, scales, minimums, group_size))
            h = F.rms_norm(x, hidden, norms[2 * li + 1], eps).to(torch.bfloat16)
            gate_up = self.matmul(h, 4 * li + 2, packed, scales, minimums, group_size)
            act = swiglu(gate_up, intermediate).to(torch.bfloat16)
            x.add_(self.matmul(act, 4 * li + 3, packed, scales, minimums, group_size))
        return x


def _w4a8_layers(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, chunks: torch.Tensor,
    visible: torch.Tensor, slot: int, length: int, mask: Optional[torch.Tensor], norms: List[torch.Tensor],
    packed: List[torch.Tensor], scales: List[torch.Tensor], minimums: List[torch.Tensor], group_size: int,
    num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float,
) -> torch.Tensor:
    """`_Int4LayerStack`'s call for w4a8 weights: one native call (csrc/ops.cpp), every chunk of the
    step attending through `chunks` / `visible` (`slot`, `length`, `mask` unused)."""
    rows = x.shape[0]
    torch.ops.outrider.w4a8_layers(x, cos.view(rows, head_dim), sin.view(rows, head_dim), kv, chunks, visible, norms,
                                   packed, scales, minimums, group_size, num_heads, num_kv_heads, intermediate, eps)
    return x


_SCRIPTED: dict[str, object] = {}


def _scripted_int4_layers(native: bool):
    """The int4 layer stack on outrider's int4_mm and attention (`native`) or torch's, compiled by
    TorchScript once per process (None where that fails)."""
    key = "native" if native else "aten"
    if key not in _SCRIPTED:
        try:
            import warnings

            stack = (_Int4LayerStack(_NativeInt4Matmul(), _NativeAttention()) if native
                     else _Int4LayerStack(_AtenInt4Matmul(), _OneChunkAttention()))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TorchScript's deprecation notice: it still runs
                _SCRIPTED[key] = torch.jit.script(stack)
        except Exception as exc:  # TorchScript missing or changed: the eager path serves
            log.info("TorchScript layer stack unavailable (%s); eager forward", exc)
            _SCRIPTED[key] = None
    return _SCRIPTED[key]


class FusedLayerStack:
    """A fused stack (`_scripted_int4_layers` or `_w4a8_layers`) and the weights it reads, gathered
    once at load: layer i's are norms[2i:2i+2] and packed/scales/minimums[4i:4i+4]."""

    def __init__(self, fn: Callable, native: bool, norms: List[torch.Tensor], packed: List[torch.Tensor],
                 scales: List[torch.Tensor], minimums: List[torch.Tensor], group_size: int) -> None:
        self.fn, self.native = fn, native
        self.norms, self.packed, self.scales, self.minimums = norms, packed, scales, minimums
        self.group_size = group_size

    @classmethod
    def for_layers(cls, config: LlamaConfig, device: torch.device, layers: list[LayerWeights],
                   native_attention: bool) -> Optional["FusedLayerStack"]:
        """The stack when every layer linear is a packed int4 kernel without a dense copy (the
        quantized SmolLM2 here) and the layers need nothing beyond FUSED_LAYER_FEATURES, else None:
        `decoder_layer` per operation."""
        from .linear import Int4Linear

        linears = [k for layer in layers for k in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        beyond = layer_features(config) - FUSED_LAYER_FEATURES
        if beyond:
            log.info("%s layers (%s) run per operation: the fused layer stacks compute plain Llama layers",
                     config.architecture, ", ".join(sorted(beyond)))
            return None
        if device.type != "cpu" or not linears or not all(
            type(k) is Int4Linear and k.dense is None for k in linears
        ):
            return None
        if len({k.group for k in linears}) != 1 or len({k.kernel for k in linears}) != 1:
            return None
        native = linears[0].kernel in ("int4native", "w4a8")
        if native != native_attention:
            return None
        if native and any(k.scales_zeros.dtype != torch.float16 for k in linears):
            return None  # fp32 tables (a GGUF K type's scales): the fused stack reads fp16 only
        fn = _w4a8_layers if linears[0].kernel == "w4a8" else _scripted_int4_layers(native)
        if fn is None:
            return None
        norms = [w for layer in layers for w in (layer.attn_norm, layer.mlp_norm)]
        minimums = [k.minimums for k in linears] if native else []
        return cls(fn, native, norms, [k.packed for k in linears], [k.scales_zeros for k in linears], minimums,
                   linears[0].group)

    def covers(self, plan: list[ChunkPlan], batch: "BatchPlan | NativeChunks | None") -> bool:
        """Whether this stack runs a step so planned: the native stack every chunk of the step,
        none through SDPA; the aten stack one chunk."""
        if self.native:
            return isinstance(batch, NativeChunks) and not plan
        return batch is None and len(plan) == 1 and not plan[0].use_sdpa

    def run(self, config: LlamaConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
            plan: list[ChunkPlan], batch: Optional[NativeChunks]) -> None:
        """Every layer over the step's residual stream x, in place (a step `covers` holds)."""
        if self.native:
            where: tuple = (batch.chunks, batch.visible, 0, 0, None)
        else:
            where = (CAUSAL, CAUSAL, plan[0].slot, plan[0].length, plan[0].mask)
        self.fn(x, cos, sin, kv, *where, self.norms, self.packed, self.scales, self.minimums, self.group_size,
                config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size, config.rms_norm_eps)
