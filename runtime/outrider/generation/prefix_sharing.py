"""How sequences share prompt prefixes through the PrefixCache: a prompt waits one step for an
identical first block another prompt is prefilling, copies the cached blocks that start it into its
slot, and stores its committed blocks back for later requests. Warmup's sequences take no part."""

from __future__ import annotations

import logging
from typing import Any, Optional

from .prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys
from .sequence import Sequence

log = logging.getLogger("outrider.llm")


def shares_a_prefill(prefix_cache: Optional[PrefixCache], seq: Sequence, prefilling: set[bytes]) -> bool:
    """Whether `seq`'s prompt starts with a block another prompt prefills in this step (n
    choices of one prompt, a burst of requests with one system prompt): it then waits one
    step and reuses that K/V instead of computing it again."""
    if seq.prefilled or prefix_cache is None or seq.request is None or seq.deferred:
        return False
    if len(seq.token_ids) <= BLOCK_TOKENS:  # a lookup leaves the last token: no block to share
        return False
    first = block_keys(seq.token_ids[:BLOCK_TOKENS])[0]
    if first in prefix_cache.blocks:
        return False
    if first in prefilling:
        seq.deferred = True  # once: a prompt never waits twice
        return True
    prefilling.add(first)
    return False


def reuse_prefix(prefix_cache: PrefixCache, cache: Any, seq: Sequence, stats: Any) -> None:
    """Copy the cached blocks that start `seq`'s prompt into its slot (counted in stats)."""
    blocks = prefix_cache.lookup(seq.token_ids)
    restorable = getattr(cache, "restorable", None)  # a cache with windowed layers forgets rows
    if restorable is not None and blocks:
        blocks = blocks[:restorable([block.kv for block in blocks])]
    for block in blocks:
        cache.write(seq.slot, cache.length(seq.slot), block.kv)
    seq.cached_tokens = cache.length(seq.slot)
    if stats is not None:
        stats.add("prefix_cache_queries", len(seq.token_ids))
        stats.add("prefix_cache_hits", seq.cached_tokens)


def store_prefix(prefix_cache: Optional[PrefixCache], cache: Any, seq: Sequence) -> None:
    """Keep the full blocks of `seq`'s committed tokens for later requests (not warmup's)."""
    if prefix_cache is None or seq.request is None:
        return
    length = cache.length(seq.slot)
    try:
        prefix_cache.insert(seq.token_ids[:length], lambda start, end: cache.read(seq.slot, start, end))
    except Exception:  # a cache that cannot be read costs reuse, never this request
        log.exception("model %s: storing a prefix in the prefix cache failed", seq.request.model)
