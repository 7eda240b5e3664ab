"""CUDA graphs for the LLM engine's decode and verify steps.

A decode or draft-verify step feeds a handful of tokens per sequence, so on a GPU it is bound by
launching ~25 small kernels per layer, not by arithmetic. Captured once and replayed, the step is
one launch. A graph fixes every shape and every address, so a step is laid out to fit one:

- Rows, padded and slot-major: row s * W + i holds fed token i of slot s's chunk, for slots
  0..S-1. W (the width bucket) is the smallest of `WIDTH_BUCKETS` that holds the longest chunk
  (1 for plain decode, 1 + draft tokens for a verify step), S the smallest power of two above the
  highest slot fed (capped at the cache's slots), and attention reads positions 0..span-1 of each
  slot, span the smallest `SPAN_STEP` * 2^k (capped at max_length) covering every slot's committed
  plus fed tokens. One graph per (S, W, span), captured the first time a step needs it.
- Inputs are static device buffers (token ids, positions, where each row writes its K/V, every
  slot's committed length, and which fed tokens each fed token sees), refilled from pinned host
  memory before each replay. The additive attention mask is built inside the graph from them.
- The KV cache is static (`SlotKVCache(static=True)`): K/V are written in place at (slot,
  length + i); padded rows write theirs to the spare position `max_length`, which no step reads,
  and see only their own column, so they stay finite and touch nothing real.
- Graphs share one memory pool. That is safe because a replay's inputs are written just before
  it and its outputs read just after it, on the same stream, before any other replay.

Steps a graph cannot hold (a chunk wider than the largest bucket: a long prefill) run the eager
forward. Everything but the capture is plain torch: `capture=False` runs the same padded forward
eagerly on any device, which is how the CPU tests check it against the eager forward.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from outrider.generation.contract import Chunk, ForwardOutput

from .decoder_layer import decoder_layer

log = logging.getLogger("outrider.llm")

def use_cuda_graphs(model: Any, cache: Any, **options: Any) -> "CudaGraphRunner":
    """Replay CUDA graphs for the decode and verify steps `model` (a LlamaModel) runs on `cache` (a
    static SlotKVCache). Steps the graphs do not cover (prefill, chunks wider than the largest
    bucket) stay eager. Returns the runner, also set as `model.graph_runner`; options go to it
    (`capture=False` runs the same padded forward without graphs, on any device)."""
    model.graph_runner = CudaGraphRunner(model, cache, **options)
    return model.graph_runner


# Draft trees of the speculative strategy feed 1 + up to 16 tokens per sequence by default; the
# steps between powers of two keep the padding of a 17- or 25-token tree under a third.
WIDTH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
SPAN_STEP = 256
# Graphs beyond this many (keys never seen in warmup) run eagerly rather than capture more.
MAX_GRAPHS = 64


# ---- bucket choice and layout: pure, tested on CPU --------------------------------------------


def width_bucket(longest: int, widths: Sequence[int] = WIDTH_BUCKETS) -> Optional[int]:
    """The smallest width in `widths` holding a chunk of `longest` tokens (None: none does)."""
    return next((w for w in sorted(widths) if w >= longest), None)


def slot_bucket(highest_slot: int, num_slots: int) -> int:
    """Slots 0..S-1 a step covers: the smallest power of two above `highest_slot`, at most `num_slots`."""
    return min(num_slots, 1 << max(0, highest_slot).bit_length())


def span_bucket(needed: int, max_length: int, step: int = SPAN_STEP) -> int:
    """Key positions a step attends over: `step` * 2^k covering `needed`, at most `max_length`."""
    span = step
    while span < needed:
        span *= 2
    return min(span, max_length)


@dataclass
class StepLayout:
    """One step laid out for a graph: its key (slots, width, span) and the host-side inputs."""

    slots: int
    width: int
    span: int
    ints: torch.Tensor  # int64 [3 * S * W + S]: tokens | positions | K/V write positions | lengths
    visible: torch.Tensor  # bool [S, W, W]: fed token i of slot s sees fed token j
    rows: list[int] = field(default_factory=list)  # padded row of each fed token, in chunk order
    fed: list[tuple[int, int]] = field(default_factory=list)  # (slot, tokens fed) per chunk

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.slots, self.width, self.span)

    def last_rows(self) -> list[int]:
        """Indices (into the fed tokens) of each chunk's last token, in chunk order."""
        out, offset = [], 0
        for _, n in self.fed:
            offset += n
            out.append(offset - 1)
        return out


def padding_layout(slots: int, width: int, span: int, max_length: int) -> StepLayout:
    """A step of padded rows only: every row writes the spare position and sees its own column."""
    n = slots * width
    ints = torch.zeros(3 * n + slots, dtype=torch.long)
    ints[2 * n : 3 * n] = max_length
    visible = torch.eye(width, dtype=torch.bool).expand(slots, width, width).clone()
    return StepLayout(slots, width, span, ints, visible)


def plan_step(chunks: Sequence[Chunk], lengths: Sequence[int], num_slots: int, max_length: int,
              widths: Sequence[int] = WIDTH_BUCKETS) -> Optional[StepLayout]:
    """The padded layout of one step, or None where a graph cannot hold it (the eager forward then
    runs it, and raises for chunks that are wrong).

    `lengths[slot]` is the committed length of each slot.
    """
    if not chunks:
        return None
    seen: set[int] = set()
    longest, highest, needed = 0, 0, 0
    for c in chunks:
        n = c.tokens.numel()
        if not 0 <= c.slot < num_slots or c.slot in seen or n == 0 or c.tokens.dim() != 1 \
                or c.positions.shape != c.tokens.shape:
            return None
        if c.tree_mask is not None and tuple(c.tree_mask.shape) != (n, n):
            return None
        if lengths[c.slot] + n > max_length:
            return None
        seen.add(c.slot)
        longest, highest = max(longest, n), max(highest, c.slot)
        needed = max(needed, lengths[c.slot] + n)
    width = width_bucket(longest, widths)
    if width is None:
        return None
    slots = slot_bucket(highest, num_slots)
    span = span_bucket(max(needed, width), max_length)
    if span < width:  # a padded row of an empty slot must see its own column: keep it in the span
        return None
    layout = padding_layout(slots, width, span, max_length)
    n_rows = slots * width
    ints = layout.ints.numpy()
    visible = layout.visible.numpy()
    tokens, positions = ints[:n_rows], ints[n_rows : 2 * n_rows]
    write, committed = ints[2 * n_rows : 3 * n_rows], ints[3 * n_rows :]
    for c in chunks:
        n, s, length = c.tokens.numel(), c.slot, lengths[c.slot]
        base = s * width
        tokens[base : base + n] = c.tokens.cpu().numpy()
        positions[base : base + n] = c.positions.cpu().numpy()
        write[base : base + n] = np.arange(length, length + n)
        committed[s] = length
        visible[s, :n, :] = False
        visible[s, :n, :n] = np.tril(np.ones((n, n), dtype=bool)) if c.tree_mask is None \
            else torch.as_tensor(c.tree_mask).to("cpu", torch.bool).numpy()
        layout.rows.extend(range(base, base + n))
        layout.fed.append((s, n))
    return layout


# ---- the padded forward: the model's forward, one static shape -----------------------------------


def padded_forward(model: Any, kv: torch.Tensor, ints: torch.Tensor, visible: torch.Tensor,
                   slots: int, width: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [S*W, H], fp32 logits [S*W, vocab]) of a padded step; writes its K/V into `kv`.

    The model's `decoder_layer` with attention as `StepAttention._attend_batch` computes it (all slots
    0..S-1 attending together), the mask built from device tensors: no host sync, no shape that
    depends on the data, so it can be captured.
    """
    cfg = model.config
    S, W = slots, width
    n = S * W
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group, q_width = nh // nkv, nh * d
    eps, hidden_shape = cfg.rms_norm_eps, (cfg.hidden_size,)
    low = model.dtype if model.dtype != torch.float32 else None
    dev = kv.device
    tokens, positions, write_pos = ints[:n], ints[n : 2 * n], ints[2 * n : 3 * n]
    lengths = ints[3 * n : 3 * n + S]

    cos = model._cos.index_select(0, positions)[:, None, :]
    sin = model._sin_signed.index_select(0, positions)[:, None, :]
    # Mask [S, 1, group * W, span]: committed positions of the row's slot, plus the fed tokens it sees.
    rel = torch.arange(span, device=dev)[None, :] - lengths[:, None]  # [S, span]: position - committed
    fed = torch.gather(visible, 2, rel.clamp(0, W - 1)[:, None, :].expand(S, W, span))
    fed &= ((rel >= 0) & (rel < W))[:, None, :]
    allowed = fed | (rel < 0)[:, None, :]
    mask = torch.zeros(S, W, span, device=dev).masked_fill_(~allowed, -math.inf)
    mask = mask.repeat(1, group, 1).unsqueeze(1)  # query rows are (group member, fed index)
    write_slot = torch.arange(S, device=dev)[:, None].expand(S, W).reshape(n)  # (repeat_interleave may sync)

    def attend(layer_kv: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Every slot 0..S-1 at once over positions 0..span-1 (layer_kv: [2, slots, kv_heads, capacity, d])."""
        layer_kv.permute(1, 3, 0, 2, 4)[write_slot, write_pos] = qkv[:, q_width:].view(n, 2, nkv, d)
        q = qkv[:, :q_width].view(S, W, nkv, group, d).permute(0, 2, 3, 1, 4).reshape(S * nkv, group * W, d)
        keys = layer_kv[0, :S, :, :span].reshape(S * nkv, span, d)
        values = layer_kv[1, :S, :, :span].reshape(S * nkv, span, d)
        scores = torch.bmm(q, keys.transpose(1, 2)).view(S, nkv, group * W, span).add_(mask)
        probs = torch.softmax(scores, dim=-1)
        attn = torch.bmm(probs.view(S * nkv, group * W, span), values)
        return attn.view(S, nkv, group, W, d).permute(0, 3, 1, 2, 4).reshape(n, q_width)

    x = model.embed_weight.index_select(0, tokens)
    for li, layer in enumerate(model.layers):
        x = decoder_layer(cfg, layer, x, cos, sin, functools.partial(attend, kv[li]), low)
    hidden = F.rms_norm(x, hidden_shape, model.final_norm, eps)
    logits = model.head(hidden if low is None else hidden.to(low)).float()
    return hidden, logits


# ---- graphs ----------------------------------------------------------------------------------


class _StepGraph:
    """Static buffers for one (S, W, span), and its captured graph (None: run padded eagerly)."""

    def __init__(self, runner: "CudaGraphRunner", key: tuple[int, int, int]) -> None:
        self.runner = runner
        self.key = key
        slots, width, span = key
        dev = runner.model.device
        empty = padding_layout(slots, width, span, runner.cache.max_length)
        self.ints = empty.ints.to(dev)
        self.visible = empty.visible.to(dev)
        self.graph: Any = None
        self.outputs: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        if runner.capture:
            self.host_ints = torch.empty_like(empty.ints).pin_memory()
            self.host_visible = torch.empty_like(empty.visible).pin_memory()
            self.copied = torch.cuda.Event()
            self._capture()

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        slots, width, span = self.key
        return padded_forward(self.runner.model, self.runner.cache.kv, self.ints, self.visible, slots, width, span)

    def _capture(self) -> None:
        # Warm up on a side stream (cuBLAS picks its kernels and workspaces outside the capture),
        # on the all-padding inputs: those write only the spare position, so no slot changes.
        side = torch.cuda.Stream(device=self.runner.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another instance thread's CUDA calls (health probes) stay legal meanwhile.
        with torch.cuda.graph(graph, pool=self.runner.pool, capture_error_mode="thread_local"):
            self.outputs = self._forward()
        self.graph = graph

    def run(self, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded (hidden, logits) for `layout`; valid until the next run of any graph of this runner."""
        if self.graph is None:
            self.ints.copy_(layout.ints)
            self.visible.copy_(layout.visible)
            return self._forward()
        self.copied.synchronize()  # the previous step's copies out of the pinned buffers are done
        self.host_ints.copy_(layout.ints)
        self.host_visible.copy_(layout.visible)
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.visible.copy_(self.host_visible, non_blocking=True)
        self.copied.record()
        self.graph.replay()
        return self.outputs


class CudaGraphRunner:
    """Runs the decode and verify steps on one static cache through captured graphs.

    `model.forward` asks `forward` first; None means the step is not one for a graph.
    """

    def __init__(self, model: Any, cache: Any, capture: bool = True, widths: Sequence[int] = WIDTH_BUCKETS,
                 max_graphs: int = MAX_GRAPHS) -> None:
        if not cache.static:
            raise ValueError("CUDA graphs need a static KV cache (SlotKVCache(static=True)): they hold its address")
        self.model, self.cache = model, cache
        self.capture = bool(capture) and model.device.type == "cuda"
        self.widths = tuple(sorted(widths))
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # Every position a step may feed is below max_length: size the RoPE table for it now, so
        # the eager forward never reallocates a table a graph reads.
        if model._cos.shape[0] < cache.max_length:
            model._rope_table(cache.max_length)
        self.graphs: dict[tuple[int, int, int], _StepGraph] = {}
        self.replays = 0
        self.eager_steps = 0
        self.capture_seconds = 0.0

    def forward(self, chunks: Sequence[Chunk], only_last: bool = False,
                logit_rows: Optional[torch.Tensor] = None) -> Optional[ForwardOutput]:
        """The step through its graph (captured on first use), or None: run it eagerly."""
        cache = self.cache
        layout = plan_step(chunks, [cache.length(s) for s in range(cache.num_slots)], cache.num_slots,
                           cache.max_length, self.widths)
        graph = self.graphs.get(layout.key) if layout is not None else None
        if layout is not None and graph is None and len(self.graphs) < self.max_graphs:
            graph = self._add(layout.key)
        if graph is None:
            self.eager_steps += 1
            return None
        for slot, n in layout.fed:
            cache.reserve(slot, cache.length(slot) + n)  # a static cache only checks and marks it live
        hidden_padded, logits_padded = graph.run(layout)
        self.replays += 1
        dev = self.model.device
        rows = torch.tensor(layout.rows, device=dev)
        if logit_rows is not None:
            wanted = rows.index_select(0, logit_rows.to(dev, torch.long))
        elif only_last:
            wanted = rows.index_select(0, torch.tensor(layout.last_rows(), device=dev))
        else:
            wanted = rows
        out = ForwardOutput(logits=logits_padded.index_select(0, wanted), hidden=hidden_padded.index_select(0, rows))
        for slot, n in layout.fed:
            cache._fed[slot] = n
        return out

    def _add(self, key: tuple[int, int, int]) -> _StepGraph:
        import time

        started = time.perf_counter()
        graph = _StepGraph(self, key)
        self.graphs[key] = graph
        if self.capture:
            seconds = time.perf_counter() - started
            self.capture_seconds += seconds
            log.info("captured a CUDA graph for %d slots x %d rows, %d positions (%.0f ms; %d graphs)",
                     key[0], key[1], key[2], 1e3 * seconds, len(self.graphs))
            if len(self.graphs) == self.max_graphs:
                log.warning("%d CUDA graphs captured: steps of new shapes run eagerly from now on", self.max_graphs)
        return graph

    def stats(self) -> dict[str, Any]:
        """Graphs held, replays and eager steps so far (for health and benchmarks)."""
        return {"graphs": len(self.graphs), "captured": self.capture, "replays": self.replays,
                "eager_steps": self.eager_steps, "capture_seconds": round(self.capture_seconds, 3)}
