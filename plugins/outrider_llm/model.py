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
and checked at load by `kernel_choice.choose_kernel`; embeddings and norms stay fp32 in every mode.
Runs under `torch.no_grad()`. Built for CPU; on CUDA the linears are plain `F.linear` in fp16 or
bf16 (quantized weights dequantized to dense), the KV cache is static, and decode and verify steps
replay CUDA graphs (`cuda_graphs.py`, attached with `cuda_graphs.use_cuda_graphs`).

Its parts: what a layer computes (`decoder_layer.py`), how a step's chunks attend (`attention.py`),
the fused int4 layer stacks (`fused_layers.py`), the weights bound to kernels (`weight_binding.py`)
and the slot KV cache (`kv_cache.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from outrider.generation.contract import Chunk, ForwardOutput

from .attention import StepAttention, native_attention_usable
from .config import FINGERPRINT_ROW_STRIDE, LlamaConfig, rope_tables, weights_fingerprint
from .decoder_layer import decoder_layer
from .fused_layers import FusedLayerStack
from .kv_cache import SlotKVCache
from .kernel_choice import choose_kernel
from .linear import QuantizedLinear, onednn_works
from .quantized_weights import QuantTensor
from .weight_binding import bind_weights, compute_format

ROPE_ROWS_AT_START = 2048  # positions the RoPE tables hold before a longer sequence grows them


class LlamaModel(torch.nn.Module):
    """Llama decoder implementing `CausalLM` (see contract.py) for CPU inference."""

    array_api = "torch"  # its drafters' interface takes and returns torch tensors on `device`

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
        self.kernel_plans, self.dtype = compute_format(state_dict, dtype, self.device, kernel)
        if use_onednn is None:
            use_onednn = self.device.type == "cpu" and onednn_works(self.dtype)
        self.uses_onednn = bool(use_onednn)
        self.batch_attention = True  # let small chunks attend together when cheaper (see StepAttention.plan)
        self.graph_runner = None  # CUDA graphs for decode/verify steps (cuda_graphs.use_cuda_graphs)
        if config.num_heads % config.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        bound = bind_weights(config, state_dict, self.device, self.dtype, self.uses_onednn, self.kernel_plans)
        self.layers, self.final_norm = bound.layers, bound.final_norm
        self.embed_weight, self.head, self.head_weight = bound.embed_weight, bound.head, bound.head_weight
        # Grown on demand (forward): a Llama 3 file's 131,072 positions would be 134 MB up front.
        self._rope_table(min(config.max_position_embeddings, ROPE_ROWS_AT_START))
        self.native_attention = native_attention_usable(config, self.device, self.layers)
        self.attention = StepAttention(config, self.device, self.native_attention)
        self._fast_layers = FusedLayerStack.for_layers(config, self.device, self.layers, self.native_attention)

    def weight_bytes(self) -> int:
        """Bytes held by the matmul kernels (embeddings and norms not counted)."""
        kernels = [self.head] + [k for layer in self.layers for k in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(k.nbytes for k in kernels)

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
        plan, batch = self.attention.plan(cache, chunks, self.batch_attention)
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
        if fast is not None and fast.covers(plan, batch):
            fast.run(cfg, x, cos, sin, cache.kv, plan, batch)
        else:
            for li, layer in enumerate(self.layers):
                x = decoder_layer(cfg, layer, x, cos, sin,
                                  lambda qkv, kv=cache.kv[li]: self.attention.attend(kv, qkv, plan, batch), low)
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


def _torch_chunk(chunk: Chunk) -> Chunk:
    """`chunk` with tensors (torch.from_numpy shares the engine's arrays: no copy)."""
    def tensor(value: Any, dtype: torch.dtype) -> Any:
        return torch.from_numpy(value).to(dtype) if isinstance(value, np.ndarray) else value

    if not any(isinstance(v, np.ndarray) for v in (chunk.tokens, chunk.positions, chunk.tree_mask)):
        return chunk
    return Chunk(chunk.slot, tensor(chunk.tokens, torch.long), tensor(chunk.positions, torch.long),
                 tensor(chunk.tree_mask, torch.bool))

