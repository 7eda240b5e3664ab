"""How a step's chunks attend to their slots' KV cache, planned once per step, run per layer.

Attention is per chunk against its own slot's cache, except that small chunks (decode tokens,
draft trees) of several sequences attend together in one padded call when a rough cost model
says the saved per-call overhead beats the padding (8 decode sequences: 29 -> 24 ms a step).
Where the layers run outrider's native kernels, every chunk attends in one `outrider::attend` call
per layer instead (`native_attention_usable`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from outrider.generation.contract import Chunk

from .config import LlamaConfig
from .decoder_layer import LayerWeights
from .kv_cache import SlotKVCache
from .linear import NATIVE_KERNELS

# Chunks longer than this attend through SDPA (flash kernel, no [n, L] score matrix in memory);
# shorter ones through two batched matmuls, faster for decode and verification.
SDPA_MIN_TOKENS = 128
# Chunks of up to this many tokens may attend together, padded, over a range of slots, when the
# rough cost model below says that beats one call per chunk (python + dispatch cost, ~40 us
# per chunk and layer on the dev machine) despite the padding and unused slots it reads.
BATCH_MAX_TOKENS = 64
CHUNK_FIXED_US, BATCH_FIXED_US = 40.0, 80.0
BYTES_PER_US, FLOPS_PER_US = 30e3, 1e5  # ~30 GB/s and ~100 GFLOP/s on 2 cores


def attend_chunk(qkv: torch.Tensor, cell: torch.Tensor, length: int, mask: Optional[torch.Tensor], num_heads: int,
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


#: `outrider::attend`'s "causal in every chunk"
CAUSAL = torch.empty(0, dtype=torch.bool)


def visible_block(tree: Optional[torch.Tensor], n: int, device: torch.device) -> torch.Tensor:
    """bool [n, n]: which fed tokens each fed token sees (causal when there is no tree)."""
    if tree is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return tree.to(device, torch.bool)


def native_attention_usable(config: LlamaConfig, device: torch.device, layers: list[LayerWeights]) -> bool:
    """Attention through `outrider::attend` (see csrc/ops.cpp) where the layers run outrider's
    native int4 kernels (the extension is loaded then), so that a draft tree's rows get exactly
    the logits a one-token step gets (the int8 or bf16 activations downstream would turn
    torch attention's last-bit differences into rounding steps)."""
    linears = [k for layer in layers for k in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return (device.type == "cpu" and bool(linears) and config.head_dim in (16, 32, 64, 128)
            and all(k.kernel in NATIVE_KERNELS for k in linears))


class ChunkPlan:
    """One chunk attending on its own: rows start:end of the step, its slot and mask."""

    __slots__ = ("slot", "start", "end", "length", "mask", "use_sdpa")

    def __init__(self, slot: int, start: int, end: int, length: int, mask, use_sdpa: bool) -> None:
        self.slot, self.start, self.end, self.length = slot, start, end, length
        self.mask, self.use_sdpa = mask, use_sdpa


class BatchPlan:
    """Several small chunks attending together over slots first..first+count-1 (padded queries).

    rows: their rows in the step (None: all of them, in order); where: scatter index [rows] ->
    padded row (slot - first) * width + i; write_slot/write_pos: cache cell of each row;
    mask: additive [count, 1, group * width, span].
    """

    __slots__ = ("rows", "first", "count", "width", "span", "where", "write_slot", "write_pos", "mask", "spans")


class NativeChunks:
    """The chunks of a step that `outrider::attend` serves, all in one call per layer.

    chunks: int64 [C, 4] (slot, first row, rows, committed length); visible: bool [T, W], row t
    sees fed token c of its chunk (an empty tensor: causal everywhere); spans as `BatchPlan`'s.
    """

    __slots__ = ("chunks", "visible", "spans")

    def __init__(self, chunks: torch.Tensor, visible: torch.Tensor, spans: list[tuple[int, int, int]]) -> None:
        self.chunks, self.visible, self.spans = chunks, visible, spans


class StepAttention:
    """Plans which of a step's chunks attend alone, which together (`BatchPlan`) or natively
    (`NativeChunks`), and runs that plan in every layer."""

    def __init__(self, config: LlamaConfig, device: torch.device, native: bool) -> None:
        self.config, self.device, self.native = config, device, native

    def plan(self, cache: SlotKVCache, chunks: list[Chunk],
             may_batch: bool) -> "tuple[list[ChunkPlan], BatchPlan | NativeChunks | None]":
        """Checks the chunks; plans which attend alone and which together (`BatchPlan`, where
        `may_batch` lets small chunks attend together when cheaper)."""
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
        if self.native:  # every chunk attends in one native call per layer
            return [], self._native_chunks(parsed, total=start)
        small = [p for p in parsed if p[2] - p[1] <= BATCH_MAX_TOKENS]
        batch = None
        if may_batch and len(small) >= 2 and self._batch_is_cheaper(small):
            batch = self._batch_plan(small, total=start)
            batched = {p[0] for p in small}
            parsed = [p for p in parsed if p[0] not in batched]
        return [self._chunk_plan(*p) for p in parsed], batch

    def attend(
        self, kv: torch.Tensor, qkv: torch.Tensor, plan: list[ChunkPlan],
        batch: "BatchPlan | NativeChunks | None",
    ) -> torch.Tensor:
        """Attention output [T, heads * head_dim] for one layer; writes the fed K/V into `kv` first.

        kv: this layer's cache [2, slots, kv_heads, max_len, head_dim]; qkv: [T, q | k | v] after RoPE.
        """
        cfg = self.config
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_width = nh * d
        total = qkv.shape[0]
        attn = None
        if isinstance(batch, NativeChunks):
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
                out = attend_chunk(qkv[start:end], cell, length, c.mask, nh, nkv, d)
            if attn is None:
                if len(plan) == 1:
                    return out
                attn = qkv.new_empty(total, q_width)
            attn[start:end] = out
        return attn

    def _attend_batch(self, kv: torch.Tensor, qkv: torch.Tensor, b: BatchPlan) -> torch.Tensor:
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

    def _native_chunks(self, small: list[tuple], total: int) -> NativeChunks:
        chunks = torch.tensor([[slot, start, end - start, length] for slot, start, end, length, _ in small],
                              dtype=torch.long)
        if all(tree is None for *_, tree in small):
            visible = CAUSAL
        else:
            visible = torch.zeros(total, max(end - start for _, start, end, _, _ in small), dtype=torch.bool)
            for _, start, end, _, tree in small:
                visible[start:end, : end - start] = visible_block(tree, end - start, torch.device("cpu"))
        return NativeChunks(chunks, visible, [(slot, end - start, end) for slot, start, end, _, _ in small])

    def _chunk_plan(self, slot: int, start: int, end: int, length: int, tree: Optional[torch.Tensor]) -> ChunkPlan:
        n, dev = end - start, self.device
        group = self.config.num_heads // self.config.num_kv_heads
        if n == 1:
            mask = None  # one token sees every committed token and itself
        elif n >= SDPA_MIN_TOKENS:
            if tree is None and length == 0:
                mask = None  # SDPA's is_causal (top-left aligned: right only when nothing is committed)
            else:
                mask = torch.ones(n, length + n, dtype=torch.bool, device=dev)
                mask[:, length:] = visible_block(tree, n, dev)
        else:
            mask = torch.zeros(group * n, length + n, device=dev)
            block = torch.zeros(n, n, device=dev).masked_fill_(~visible_block(tree, n, dev), -math.inf)
            mask[:, length:] = block.repeat(group, 1)
        return ChunkPlan(slot, start, end, length, mask, n >= SDPA_MIN_TOKENS)

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

    def _batch_plan(self, small: list[tuple], total: int) -> BatchPlan:
        dev = self.device
        group = self.config.num_heads // self.config.num_kv_heads
        b = BatchPlan()
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
            mask[r, :n, length : length + n].masked_fill_(visible_block(tree, n, dev), 0)
        b.rows = None if rows == list(range(total)) else torch.tensor(rows, device=dev)
        b.where = torch.tensor(where, device=dev)
        b.write_slot = torch.tensor(write_slot, device=dev)
        b.write_pos = torch.tensor(write_pos, device=dev)
        # [count, 1 (kv heads), group * width, span]: query rows are (group member, chunk index).
        b.mask = mask.repeat(1, group, 1).unsqueeze(1)
        return b
