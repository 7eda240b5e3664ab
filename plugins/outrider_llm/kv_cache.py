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
        self.kv_dtype = np.dtype(dtype)  # numpy: float32, or float16 (half the bytes; the native kernels widen it)
        self.num_slots = num_slots
        self.max_length = max_length
        self.static = static
        self._shape = (config.num_layers, 2, config.num_kv_heads, config.head_dim)
        # Static: all slots, max_length + 1 positions (the last one is the padded rows' scratch).
        self.kv = self._empty(num_slots, max_length + 1) if static else self._empty(0, 0)
        self._lengths = [0] * num_slots
        self._fed = [0] * num_slots  # tokens written tentatively by the last forward, not yet committed
        self._live: set[int] = set()  # slots holding a sequence (reserved since their last reset)

    # What the storage differs in (numpy here, torch in SlotKVCache):
    def _empty(self, slots: int, capacity: int) -> Any:
        layers, two, heads, dim = self._shape
        return np.zeros((layers, two, slots, heads, capacity, dim), dtype=self.kv_dtype)

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
