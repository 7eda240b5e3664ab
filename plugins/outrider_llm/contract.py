"""The shapes shared by the LLM engine, the model forward and the speculative plugin.

Conventions (read these first):
- A sequence lives in one *slot* of a preallocated KV cache. `cache.length(slot)` tokens are
  committed there (positions 0 .. length-1).
- The *pending* token is the last token chosen (sampled or accepted) but not yet in the cache.
  Every decode step feeds the pending token plus the draft tree's nodes in ONE forward pass.
- Position of the pending token = length(slot); a tree node at depth d (children of the
  pending token have depth 1) sits at position length(slot) + d.
- `forward` appends the K/V of every token it is fed, tentatively, after the committed ones;
  `cache.commit(slot, keep)` then keeps only the fed tokens listed in `keep` (indices into the
  chunk, in order: the pending token, then the accepted path), compacting them to positions
  length .. length+len(keep)-1. Prefill is a chunk with a causal mask, committed whole.
- Logits and hidden states come back for every fed token, in chunk order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch


@dataclass
class Chunk:
    """Tokens of one sequence fed to one forward pass."""

    slot: int
    tokens: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [n], absolute positions (RoPE)
    # bool [n, n]: mask[i, j] = token i may attend to fed token j (itself included).
    # None means causal (prefill, or a plain chain). Every token also sees all committed tokens.
    tree_mask: Optional[torch.Tensor] = None


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # float32 [total_tokens, vocab], chunks concatenated in order
    hidden: torch.Tensor  # float32 [total_tokens, hidden_size], last layer after the final norm


class KVCache(Protocol):
    num_slots: int
    max_length: int

    def length(self, slot: int) -> int: ...
    def commit(self, slot: int, keep: list[int]) -> None: ...
    def reset(self, slot: int) -> None: ...


class CausalLM(Protocol):
    """A Llama-shaped decoder with a slot KV cache and tree attention (plugins/outrider_llm/model.py)."""

    vocab_size: int
    hidden_size: int

    def new_cache(self, num_slots: int, max_length: int) -> KVCache: ...
    def forward(self, cache: KVCache, chunks: list[Chunk]) -> ForwardOutput: ...
    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...  # [n] -> [n, hidden] (for draft heads)
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [n, hidden] -> [n, vocab]


@dataclass
class DraftTree:
    """Candidate continuations of one sequence, rooted at its pending token (node -1).

    Nodes are in topological order (a parent comes before its children). `probs[i]` is the
    drafter's (cumulative path) probability of node i, used only on the draft side (pruning,
    budget); the accept rule never looks at it.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = child of the pending token
    probs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node (children of the pending token have depth 1)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def mask(self) -> torch.Tensor:
        """bool [1+n, 1+n] tree mask over [pending, nodes...] (row attends to column)."""
        n = len(self.tokens)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents):
            row = i + 1
            mask[row, row] = True
            if parent >= 0:
                mask[row] |= mask[parent + 1]
        mask[0, 1:] = False
        return mask


class Drafter(Protocol):
    """Proposes a draft tree for a sequence (registered via `outrider_register_drafters`)."""

    name: str

    def propose(self, state: "SequenceView", budget: int) -> DraftTree: ...


class SequenceView(Protocol):
    """What a drafter may read about a sequence."""

    token_ids: list[int]  # prompt + generated so far, including the pending token (last)
    prompt_length: int
    last_hidden: Optional[torch.Tensor]  # [hidden] target's last-layer hidden state at the last committed position
