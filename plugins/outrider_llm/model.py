"""A Llama-shaped decoder for CPU serving: slot KV cache, tree attention, one pass per weight.

Implements `CausalLM` from `contract.py`. What makes it fast on a 2-core CPU:

- Every step packs all chunks' tokens into one [T, hidden] batch, so each weight matrix is read
  once per step: one matmul per projection (fused QKV, fused gate/up) for all sequences together.
- Weights are prepacked for oneDNN once at load (`torch.ops.mkldnn._reorder_linear_weight`). On
  the AMD EPYC (AVX-512) dev machine that is 3x faster than `F.linear` (MKL) for 1-32 rows in fp32;
  oneDNN's fused residual-add post-op measured no faster than an in-place add, so no post-ops.
- The 1/sqrt(head_dim) attention scale is folded into the Q rows (a power of two: exact).
- Masks are built once per step and shared by all layers; decode tokens without a tree need none.
- Attention is per chunk against its own slot's cache, except that small chunks (decode tokens,
  draft trees) of several sequences attend together in one padded call when a rough cost model
  says the saved per-call overhead beats the padding (8 decode sequences: 29 -> 24 ms a step).

`dtype` picks the matmul precision: fp32 (default, matches transformers to ~1e-5 of the logit
scale) or bf16 (weights and matmul inputs; residual stream, norms, attention and the KV cache stay
fp32; top-1 agreement with fp32 0.988 on greedy continuations, ~1.3-1.5x faster on AVX512-BF16).
Linear weights may also come quantized (int4 group-wise or int8 per-channel, format and kernels in
linear.py): they then run through torch's packed weight-only kernels with bf16 activations, chosen
and checked at load by `linear.choose_kernel`; embeddings and norms stay fp32 in every mode.
Runs under `torch.no_grad()`. Built for CPU; on CUDA the linears are plain `F.linear` in fp16 or
bf16 (quantized weights dequantized to dense), the KV cache is static, and decode and verify steps
replay CUDA graphs (`cuda_graphs.py`, attached with `cuda_graphs.use_cuda_graphs`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from outrider.generation.contract import Chunk, ForwardOutput

from .config import FINGERPRINT_ROW_STRIDE, LlamaConfig, rope_tables, weights_fingerprint
from .kv_cache import SlotKVCache
from .kernel_choice import KernelPlan, choose_kernel
from .linear import (NATIVE_KERNELS, ConcatLinear, QuantizedLinear, TiedRows, W8A8Linear, affine_linear,
                     cpu_has_native_bf16, dense_linear, onednn_works)
from .quantized_weights import AffineTable, Int8BlockTable, QuantTensor

log = logging.getLogger("outrider.llm")

ROPE_ROWS_AT_START = 2048  # positions the RoPE tables hold before a longer sequence grows them

# Chunks longer than this attend through SDPA (flash kernel, no [n, L] score matrix in memory);
# shorter ones through two batched matmuls, faster for decode and verification.
SDPA_MIN_TOKENS = 128
# Chunks of up to this many tokens may attend together, padded, over a range of slots, when the
# rough cost model below says that beats one call per chunk (python + dispatch cost, ~40 us
# per chunk and layer on the dev machine) despite the padding and unused slots it reads.
BATCH_MAX_TOKENS = 64
CHUNK_FIXED_US, BATCH_FIXED_US = 40.0, 80.0
BYTES_PER_US, FLOPS_PER_US = 30e3, 1e5  # ~30 GB/s and ~100 GFLOP/s on 2 cores


def resolve_dtype(dtype: "str | torch.dtype | None", device: "str | torch.device | None" = None) -> torch.dtype:
    """fp32 by default; "auto" picks bf16 where the CPU multiplies bf16 natively (AVX512-BF16/AMX),
    and on CUDA bf16 where the GPU has it, else fp16."""
    if dtype is None or dtype in ("fp32", "float32", torch.float32):
        return torch.float32
    if dtype in ("bf16", "bfloat16", torch.bfloat16):
        return torch.bfloat16
    if dtype in ("fp16", "float16", torch.float16):
        return torch.float16
    if dtype == "auto":
        if device is not None and torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    raise ValueError(f"dtype must be 'fp32', 'bf16', 'fp16' or 'auto', not {dtype!r}")


def _w8a8_head(table: torch.Tensor, exact: Optional[Int8BlockTable]) -> "W8A8Linear":
    """The LM head in blocks of 32 int8 values with one scale each: the GGUF's own Q8_0 values when
    the table is such (`exact`, from Int8BlockTable.exact), else quantized so (scale amax / 127,
    kept in fp16)."""
    if exact is not None and exact.block == 32:
        return W8A8Linear(exact.q, exact.scale)
    blocks = table.float().view(table.shape[0], -1, 32)
    scale = (blocks.abs().amax(dim=2) / 127).half().float()
    q = torch.round(blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]).clamp_(-127, 127)
    return W8A8Linear(q.to(torch.int8).view(table.shape), scale)


# ---- the decoder layer ---------------------------------------------------------------------------
#
# What one decoder layer computes, written once, in `decoder_layer`:
#
#     h = RMSNorm(x);  qkv = h Wqkv (+ b: qwen2);  RMSNorm over each q and k head (qwen3);  RoPE on q, k
#     x += attend(qkv) Wo
#     h = RMSNorm(x);  x += (silu(h Wgate) * h Wup) Wdown
#
# Its implementations:
# - the eager forward (`LlamaModel.forward`) and the CUDA-graph step (`cuda_graphs.padded_forward`) run
#   `decoder_layer` itself, each with its own attention (per chunk or batched; padded, all slots);
# - `_Int4LayerStack`, compiled by TorchScript: every layer for packed int4 weights and bf16
#   activations, one body for torch's int4 kernel (one chunk) and outrider's int4_mm (every chunk).
#   It restates the layer because TorchScript can call neither the eager kernels (Python objects)
#   nor a function passed in; it is built from the same pieces (`_rope_qk`, `_swiglu`,
#   `_attend_chunk`), and tests/test_llm_quant.py holds it to the eager forward's bits;
# - `outrider::w4a8_layers` (csrc/ops.cpp): the whole stack in one native call.
# The two fused stacks compute the plain Llama layer only (FUSED_LAYER_FEATURES); a model using any
# other part of `decoder_layer` (`layer_features`) runs `decoder_layer`. So a new architecture
# feature is its lines in `decoder_layer` and its name in `layer_features`.

#: The optional parts of `decoder_layer` the fused stacks also compute (none: plain Llama layers).
FUSED_LAYER_FEATURES: frozenset[str] = frozenset()


def layer_features(config: LlamaConfig) -> frozenset[str]:
    """The optional parts of `decoder_layer` that `config` turns on."""
    used = {"qkv_bias": config.qkv_bias, "qk_norm": config.qk_norm}
    return frozenset(name for name, on in used.items() if on)


def decoder_layer(config: LlamaConfig, layer: "_Layer", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
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
    _rope_qk(qkv, cos, sin, cfg.num_heads + cfg.num_kv_heads, d)  # qkv is now q' | k' | v
    attn = attend(qkv)
    # fp32 += bf16 upcasts inside the add: the same sums, no fp32 copy of the matmul's output.
    x.add_(layer.o(attn if low is None else attn.to(low)))
    h = F.rms_norm(x, hidden, layer.mlp_norm, eps)
    gate_up = layer.gate_up(h if low is None else h.to(low))
    x.add_(layer.down(_swiglu(gate_up, cfg.intermediate_size)))
    return x


def _rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_heads: int, head_dim: int) -> None:
    """RoPE on the q and k heads of qkv [n, ...], in place (`sin` signed as `LlamaModel._rope_table` keeps it)."""
    n, d = qkv.shape[0], head_dim
    qk = qkv[:, : qk_heads * d].view(n, qk_heads, d)
    swapped = qk.view(n, qk_heads, 2, d // 2).flip(2).view(n, qk_heads, d)
    torch.addcmul(qk * cos, swapped, sin, out=qk)


def _swiglu(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gate) * up, from the fused gate | up projection's output [T, 2 * intermediate]."""
    return F.silu(gate_up[:, :intermediate]).mul_(gate_up[:, intermediate:])


def _attend_chunk(qkv: torch.Tensor, cell: torch.Tensor, length: int, mask: Optional[torch.Tensor], num_heads: int,
                  num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Attention of one chunk's n rows of qkv (after RoPE) against its slot: K/V written into `cell`
    ([2, kv_heads, capacity, head_dim]) at length.., then [n, heads * head_dim].

    Queries go grouped by their KV head, [kv_heads, group * n, d], so K/V are read as stored;
    `mask` is additive [group * n, length + n] (None: every row sees everything, a single token).
    """
    n, d = qkv.shape[0], head_dim
    group, q_width = num_heads // num_kv_heads, num_heads * head_dim
    cell[:, :, length : length + n] = qkv[:, q_width:].view(n, 2, num_kv_heads, d).permute(1, 2, 0, 3)
    keys, values = cell[0, :, : length + n], cell[1, :, : length + n]
    q = qkv[:, :q_width].view(n, num_kv_heads, group, d).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, d)
    if mask is None:
        scores = torch.bmm(q, keys.transpose(1, 2))
    else:
        scores = torch.baddbmm(mask, q, keys.transpose(1, 2))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, values).view(num_kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, q_width)


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
        return _attend_chunk(qkv, kv[:, slot], length, mask, num_heads, num_kv_heads, head_dim)


class _NativeAttention(torch.nn.Module):
    """Every chunk of the step through `outrider::attend` (`chunks` / `visible` as `_NativeChunks`
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
            _rope_qk(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
            attn = self.attention(qkv, kv[li], chunks, visible, slot, length, mask, num_heads, num_kv_heads, head_dim)
            x.add_(self.matmul(attn.to(torch.bfloat16), 4 * li + 1, packed, scales, minimums, group_size))
            h = F.rms_norm(x, hidden, norms[2 * li + 1], eps).to(torch.bfloat16)
            gate_up = self.matmul(h, 4 * li + 2, packed, scales, minimums, group_size)
            act = _swiglu(gate_up, intermediate).to(torch.bfloat16)
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


class _ChunkPlan:
    """One chunk attending on its own: rows start:end of the step, its slot and mask."""

    __slots__ = ("slot", "start", "end", "length", "mask", "use_sdpa")

    def __init__(self, slot: int, start: int, end: int, length: int, mask, use_sdpa: bool) -> None:
        self.slot, self.start, self.end, self.length = slot, start, end, length
        self.mask, self.use_sdpa = mask, use_sdpa


class _BatchPlan:
    """Several small chunks attending together over slots first..first+count-1 (padded queries).

    rows: their rows in the step (None: all of them, in order); where: scatter index [rows] ->
    padded row (slot - first) * width + i; write_slot/write_pos: cache cell of each row;
    mask: additive [count, 1, group * width, span].
    """

    __slots__ = ("rows", "first", "count", "width", "span", "where", "write_slot", "write_pos", "mask", "spans")


class _NativeChunks:
    """The chunks of a step that `outrider::attend` serves, all in one call per layer.

    chunks: int64 [C, 4] (slot, first row, rows, committed length); visible: bool [T, W], row t
    sees fed token c of its chunk (an empty tensor: causal everywhere); spans as `_BatchPlan`'s.
    """

    __slots__ = ("chunks", "visible", "spans")

    def __init__(self, chunks: torch.Tensor, visible: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
        self.chunks, self.visible, self.spans = chunks, visible, spans


class _Layer:
    __slots__ = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down", "qkv_bias", "q_norm", "k_norm")


class LlamaModel(torch.nn.Module):
    """Llama decoder implementing `CausalLM` (see contract.py) for CPU inference."""

    def __init__(
        self,
        config: LlamaConfig,
        state_dict: dict[str, torch.Tensor],
        dtype: "str | torch.dtype | None" = None,
        use_onednn: Optional[bool] = None,
        device: "str | torch.device | None" = None,
        kernel: str = "auto",
    ) -> None:
        """Build from Hugging Face Llama weight names (`model.layers.0.self_attn.q_proj.weight`, ...).

        Linear weights may be given quantized instead (`N.int4.q/.scale/.zero` or `N.int8.q/.scale`,
        format in linear.py; the tied LM head as `lm_head.weight.*`). Then `kernel` (see
        `choose_kernel`) decides how they run, and the compute dtype becomes that kernel's (bf16 for
        the packed kernels): `dtype` only applies to a model without quantized weights.
        """
        super().__init__()
        self.config = config
        self.device = torch.device(device or "cpu")
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        # One plan per quantized format present (int4 layers usually come with an int8 LM head).
        self.kernel_plans: dict[str, KernelPlan] = {}
        for mode in _quant_modes(state_dict):
            if self.device.type == "cpu":
                self.kernel_plans[mode] = choose_kernel(mode, _kernel_for(mode, kernel), _group_size(state_dict))
            else:  # the packed kernels are CPU-only: dequantize
                self.kernel_plans[mode] = KernelPlan(mode, "dense", resolve_dtype(dtype, self.device),
                                                     reason="not a CPU")
        if any(k.endswith(".affine.q") for k in state_dict):
            # A GGUF file's own blocks: the native kernels take fp32 rows (and quantize them).
            self.dtype = torch.float32
        elif self.kernel_plans:
            # bf16 as soon as one kernel takes bf16: every projection's output is then cast back to
            # fp32 (a dense fp32 kernel converts its bf16 input itself).
            # w4a8 layers read fp32 (they quantize it themselves): then fp32, and another format's
            # kernel (an int8 head) converts its own input.
            dtypes = {plan.dtype for plan in self.kernel_plans.values()}
            if any(plan.kernel == "w4a8" for plan in self.kernel_plans.values()):
                self.dtype = torch.float32
            else:
                self.dtype = torch.bfloat16 if torch.bfloat16 in dtypes else dtypes.pop()
        else:
            self.dtype = resolve_dtype(dtype, self.device)
        if use_onednn is None:
            use_onednn = self.device.type == "cpu" and onednn_works(self.dtype)
        self.uses_onednn = bool(use_onednn)
        self.batch_attention = True  # let small chunks attend together when cheaper (see _plan)
        self.graph_runner = None  # CUDA graphs for decode/verify steps (cuda_graphs.use_cuda_graphs)
        if config.num_heads % config.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self._load(state_dict)
        # Grown on demand (forward): a Llama 3 file's 131,072 positions would be 134 MB up front.
        self._rope_table(min(config.max_position_embeddings, ROPE_ROWS_AT_START))
        self.native_attention = self._native_attention_usable()
        self._fast_layers = self._plan_fast_layers()

    # ---- weights -------------------------------------------------------------------------

    def _load(self, sd: dict[str, torch.Tensor]) -> None:
        cfg, dt, onednn = self.config, self.dtype, self.uses_onednn
        scale = cfg.head_dim**-0.5

        def get(name: str) -> torch.Tensor:
            if name not in sd:
                raise KeyError(f"missing weight {name!r}")
            return sd[name].to(self.device, torch.float32)

        def own(tensor: torch.Tensor) -> torch.Tensor:
            # A copy we own: a tensor still pointing into a safetensors mmap keeps the whole
            # file's touched pages resident (+430 MB RSS for SmolLM2) after the state dict goes.
            return tensor.clone(memory_format=torch.contiguous_format)

        def weight(name: str, factor: float = 1.0) -> "torch.Tensor | QuantTensor":
            quant = QuantTensor.from_state_dict(sd, name)
            if quant is not None:
                return quant if factor == 1.0 else quant.scaled(factor)
            w = get(name)
            return w if factor == 1.0 else w * factor

        def quant_linear(weight: QuantTensor):
            if weight.mode == "affine":
                if self.device.type == "cpu":
                    return affine_linear(weight)
                return dense_linear(weight.dequantize(), self.dtype, self.device)
            return self.kernel_plans[weight.mode].build(weight, self.device)

        def linear(*parts: "torch.Tensor | QuantTensor"):
            # Fused projections concatenate along out-features where all parts share a format;
            # a GGUF file's mixed block types (Q4_K q/k, Q6_K v) run side by side; a partly
            # quantized state dict runs dense from its fp32 values.
            if all(isinstance(p, QuantTensor) for p in parts):
                if len({p.format() for p in parts}) > 1:
                    return ConcatLinear([quant_linear(p) for p in parts])
                return quant_linear(parts[0] if len(parts) == 1 else QuantTensor.cat(list(parts)))
            dense = [p.dequantize().to(self.device) if isinstance(p, QuantTensor) else p for p in parts]
            return QuantizedLinear(dense[0] if len(dense) == 1 else torch.cat(dense), dt, onednn)

        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.attn_norm = own(get(p + "input_layernorm.weight"))
            layer.mlp_norm = own(get(p + "post_attention_layernorm.weight"))
            # Scaling Q by 1/sqrt(head_dim) commutes with RoPE; for head_dim 64 it is 1/8, exact.
            # Under a q norm (qwen3) the norm would undo it: there it scales the norm's weight.
            q_scale = 1.0 if cfg.qk_norm else scale
            layer.qkv = linear(weight(p + "self_attn.q_proj.weight", q_scale),
                               weight(p + "self_attn.k_proj.weight"), weight(p + "self_attn.v_proj.weight"))
            layer.qkv_bias = own(torch.cat([get(p + "self_attn.q_proj.bias") * scale, get(p + "self_attn.k_proj.bias"),
                                            get(p + "self_attn.v_proj.bias")])) if cfg.qkv_bias else None
            layer.q_norm = own(get(p + "self_attn.q_norm.weight") * scale) if cfg.qk_norm else None
            layer.k_norm = own(get(p + "self_attn.k_norm.weight")) if cfg.qk_norm else None
            layer.o = linear(weight(p + "self_attn.o_proj.weight"))
            layer.gate_up = linear(weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight"))
            layer.down = linear(weight(p + "mlp.down_proj.weight"))
            self.layers.append(layer)
        self.final_norm = own(get("model.norm.weight"))
        embed_quant = QuantTensor.from_state_dict(sd, "model.embed_tokens.weight")
        if embed_quant is not None and embed_quant.mode == "affine":
            # The file's own blocks serve lookups (rows dequantized as asked) and the tied head.
            self._load_affine_embeddings(embed_quant, QuantTensor.from_state_dict(sd, "lm_head.weight"),
                                         linear, get)
            return
        # Embedding lookups read a few rows: keep them fp32 whatever the compute dtype.
        self.embed_weight = own(get("model.embed_tokens.weight"))
        # The GGUF's Q8_0 table, dequantized, is exactly int8 blocks times a scale: the compact
        # form serves lookups, and a w4a8 model's tied head reads the same values.
        compact = Int8BlockTable.exact(self.embed_weight) if self.device.type == "cpu" else None
        head_quant = QuantTensor.from_state_dict(sd, "lm_head.weight")
        if cfg.tie_word_embeddings:
            self.head_weight = None
            # A tied head may still be stored quantized (under lm_head.weight.*): the embedding
            # stays fp32 for lookups and the fingerprint, the head reads the quantized copy.
            if head_quant is not None:
                self.head = linear(head_quant)
            elif self._w4a8_head_fits():
                self.head = _w8a8_head(self.embed_weight, compact)
            else:
                self.head = QuantizedLinear(self.embed_weight, dt, onednn)
        elif head_quant is not None:
            # lm_head_rows needs fp32 rows: keep the dequantized weight (exactly what the kernel computes with)
            self.head_weight = head_quant.dequantize().to(self.device)
            self.head = linear(head_quant)
        else:
            self.head_weight = own(get("lm_head.weight"))
            self.head = QuantizedLinear(self.head_weight, dt, onednn)
        # The head is built (it packed its own copy): lookups may now read the compact form.
        if compact is not None:
            self.embed_weight = compact

    def _load_affine_embeddings(self, embed: QuantTensor, head: Optional[QuantTensor], linear: Callable,
                                get: Callable) -> None:
        """Embeddings (and the head) from a GGUF file's own blocks: no fp32 copy of either, and for
        a tied head one copy of the table, the head's tiles, that lookups read rows from."""
        if self.config.tie_word_embeddings:
            self.head_weight = None
            self.head = linear(head if head is not None else embed)
            self.embed_weight = self._rows_of(embed, self.head if head is None else None)
        else:
            self.embed_weight = self._rows_of(embed)
            if head is not None:
                self.head = linear(head)
                self.head_weight = self._rows_of(head, self.head)  # a draft head's rows
            else:
                self.head_weight = get("lm_head.weight").clone()
                self.head = QuantizedLinear(self.head_weight, self.dtype, self.uses_onednn)

    def _rows_of(self, weight: QuantTensor,
                 kernel: Optional[Callable] = None) -> "torch.Tensor | AffineTable | TiedRows":
        """What row lookups of `weight` read: `kernel`'s own tiles when it is a native kernel of
        that same weight (no second copy), else the file's groups, else (not a CPU) fp32."""
        if self.device.type != "cpu":
            return weight.dequantize().to(self.device)
        if getattr(kernel, "kernel", "") in ("w4a8", "w5a8", "w8a8"):
            return TiedRows(kernel, weight.shape)
        return AffineTable(weight) if weight.mode == "affine" else weight.dequantize()

    def _native_attention_usable(self) -> bool:
        """Attention through `outrider::attend` (see csrc/ops.cpp) where the layers run outrider's
        native int4 kernels (the extension is loaded then), so that a draft tree's rows get exactly
        the logits a one-token step gets (the int8 or bf16 activations downstream would turn
        torch attention's last-bit differences into rounding steps)."""
        linears = [k for layer in self.layers for k in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        cfg = self.config
        return (self.device.type == "cpu" and bool(linears) and cfg.head_dim in (16, 32, 64, 128)
                and all(getattr(k, "kernel", None) in NATIVE_KERNELS for k in linears))

    def _w4a8_head_fits(self) -> bool:
        """Whether an unquantized head joins "w4a8" layers as block-wise int8 (W8A8Linear)."""
        plan = self.kernel_plans.get("int4")
        return (plan is not None and plan.kernel == "w4a8" and self.device.type == "cpu"
                and W8A8Linear.usable(self.vocab_size, self.hidden_size))

    def _plan_fast_layers(self) -> Optional[tuple]:
        """(fused stack, norms, packed, scales, minimums, group) when every layer linear is a packed
        int4 kernel without a dense copy (the quantized SmolLM2 here) and the layers need nothing
        beyond FUSED_LAYER_FEATURES, else None: `decoder_layer` per operation."""
        from .linear import Int4Linear

        linears = [k for layer in self.layers for k in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        beyond = layer_features(self.config) - FUSED_LAYER_FEATURES
        if beyond:
            log.info("%s layers (%s) run per operation: the fused layer stacks compute plain Llama layers",
                     self.config.architecture, ", ".join(sorted(beyond)))
            return None
        if self.device.type != "cpu" or not linears or not all(
            type(k) is Int4Linear and k.dense is None for k in linears
        ):
            return None
        if len({k.group for k in linears}) != 1 or len({k.kernel for k in linears}) != 1:
            return None
        native = linears[0].kernel in ("int4native", "w4a8")
        if native != self.native_attention:
            return None
        if native and any(k.scales_zeros.dtype != torch.float16 for k in linears):
            return None  # fp32 tables (a GGUF K type's scales): the fused stack reads fp16 only
        fn = _w4a8_layers if linears[0].kernel == "w4a8" else _scripted_int4_layers(native)
        if fn is None:
            return None
        norms = [w for layer in self.layers for w in (layer.attn_norm, layer.mlp_norm)]
        minimums = [k.minimums for k in linears] if native else []
        return fn, norms, [k.packed for k in linears], [k.scales_zeros for k in linears], minimums, linears[0].group

    def weight_bytes(self) -> int:
        """Bytes held by the matmul kernels (embeddings and norms not counted)."""
        kernels = [self.head] + [k for layer in self.layers for k in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(getattr(k, "nbytes", 0) for k in kernels)

    def _rope_table(self, size: int) -> None:
        cos, sin_signed = rope_tables(self.config, size)  # shared with the torch-free model
        self._cos = torch.from_numpy(cos).to(self.device)
        self._sin_signed = torch.from_numpy(sin_signed).to(self.device)

    # ---- CausalLM ------------------------------------------------------------------------

    def new_cache(self, num_slots: int, max_length: int) -> SlotKVCache:
        """A KV cache for `num_slots` sequences of up to `max_length` tokens each (static on CUDA)."""
        return SlotKVCache(self.config, num_slots, max_length, torch.float32, self.device,
                           static=self.device.type == "cuda")

    @torch.no_grad()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 [n] -> float32 [n, hidden] input embeddings."""
        return self.embed_weight.index_select(0, tokens.reshape(-1).to(self.device, torch.long))

    def lm_head_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The LM head's rows for `tokens`, fp32 [k, hidden] (a draft head's restricted vocabulary)."""
        tokens = tokens.reshape(-1).to(self.device, torch.long)
        if self.config.tie_word_embeddings:
            return self.embed(tokens)
        return self.head_weight.index_select(0, tokens)

    def make_linear(self, weight: torch.Tensor, dtype: Optional[torch.dtype] = None,
                    quantize: Optional[str] = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """y = x @ weight.T in this model's compute format (prepacked when oneDNN works here).

        `quantize="int4"`: group-wise int4 (round to nearest, groups of 32) on the w4a8 kernel
        (output fp32) where outrider's native kernels run, else on torch's packed int4 kernel when
        that is the fastest here (output bf16), else as without it. For a drafter's weights:
        a draft head's three matmuls per drafted token cost more in bf16 than the rest of drafting.
        """
        if quantize not in (None, "int4"):
            raise ValueError(f"make_linear: quantize must be None or 'int4', got {quantize!r}")
        if quantize == "int4" and self.device.type == "cpu" and weight.shape[1] % 32 == 0:
            # "auto+bf16": a drafter expanding many nodes at once also gets a dense bf16 copy
            # where that wins from a few rows on (the packed kernel's cost grows with rows, dense
            # bf16's barely; a draft head is small, so the copy is cheap).
            # Where outrider's native kernels run (every CPU they were built for), the drafter's
            # weights take w4a8: flat enough in rows that no copy is needed, faster than torch's
            # int4 kernel, and the same bits on every instruction set.
            target = self.kernel_plans.get("int4")
            plan = target if target is not None and target.kernel == "w4a8" else choose_kernel("int4", "w4a8", 32)
            if plan.kernel != "w4a8":
                plan = choose_kernel("int4", "auto+bf16", 32)
            if plan.kernel in ("int4pack", "w4a8"):
                from outrider.generation.weights import quantize_int4

                return plan.build(QuantTensor("int4", **quantize_int4(weight.float(), 32)))
        dtype = self.dtype if dtype is None else dtype
        onednn = self.uses_onednn if dtype == self.dtype else (self.device.type == "cpu" and onednn_works(dtype))
        return QuantizedLinear(weight.to(self.device, torch.float32), dtype, onednn)

    @torch.no_grad()
    def fingerprint(self) -> str:
        """sha256 (hex) of the shape, every 16th embedding row and the norm weights.

        Independent of the compute dtype and of weight quantization (embeddings and norms stay
        fp32 in every mode), so a draft head trained on the fp32 target also serves the others.
        """
        def host(tensor: torch.Tensor) -> np.ndarray:
            return tensor.detach().to("cpu", torch.float32).contiguous().numpy()

        rows = host(self.embed(torch.arange(0, self.vocab_size, FINGERPRINT_ROW_STRIDE)))
        norms = [host(w) for layer in self.layers for w in (layer.attn_norm, layer.mlp_norm)]
        return weights_fingerprint(self.config, self.vocab_size, self.hidden_size, rows, host(self.final_norm), norms)

    @torch.no_grad()
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float [n, hidden] (after the final norm) -> float32 [n, vocab] logits."""
        return self.head(hidden.to(self.device, self.dtype).contiguous()).float()  # no-ops in fp32

    # no_grad, not inference_mode: as fast here, and callers may edit the outputs in place
    # (inference tensors refuse that outside inference mode, e.g. `logits.div_(temperature)`).
    @torch.no_grad()
    def forward(self, cache: SlotKVCache, chunks: list[Chunk], only_last: bool = False,
                logit_rows: Optional[torch.Tensor] = None) -> ForwardOutput:
        """One pass over all chunks' tokens; appends their K/V tentatively (see `SlotKVCache.commit`).

        Beyond the contract: `only_last=True` returns logits for each chunk's last token only,
        [len(chunks), vocab]; `logit_rows` (indices into the fed tokens) returns logits for those
        rows only, in that order (a prefill needs one row, a tree all of its rows). Hidden states
        always cover every token. Chunks and `logit_rows` may hold numpy arrays (the engine's) or
        tensors (tools and tests driving the model directly).
        """
        chunks = [_torch_chunk(c) for c in chunks]
        if logit_rows is not None:
            logit_rows = torch.as_tensor(logit_rows, dtype=torch.long)
        runner = self.graph_runner
        if runner is not None and runner.cache is cache:
            out = runner.forward(chunks, only_last=only_last, logit_rows=logit_rows)
            if out is not None:  # None: a step the graphs do not cover, run eagerly below
                return out
        cfg = self.config
        plan, batch = self._plan(cache, chunks)
        spans = [(c.slot, c.end - c.start, c.end) for c in plan]
        if batch is not None:
            spans += [(slot, n, end) for slot, n, end in batch.spans]
        tokens = torch.cat([c.tokens for c in chunks]) if len(chunks) > 1 else chunks[0].tokens
        positions = torch.cat([c.positions for c in chunks]) if len(chunks) > 1 else chunks[0].positions
        tokens = tokens.to(self.device, torch.long)
        positions = positions.to(self.device, torch.long)
        if int(positions.max()) >= self._cos.shape[0]:
            self._rope_table(max(int(positions.max()) + 1, 2 * self._cos.shape[0]))
        cos = self._cos.index_select(0, positions)[:, None, :]
        sin = self._sin_signed.index_select(0, positions)[:, None, :]

        low = self.dtype if self.dtype != torch.float32 else None  # the matmul dtype (see decoder_layer)
        x = self.embed_weight.index_select(0, tokens)
        fast = self._fast_layers
        if self.native_attention:  # the native stack: every chunk of the step, none through SDPA
            fast = fast if isinstance(batch, _NativeChunks) and not plan else None
        else:  # the aten stack: one chunk
            fast = fast if batch is None and len(plan) == 1 and not plan[0].use_sdpa else None
        if fast is not None:
            fn, norms, packed, scales, minimums, group_size = fast
            if self.native_attention:
                where: tuple = (batch.chunks, batch.visible, 0, 0, None)
            else:
                where = (_CAUSAL, _CAUSAL, plan[0].slot, plan[0].length, plan[0].mask)
            fn(x, cos, sin, cache.kv, *where, norms, packed, scales, minimums, group_size,
               cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
        else:
            for li, layer in enumerate(self.layers):
                x = decoder_layer(cfg, layer, x, cos, sin,
                                  lambda qkv, kv=cache.kv[li]: self._attend(kv, qkv, plan, batch), low)
        hidden = F.rms_norm(x, (cfg.hidden_size,), self.final_norm, cfg.rms_norm_eps)
        for slot, n, _ in spans:
            cache._fed[slot] = n
        if logit_rows is not None:
            rows = hidden.index_select(0, logit_rows.to(self.device))
        elif only_last:
            last = torch.tensor(sorted(end - 1 for _, _, end in spans), device=self.device)
            rows = hidden.index_select(0, last)
        else:
            rows = hidden
        logits = self.head(rows if low is None else rows.to(low))
        return ForwardOutput(logits=logits.float(), hidden=hidden)

    # ---- helpers -------------------------------------------------------------------------

    def _attend(
        self, kv: torch.Tensor, qkv: torch.Tensor, plan: list[_ChunkPlan],
        batch: "_BatchPlan | _NativeChunks | None",
    ) -> torch.Tensor:
        """Attention output [T, heads * head_dim] for one layer; writes the fed K/V into `kv` first.

        kv: this layer's cache [2, slots, kv_heads, max_len, head_dim]; qkv: [T, q | k | v] after RoPE.
        """
        cfg = self.config
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_width = nh * d
        total = qkv.shape[0]
        attn = None
        if isinstance(batch, _NativeChunks):
            attn = torch.ops.outrider.attend(qkv, kv, batch.chunks, batch.visible, nh, nkv)
            if not plan:
                return attn
        elif batch is not None:
            out = self._attend_batch(kv, qkv, batch)
            if batch.rows is None:
                return out
            attn = qkv.new_empty(total, q_width)
            attn.index_copy_(0, batch.rows, out)
        for c in plan:
            n, start, end, length = c.end - c.start, c.start, c.end, c.length
            cell = kv[:, c.slot]  # [2, nkv, max_len, d]
            if c.use_sdpa:
                cell[:, :, length : length + n] = qkv[start:end, q_width:].view(n, 2, nkv, d).permute(1, 2, 0, 3)
                keys, values = cell[0, :, : length + n], cell[1, :, : length + n]
                out = F.scaled_dot_product_attention(
                    qkv[start:end, :q_width].view(n, nh, d).transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
                    values.unsqueeze(0), attn_mask=c.mask, is_causal=c.mask is None, scale=1.0, enable_gqa=True,
                )
                out = out[0].transpose(0, 1).reshape(n, q_width)
            else:
                out = _attend_chunk(qkv[start:end], cell, length, c.mask, nh, nkv, d)
            if attn is None:
                if len(plan) == 1:
                    return out
                attn = qkv.new_empty(total, q_width)
            attn[start:end] = out
        return attn

    def _attend_batch(self, kv: torch.Tensor, qkv: torch.Tensor, b: _BatchPlan) -> torch.Tensor:
        cfg = self.config
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group, q_width = nh // nkv, nh * d
        rows = qkv if b.rows is None else qkv.index_select(0, b.rows)
        # K/V of every row to its (slot, position) cell in one scatter.
        kv.permute(1, 3, 0, 2, 4)[b.write_slot, b.write_pos] = rows[:, q_width:].view(-1, 2, nkv, d)
        padded = rows.new_zeros(b.count * b.width, q_width)
        padded.index_copy_(0, b.where, rows[:, :q_width])
        q = padded.view(b.count, b.width, nkv, group, d).permute(0, 2, 3, 1, 4)
        q = q.reshape(b.count * nkv, group * b.width, d)
        # A range of slots is one strided view: [count * nkv, span, d], nothing copied.
        keys = kv[0, b.first : b.first + b.count, :, : b.span].reshape(b.count * nkv, b.span, d)
        values = kv[1, b.first : b.first + b.count, :, : b.span].reshape(b.count * nkv, b.span, d)
        scores = torch.bmm(q, keys.transpose(1, 2)).view(b.count, nkv, group * b.width, b.span).add_(b.mask)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs.view(b.count * nkv, group * b.width, b.span), values)
        out = out.view(b.count, nkv, group, b.width, d).permute(0, 3, 1, 2, 4).reshape(b.count * b.width, q_width)
        return out.index_select(0, b.where)

    def _plan(self, cache: SlotKVCache, chunks: list[Chunk]) -> tuple[list[_ChunkPlan], Optional[_BatchPlan]]:
        """Checks the chunks; plans which attend alone and which together (`_BatchPlan`)."""
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        seen, start, parsed = set(), 0, []
        for c in chunks:
            slot = c.slot
            if not 0 <= slot < cache.num_slots:
                raise ValueError(f"slot {slot} out of range (cache has {cache.num_slots})")
            if slot in seen:
                raise ValueError(f"slot {slot} appears in two chunks of one forward")
            seen.add(slot)
            n = c.tokens.numel()
            if n == 0 or c.tokens.dim() != 1 or c.positions.shape != c.tokens.shape:
                raise ValueError(f"chunk for slot {slot}: tokens and positions must be equal-length 1-D, n >= 1")
            length = cache.length(slot)
            if length + n <= cache.max_length:
                cache.reserve(slot, length + n)  # the cache grows with what is admitted
            else:
                raise ValueError(
                    f"slot {slot}: {length} committed + {n} fed tokens exceed max_length {cache.max_length}"
                )
            tree = c.tree_mask
            if tree is not None and tuple(tree.shape) != (n, n):
                raise ValueError(f"chunk for slot {slot}: tree_mask must be [{n}, {n}], got {tuple(tree.shape)}")
            parsed.append((slot, start, start + n, length, tree))
            start += n
        if self.native_attention:  # every chunk attends in one native call per layer
            return [], self._native_chunks(parsed, total=start)
        small = [p for p in parsed if p[2] - p[1] <= BATCH_MAX_TOKENS]
        batch = None
        if self.batch_attention and len(small) >= 2 and self._batch_is_cheaper(small):
            batch = self._batch_plan(small, total=start)
            batched = {p[0] for p in small}
            parsed = [p for p in parsed if p[0] not in batched]
        return [self._chunk_plan(*p) for p in parsed], batch

    def _native_chunks(self, small: list[tuple], total: int) -> _NativeChunks:
        chunks = torch.tensor([[slot, start, end - start, length] for slot, start, end, length, _ in small],
                              dtype=torch.long)
        if all(tree is None for *_, tree in small):
            visible = _CAUSAL
        else:
            visible = torch.zeros(total, max(end - start for _, start, end, _, _ in small), dtype=torch.bool)
            for _, start, end, _, tree in small:
                visible[start:end, : end - start] = _block(tree, end - start, torch.device("cpu"))
        return _NativeChunks(chunks, visible, [(slot, end - start, end) for slot, start, end, _, _ in small])

    def _chunk_plan(self, slot: int, start: int, end: int, length: int, tree: Optional[torch.Tensor]) -> _ChunkPlan:
        n, dev = end - start, self.device
        group = self.config.num_heads // self.config.num_kv_heads
        if n == 1:
            mask = None  # one token sees every committed token and itself
        elif n >= SDPA_MIN_TOKENS:
            if tree is None and length == 0:
                mask = None  # SDPA's is_causal (top-left aligned: right only when nothing is committed)
            else:
                mask = torch.ones(n, length + n, dtype=torch.bool, device=dev)
                mask[:, length:] = _block(tree, n, dev)
        else:
            mask = torch.zeros(group * n, length + n, device=dev)
            block = torch.zeros(n, n, device=dev).masked_fill_(~_block(tree, n, dev), -math.inf)
            mask[:, length:] = block.repeat(group, 1)
        return _ChunkPlan(slot, start, end, length, mask, n >= SDPA_MIN_TOKENS)

    def _batch_is_cheaper(self, small: list[tuple]) -> bool:
        """Rough cost model (microseconds per layer): padded batch vs one attention call per chunk."""
        cfg = self.config
        token_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
        flops_per_pair = 4 * cfg.num_heads * cfg.head_dim  # one query x one key: scores + weighted V
        count = max(p[0] for p in small) - min(p[0] for p in small) + 1
        width = max(p[2] - p[1] for p in small)
        span = max(p[3] + p[2] - p[1] for p in small)
        batched = BATCH_FIXED_US + count * span * (token_bytes / BYTES_PER_US + width * flops_per_pair / FLOPS_PER_US)
        alone = 0.0
        for _, start, end, length, _ in small:
            n = end - start
            alone += CHUNK_FIXED_US + (length + n) * (token_bytes / BYTES_PER_US + n * flops_per_pair / FLOPS_PER_US)
        return batched < alone

    def _batch_plan(self, small: list[tuple], total: int) -> _BatchPlan:
        dev = self.device
        group = self.config.num_heads // self.config.num_kv_heads
        b = _BatchPlan()
        b.first = min(p[0] for p in small)
        b.count = max(p[0] for p in small) - b.first + 1
        b.width = max(p[2] - p[1] for p in small)
        b.span = max(p[3] + p[2] - p[1] for p in small)
        b.spans = [(slot, end - start, end) for slot, start, end, _, _ in small]
        rows, where, write_slot, write_pos = [], [], [], []
        # Rows of absent slots and padding see only position 0: finite, and ignored.
        mask = torch.full((b.count, b.width, b.span), -math.inf, device=dev)
        mask[:, :, 0] = 0
        for slot, start, end, length, tree in small:
            n, r = end - start, slot - b.first
            rows.extend(range(start, end))
            where.extend(range(r * b.width, r * b.width + n))
            write_slot.extend([slot] * n)
            write_pos.extend(range(length, length + n))
            mask[r, :n] = -math.inf
            mask[r, :n, :length] = 0
            mask[r, :n, length : length + n].masked_fill_(_block(tree, n, dev), 0)
        b.rows = None if rows == list(range(total)) else torch.tensor(rows, device=dev)
        b.where = torch.tensor(where, device=dev)
        b.write_slot = torch.tensor(write_slot, device=dev)
        b.write_pos = torch.tensor(write_pos, device=dev)
        # [count, 1 (kv heads), group * width, span]: query rows are (group member, chunk index).
        b.mask = mask.repeat(1, group, 1).unsqueeze(1)
        return b


def _torch_chunk(chunk: Chunk) -> Chunk:
    """`chunk` with tensors (torch.from_numpy shares the engine's arrays: no copy)."""
    def tensor(value: Any, dtype: torch.dtype) -> Any:
        return torch.from_numpy(value).to(dtype) if isinstance(value, np.ndarray) else value

    if not any(isinstance(v, np.ndarray) for v in (chunk.tokens, chunk.positions, chunk.tree_mask)):
        return chunk
    return Chunk(chunk.slot, tensor(chunk.tokens, torch.long), tensor(chunk.positions, torch.long),
                 tensor(chunk.tree_mask, torch.bool))


def _quant_modes(sd: dict[str, torch.Tensor]) -> list[str]:
    """The quantized formats ("int4", "int8") the state dict holds linear weights in."""
    return [m for m in ("int4", "int8") if any(k.endswith(f".{m}.q") for k in sd)]


def _kernel_for(mode: str, kernel: str) -> str:
    """A kernel name asked for one format, carried over to the other ("int4pack+bf16" -> "int8pack+bf16")."""
    other = "int8pack" if mode == "int4" else "int4pack"
    return kernel.replace(other, f"{mode}pack") if kernel.startswith(other) else kernel


def _group_size(sd: dict[str, torch.Tensor]) -> int:
    """Input columns per int4 group (32 where there are no int4 weights)."""
    for key, q in sd.items():
        if key.endswith(".int4.q"):
            return 2 * q.shape[1] // sd[key[: -len(".q")] + ".scale"].shape[1]
    return 32


_CAUSAL = torch.empty(0, dtype=torch.bool)  # `outrider::attend`'s "causal in every chunk"


def _block(tree: Optional[torch.Tensor], n: int, device: torch.device) -> torch.Tensor:
    """bool [n, n]: which fed tokens each fed token sees (causal when there is no tree)."""
    if tree is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return tree.to(device, torch.bool)
