"""Automatic prefix caching: the K/V of token prefixes kept in blocks and reused by later requests.

As vLLM's automatic prefix caching: a sequence's committed tokens are cut into blocks of
BLOCK_TOKENS; block i is keyed by a hash of block i-1's key and its own tokens, so a key names
the whole prefix up to the end of its block. A new request walks its prompt's blocks from the
first while they are cached, copies their K/V into its slot and prefills only the rest (at least
one token, whose logits start the generation). Blocks are stored after a prefill (the prompt's)
and when a sequence ends (its whole committed text: a chat that resends its history finds its
last answer cached too).

Exact: a token's K/V depends only on the tokens before it, and on the native kernels (per-row
activation quantization, attention in key order) a chunk's rows are computed as they would be in
any other chunk, so the logits after a cached prefix equal those after a fresh prefill bit for
bit (tested). On torch's float matmuls they agree to rounding, as speculation's forwards do.

Bounded by a byte budget with LRU eviction. A lookup touches its blocks deepest first, so a
parent is always at least as recent as its children, and eviction never strands a child that
could still be reached. Keys are BLAKE2b digests: a client cannot craft a collision that would
hand another client's K/V to its prompt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

BLOCK_TOKENS = 32


@dataclass
class Block:
    key: bytes
    kv: Any  # the cache's read(): K/V of BLOCK_TOKENS positions

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes)  # numpy and torch alike


def block_keys(tokens: list[int], block: int = BLOCK_TOKENS) -> list[bytes]:
    """The key of every full block of `tokens`, in order."""
    keys, parent = [], b""
    ids = np.asarray(tokens, dtype=np.int64)
    for start in range(0, len(tokens) - block + 1, block):
        parent = hashlib.blake2b(parent + ids[start:start + block].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Blocks of K/V by prefix key, within `budget_bytes` (see the module docstring)."""

    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.budget_bytes = int(budget_bytes)
        self.block_tokens = block_tokens
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.evicted = 0

    def lookup(self, tokens: list[int]) -> list[Block]:
        """The cached blocks that start `tokens`, leaving at least its last token to prefill."""
        found: list[Block] = []
        for key in block_keys(tokens[:-1], self.block_tokens):
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        for block in reversed(found):  # deepest first: the first block ends most recent
            self.blocks.move_to_end(block.key)
        return found

    def insert(self, tokens: list[int], read: Callable[[int, int], Any]) -> int:
        """Store the full blocks of `tokens` (committed K/V, `read(start, end)` copies it) not yet
        cached; returns how many were added."""
        if self.budget_bytes <= 0:
            return 0
        keys = block_keys(tokens, self.block_tokens)
        added = 0
        for index, key in enumerate(keys):
            if key not in self.blocks:
                start = index * self.block_tokens
                block = Block(key, read(start, start + self.block_tokens))
                if block.nbytes > self.budget_bytes:
                    return added
                self.blocks[key] = block
                self.nbytes += block.nbytes
                added += 1
        for key in reversed(keys):  # the chain's root most recent, as in lookup
            self.blocks.move_to_end(key)
        while self.nbytes > self.budget_bytes and self.blocks:
            _, old = self.blocks.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evicted += 1
        return added

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0
