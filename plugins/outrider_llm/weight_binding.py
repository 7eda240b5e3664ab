"""A Llama state dict's weights bound to the torch kernels one device and compute format run.

Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...), dense or quantized (`N.int4.*`,
`N.int8.*`, or a GGUF file's own blocks as `N.affine.*`; format in linear.py): `compute_format`
picks the kernels and the compute dtype, `bind_weights` builds the layers, embeddings and head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .config import LlamaConfig
from .decoder_layer import LayerWeights
from .kernel_choice import KernelPlan, choose_kernel
from .linear import (ConcatLinear, QuantizedLinear, TiedRows, W8A8Linear, affine_linear, cpu_has_native_bf16,
                     dense_linear)
from .quantized_weights import AffineTable, Int8BlockTable, QuantTensor


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


def compute_format(state_dict: dict[str, torch.Tensor], dtype: "str | torch.dtype | None", device: torch.device,
                   kernel: str) -> tuple[dict[str, KernelPlan], torch.dtype]:
    """(one kernel plan per quantized format present, the compute dtype) for `state_dict` on
    `device`; `kernel` (see `choose_kernel`) picks the quantized kernels, `dtype` applies to a
    model without quantized weights."""
    # One plan per quantized format present (int4 layers usually come with an int8 LM head).
    kernel_plans: dict[str, KernelPlan] = {}
    for mode in _quant_modes(state_dict):
        if device.type == "cpu":
            kernel_plans[mode] = choose_kernel(mode, _kernel_for(mode, kernel), _group_size(state_dict))
        else:  # the packed kernels are CPU-only: dequantize
            kernel_plans[mode] = KernelPlan(mode, "dense", resolve_dtype(dtype, device), reason="not a CPU")
    if any(k.endswith(".affine.q") for k in state_dict):
        # A GGUF file's own blocks: the native kernels take fp32 rows (and quantize them).
        return kernel_plans, torch.float32
    if kernel_plans:
        # bf16 as soon as one kernel takes bf16: every projection's output is then cast back to
        # fp32 (a dense fp32 kernel converts its bf16 input itself).
        # w4a8 layers read fp32 (they quantize it themselves): then fp32, and another format's
        # kernel (an int8 head) converts its own input.
        dtypes = {plan.dtype for plan in kernel_plans.values()}
        if any(plan.kernel == "w4a8" for plan in kernel_plans.values()):
            return kernel_plans, torch.float32
        return kernel_plans, torch.bfloat16 if torch.bfloat16 in dtypes else dtypes.pop()
    return kernel_plans, resolve_dtype(dtype, device)


@dataclass
class BoundWeights:
    """What a step reads: the layers, the final norm, the embedding rows, the LM head (x -> logits)
    and, where the head is not tied, its fp32 rows (for `lm_head_rows`)."""

    layers: list[LayerWeights]
    final_norm: torch.Tensor
    embed_weight: Any  # fp32 tensor, Int8BlockTable, AffineTable or TiedRows: each has index_select
    head: Callable[[torch.Tensor], torch.Tensor]
    head_weight: Optional[Any]


def bind_weights(config: LlamaConfig, sd: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 onednn: bool, kernel_plans: dict[str, KernelPlan]) -> BoundWeights:
    """The weights of `sd` bound to kernels of `dtype` on `device` (quantized ones by `kernel_plans`)."""
    cfg, dt = config, dtype
    scale = cfg.head_dim**-0.5

    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise KeyError(f"missing weight {name!r}")
        return sd[name].to(device, torch.float32)

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
            if device.type == "cpu":
                return affine_linear(weight)
            return dense_linear(weight.dequantize(), dtype, device)
        return kernel_plans[weight.mode].build(weight, device)

    def linear(*parts: "torch.Tensor | QuantTensor"):
        # Fused projections concatenate along out-features where all parts share a format;
        # a GGUF file's mixed block types (Q4_K q/k, Q6_K v) run side by side; a partly
        # quantized state dict runs dense from its fp32 values.
        if all(isinstance(p, QuantTensor) for p in parts):
            if len({p.format() for p in parts}) > 1:
                return ConcatLinear([quant_linear(p) for p in parts])
            return quant_linear(parts[0] if len(parts) == 1 else QuantTensor.cat(list(parts)))
        dense = [p.dequantize().to(device) if isinstance(p, QuantTensor) else p for p in parts]
        return QuantizedLinear(dense[0] if len(dense) == 1 else torch.cat(dense), dt, onednn)

    layers: list[LayerWeights] = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = LayerWeights()
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
        layers.append(layer)
    final_norm = own(get("model.norm.weight"))
    embed_quant = QuantTensor.from_state_dict(sd, "model.embed_tokens.weight")
    if embed_quant is not None and embed_quant.mode == "affine":
        # The file's own blocks serve lookups (rows dequantized as asked) and the tied head.
        embed_weight, head, head_weight = _affine_embeddings(
            config, device, dtype, onednn, embed_quant, QuantTensor.from_state_dict(sd, "lm_head.weight"), linear, get)
        return BoundWeights(layers, final_norm, embed_weight, head, head_weight)
    # Embedding lookups read a few rows: keep them fp32 whatever the compute dtype.
    embed_weight = own(get("model.embed_tokens.weight"))
    # The GGUF's Q8_0 table, dequantized, is exactly int8 blocks times a scale: the compact
    # form serves lookups, and a w4a8 model's tied head reads the same values.
    compact = Int8BlockTable.exact(embed_weight) if device.type == "cpu" else None
    head_quant = QuantTensor.from_state_dict(sd, "lm_head.weight")
    if cfg.tie_word_embeddings:
        head_weight = None
        # A tied head may still be stored quantized (under lm_head.weight.*): the embedding
        # stays fp32 for lookups and the fingerprint, the head reads the quantized copy.
        if head_quant is not None:
            head = linear(head_quant)
        elif _w4a8_head_fits(config, device, kernel_plans):
            head = _w8a8_head(embed_weight, compact)
        else:
            head = QuantizedLinear(embed_weight, dt, onednn)
    elif head_quant is not None:
        # lm_head_rows needs fp32 rows: keep the dequantized weight (exactly what the kernel computes with)
        head_weight = head_quant.dequantize().to(device)
        head = linear(head_quant)
    else:
        head_weight = own(get("lm_head.weight"))
        head = QuantizedLinear(head_weight, dt, onednn)
    # The head is built (it packed its own copy): lookups may now read the compact form.
    if compact is not None:
        embed_weight = compact
    return BoundWeights(layers, final_norm, embed_weight, head, head_weight)


def _affine_embeddings(config: LlamaConfig, device: torch.device, dtype: torch.dtype, onednn: bool,
                       embed: QuantTensor, head: Optional[QuantTensor], linear: Callable,
                       get: Callable) -> tuple[Any, Callable, Optional[Any]]:
    """(embedding rows, head, head rows) from a GGUF file's own blocks: no fp32 copy of either, and
    for a tied head one copy of the table, the head's tiles, that lookups read rows from."""
    if config.tie_word_embeddings:
        head_weight = None
        head_kernel = linear(head if head is not None else embed)
        embed_weight = _rows_of(device, embed, head_kernel if head is None else None)
    else:
        embed_weight = _rows_of(device, embed)
        if head is not None:
            head_kernel = linear(head)
            head_weight = _rows_of(device, head, head_kernel)  # a draft head's rows
        else:
            head_weight = get("lm_head.weight").clone()
            head_kernel = QuantizedLinear(head_weight, dtype, onednn)
    return embed_weight, head_kernel, head_weight


def _rows_of(device: torch.device, weight: QuantTensor,
             kernel: Optional[Callable] = None) -> "torch.Tensor | AffineTable | TiedRows":
    """What row lookups of `weight` read: `kernel`'s own tiles when it is a native kernel of
    that same weight (no second copy), else the file's groups, else (not a CPU) fp32."""
    if device.type != "cpu":
        return weight.dequantize().to(device)
    if kernel is not None and kernel.kernel in ("w4a8", "w5a8", "w8a8"):
        return TiedRows(kernel, weight.shape)
    return AffineTable(weight) if weight.mode == "affine" else weight.dequantize()


def _w4a8_head_fits(config: LlamaConfig, device: torch.device, kernel_plans: dict[str, KernelPlan]) -> bool:
    """Whether an unquantized head joins "w4a8" layers as block-wise int8 (W8A8Linear)."""
    plan = kernel_plans.get("int4")
    return (plan is not None and plan.kernel == "w4a8" and device.type == "cpu"
            and W8A8Linear.usable(config.vocab_size, config.hidden_size))


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
