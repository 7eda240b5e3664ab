"""The slot KV cache, allocated for the sequences actually admitted, not for the worst case.

A cache for 8 sequences of 2,048 tokens of SmolLM2 is 755 MB of fp32 K/V: preallocated, it was
most of an idle server's memory (1.7 GB RSS against llama.cpp's 200 MB). This one starts empty
and grows, in both the slot and the length dimension, to what `reserve` is asked for (the
engine reserves before every forward); when the last sequence leaves, the memory is returned.

On CUDA the cache is static instead (`static=True`): every slot at full length, allocated once
and never moved, because a captured CUDA graph reads and writes it by address. It has one spare
position past `max_length`, where the padded rows of a graph step write their K/V (see
`cuda_graphs.py`); no step ever attends to it.

Layout [layers, 2 (K, V), slots, kv_heads, capacity, head_dim], as the forward expects: one copy
per chunk and layer writes K and V together, and a layer's K (or V) over a range of slots is one
strided view, so attention can run over several slots at once without copying.

`SlotKVCache` holds torch tensors (the torch model's); `NumpySlotKVCache` the same layout in a
numpy array (the torch-free CPU model's, native_model.py). This module imports no torch itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Capacity grows in steps of this many positions (and at least doubles), so a long generation
# reallocates a handful of times, not every few tokens.
GROWTH_STEP = 256


class NumpySlotKVCache:
    """K/V for up to `num_slots` sequences of up to `max_length` tokens, grown on demand, in fp32
    or fp16 numpy (`SlotKVCache` below is the same on torch tensors).

    A forward writes its fed tokens tentatively at length .. length+n-1; `commit` keeps some.
    """

    def __init__(self, config: Any, num_slots: int, max_length: int, static: bool = False,
                 dtype: Any = np.float32) -> None:
        if num_slots < 1 or max_length < 1:
            raise ValueError(f"need num_slots >= 1 and max_length >= 1, got {num_slots}, {max_length}")
        # numpy: float32, float16 (half the bytes; the native kernels widen it) or "q8_0" (int8 rows of
        # head_dim values and head_dim / 32 fp16 scales: 17/32 of fp16's bytes, llama.cpp's q8_0 cache)
        self.kv_kind = "q8_0" if isinstance(dtype, str) and dtype == "q8_0" else np.dtype(dtype).name
        self.kv_dtype = np.dtype(np.int8) if self.kv_kind == "q8_0" else np.dtype(dtype)
        self.num_slots = num_slots
        self.max_length = max_length
        self.static = static
        self.native_table: Any = None  # the native runtime's view of these arrays (native_model.py), made on first use
        self._shape = (config.num_layers, 2, config.num_kv_heads, config.head_dim)
        # Static: all slots, max_length + 1 positions (the last one is the padded rows' scratch).
        self.kv = self._empty(num_slots, max_length + 1) if static else self._empty(0, 0)
        self._lengths = [0] * num_slots
        self._fed = [0] * num_slots  # tokens written tentatively by the last forward, not yet committed
        self._live: set[int] = set()  # slots holding a sequence (reserved since their last reset)

    # What the storage differs in (numpy here, torch in SlotKVCache):
    @property
    def row_width(self) -> int:
        """Elements of a stored K (or V) row: head_dim, or a q8_0 row's bytes."""
        dim = self._shape[3]
        return dim + dim // 16 if self.kv_kind == "q8_0" else dim

    def _empty(self, slots: int, capacity: int) -> Any:
        layers, two, heads, _ = self._shape
        return np.zeros((layers, two, slots, heads, capacity, self.row_width), dtype=self.kv_dtype)

    def _positions(self, slot: int, index: list[int]) -> Any:
        """A copy of `slot`'s K/V at positions `index`: [layers, 2, kv_heads, n, head_dim]."""
        return self.kv[:, :, slot][:, :, :, index]

    def _stored(self, kv: Any) -> Any:
        return np.asarray(kv, dtype=self.kv_dtype)

    @property
    def nbytes(self) -> int:
        """Memory held by the K/V arrays now."""
        return int(self.kv.nbytes)

    @property
    def capacity(self) -> int:
        """Positions allocated per slot now."""
        return self.kv.shape[4]

    def reserve(self, slot: int, length: int) -> None:
        """Make room for `length` positions in `slot` (committed + about to be fed)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range (cache has {self.num_slots})")
        if length > self.max_length:
            raise ValueError(f"slot {slot}: {length} positions exceed max_length {self.max_length}")
        self._live.add(slot)
        if self.static:
            return
        slots, capacity = self.kv.shape[2], self.kv.shape[4]
        if slot < slots and length <= capacity:
            return
        new_slots = max(slots, slot + 1)
        new_capacity = capacity
        if length > capacity:
            wanted = -(-length // GROWTH_STEP) * GROWTH_STEP
            new_capacity = min(self.max_length, max(wanted, 2 * capacity))
        grown = self._empty(new_slots, new_capacity)
        if slots and capacity:
            grown[:, :, :slots, :, :capacity] = self.kv
        self.kv = grown

    def length(self, slot: int) -> int:
        """Committed tokens in `slot`."""
        return self._lengths[slot]

    def commit(self, slot: int, keep: list[int]) -> None:
        """Keep the fed tokens at chunk indices `keep` (increasing), compacted after the committed ones."""
        fed = self._fed[slot]
        keep = [int(i) for i in keep]
        if any(i < 0 or i >= fed for i in keep) or any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError(
                f"commit(slot={slot}): keep must be increasing chunk indices below {fed} "
                f"(tokens fed by the last forward), got {keep}"
            )
        start = self._lengths[slot]
        if keep != list(range(len(keep))):
            # The gather copies first, so overlapping source and destination are safe.
            self.kv[:, :, slot, :, start : start + len(keep)] = self._positions(slot, [start + i for i in keep])
        self._lengths[slot] = start + len(keep)
        self._fed[slot] = 0

    truncatable = True  # `truncate` keeps the rows below; a ring (below) has overwritten older ones

    def truncate(self, slot: int, length: int) -> None:
        """Forget `slot`'s committed tokens from row `length` on (drafted tokens that were not kept)."""
        if self._fed[slot] or not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"truncate(slot={slot}): {length} must be within the {self._lengths[slot]} committed "
                             f"rows, with nothing fed since")
        self._lengths[slot] = length

    def read(self, slot: int, start: int, end: int) -> Any:
        """A copy of `slot`'s committed K/V at positions start .. end-1: [layers, 2, kv_heads, n, head_dim]
        (what the prefix cache keeps)."""
        if not 0 <= start <= end <= self._lengths[slot]:
            raise ValueError(f"read(slot={slot}): positions {start}..{end} are not all committed "
                             f"({self._lengths[slot]})")
        return self._positions(slot, list(range(start, end)))

    def write(self, slot: int, start: int, kv: Any) -> None:
        """Commit `kv` (as `read` returns it) at positions start .. in `slot`, right after its
        committed tokens (a cached prefix, copied in before the rest is prefilled)."""
        if start != self._lengths[slot] or self._fed[slot]:
            raise ValueError(f"write(slot={slot}): must start at the committed length {self._lengths[slot]}, "
                             f"got {start}")
        n = kv.shape[3]
        self.reserve(slot, start + n)
        self.kv[:, :, slot, :, start:start + n] = self._stored(kv)
        self._lengths[slot] = start + n

    def reset(self, slot: int) -> None:
        """Forget everything in `slot`; the memory goes back once no slot holds a sequence."""
        self._lengths[slot] = 0
        self._fed[slot] = 0
        self._live.discard(slot)
        if not self._live and self.kv.shape[2] and not self.static:
            self.kv = self._empty(0, 0)


class SlotKVCache(NumpySlotKVCache):
    """The same cache on torch tensors of `dtype` on `device` (the torch model's; static on CUDA)."""

    def __init__(self, config: Any, num_slots: int, max_length: int, dtype: Any, device: Any,
                 static: bool = False) -> None:
        import torch

        self._dtype, self._device = dtype, torch.device(device)
        super().__init__(config, num_slots, max_length, static)
        self.kv_kind = str(dtype).replace("torch.", "")

    def _empty(self, slots: int, capacity: int) -> Any:
        import torch

        layers, two, heads, dim = self._shape
        return torch.zeros(layers, two, slots, heads, capacity, dim, dtype=self._dtype, device=self._device)

    def _positions(self, slot: int, index: list[int]) -> Any:
        import torch

        return self.kv[:, :, slot].index_select(3, torch.tensor(index, dtype=torch.long, device=self.kv.device))

    def _stored(self, kv: Any) -> Any:
        import torch

        return torch.as_tensor(kv).to(self.kv.device, self.kv.dtype)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class RingSlotKVCache(NumpySlotKVCache):
    """The numpy cache of a model whose sliding layers see only their last `window` positions (Gemma 2
    and 3): those layers keep a ring of `window + step_rows - 1` rows a slot (rounded up to 16), the
    row of position p being p % capacity, instead of the whole context; the other layers are
    `NumpySlotKVCache`'s. A step may feed at most `step_rows` rows a slot (the model splits a longer
    prefill), so no row a step reads is overwritten by it (the C layer stack checks this).

    A ring grows with its longest sequence up to that size, as the other layers' cache does (a short
    chat's ring holds its rows, not a whole window's): until it is full size no position has wrapped,
    so growing it copies rows to the same places.

    What a ring forgets: committed positions before `valid_from(slot)`. `read` returns them as NaN
    (q8_0: NaN scales) in the ring layers (the global layers' rows are whole), and `restorable` says how many leading
    prefix-cache blocks can be copied back exactly: those whose last `window` positions are whole,
    which a resent chat's match (it ends past the stored prompt) always has."""

    truncatable = False  # a row's ring place may have held an older row still in its window

    def __init__(self, config: Any, num_slots: int, max_length: int, step_rows: int,
                 dtype: Any = np.float32) -> None:
        windows = [bool(s) for s in config.swa_layers]
        self.window, self.step_rows = int(config.swa_window), int(step_rows)
        self.ring_layers = [i for i, w in enumerate(windows) if w]
        self.full_layers = [i for i, w in enumerate(windows) if not w]
        self.ring_capacity = -(-(self.window + self.step_rows - 1) // 16) * 16
        super().__init__(config, num_slots, max_length, dtype=dtype)
        self._shape = (len(self.full_layers), 2, config.num_kv_heads, config.head_dim)
        self.kv = self._empty(0, 0)
        self.ring = self._empty_ring(0)
        self._valid_from = [0] * num_slots

    def _empty_ring(self, slots: int, rows: int = 0) -> np.ndarray:
        _, two, heads, _ = self._shape
        return np.zeros((len(self.ring_layers), two, slots, heads, rows if slots else 0, self.row_width),
                        dtype=self.kv_dtype)

    def _mark_lost(self, rows: np.ndarray) -> None:
        """Rows [..., n, width] a ring overwrote: NaN, or for q8_0 NaN scales (0xFFFF)."""
        if self.kv_kind == "q8_0":
            rows[..., self._shape[3]:] = -1
        else:
            rows[...] = np.nan

    def _lost(self, rows: np.ndarray) -> np.ndarray:
        """Which positions of rows [..., n, width] are marked lost (any layer, half or head)."""
        if self.kv_kind == "q8_0":
            marked = (rows[..., self._shape[3]:] == -1).all(axis=-1)
        else:
            marked = np.isnan(rows.astype(np.float32, copy=False)).any(axis=-1)
        return marked.reshape(-1, rows.shape[-2]).any(axis=0)

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes + self.ring.nbytes)

    def layer_caches(self) -> tuple[list[np.ndarray], list[bool]]:
        """Every layer's [2, slots, KV, capacity, D] array in layer order, and which are rings (the
        native layer stack's KV table)."""
        arrays: list = [None] * (len(self.full_layers) + len(self.ring_layers))
        for j, layer in enumerate(self.full_layers):
            arrays[layer] = self.kv[j]
        for j, layer in enumerate(self.ring_layers):
            arrays[layer] = self.ring[j]
        return arrays, [layer in set(self.ring_layers) for layer in range(len(arrays))]

    def reserve(self, slot: int, length: int) -> None:
        super().reserve(slot, length)
        slots, rows = self.ring.shape[2], self.ring.shape[4]
        new_rows = rows
        if rows < min(length, self.ring_capacity):
            wanted = -(-length // GROWTH_STEP) * GROWTH_STEP
            new_rows = min(self.ring_capacity, max(wanted, 2 * rows))
        if slot < slots and new_rows == rows:
            return
        grown = self._empty_ring(max(slots, slot + 1), new_rows)
        if slots and rows:
            grown[:, :, :slots, :, :rows] = self.ring  # not wrapped yet where rows < ring_capacity
        self.ring = grown

    def valid_from(self, slot: int) -> int:
        """The first committed position whose K/V the ring layers still hold."""
        return self._valid_from[slot]

    def _rows(self, positions: Any) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64) % self.ring_capacity

    def commit(self, slot: int, keep: list[int]) -> None:
        fed, start = self._fed[slot], self._lengths[slot]
        super().commit(slot, keep)  # checks keep, compacts the full layers
        keep = [int(i) for i in keep]
        # The step wrote rows start .. start + fed - 1 over the oldest positions of the ring.
        self._valid_from[slot] = max(self._valid_from[slot], start + fed - self.ring_capacity)
        if keep != list(range(len(keep))):
            source = self.ring[:, :, slot][:, :, :, self._rows([start + i for i in keep])]  # a copy
            self.ring[:, :, slot][:, :, :, self._rows(range(start, start + len(keep)))] = source

    def read(self, slot: int, start: int, end: int) -> Any:
        full = super().read(slot, start, end)  # checks the range
        out = np.empty((len(self.full_layers) + len(self.ring_layers),) + full.shape[1:], dtype=self.kv_dtype)
        out[self.full_layers] = full
        ring = self.ring[:, :, slot][:, :, :, self._rows(range(start, end))]
        lost = max(0, min(end, self._valid_from[slot]) - start)
        self._mark_lost(ring[:, :, :, :lost])  # overwritten since: never copied back as if it were K/V
        out[self.ring_layers] = ring
        return out

    def write(self, slot: int, start: int, kv: Any) -> None:
        kv = np.asarray(kv)
        super().write(slot, start, kv[self.full_layers])
        n = kv.shape[3]
        first = max(0, n - self.ring_capacity)  # older rows would be overwritten by the newer ones
        self.ring[:, :, slot][:, :, :, self._rows(range(start + first, start + n))] = \
            self._stored(kv[self.ring_layers][:, :, :, first:])
        self._valid_from[slot] = max(self._valid_from[slot], start + n - self.ring_capacity)

    def restorable(self, blocks: list[Any]) -> int:
        """How many leading blocks (prefix-cache copies of `read`, in order) can be written back
        exactly: the most whose last `window` positions hold whole ring rows (no NaN)."""
        if not blocks:
            return 0
        sizes = np.cumsum([b.shape[3] for b in blocks])
        whole = [not self._lost(np.asarray(b)[self.ring_layers]).any() for b in blocks]  # every row of it whole
        for count in range(len(blocks), 0, -1):
            first = sizes[count - 1] - self.window  # the oldest position the next query may see
            needed = [i for i in range(count) if sizes[i] > first]
            if all(whole[i] for i in needed):
                return count
        return 0

    def reset(self, slot: int) -> None:
        super().reset(slot)
        self._valid_from[slot] = 0
        if not self._live and self.ring.shape[2]:
            self.ring = self._empty_ring(0)
