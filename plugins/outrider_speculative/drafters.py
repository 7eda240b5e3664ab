"""Drafters shipped with the plugin: n-gram prompt lookup, as a tree.

`NgramDrafter` ("ngram") looks up the last n tokens of the sequence (pending token included),
for n from `max_ngram` down to `min_ngram`, among everything earlier in prompt + generated text,
and proposes what followed those earlier occurrences. Different continuations share their common
prefixes, so several matches make a tree rather than one guess.

Node probabilities (draft side only: pruning and budget, never acceptance):
    prob(node) = weighted share of the matches whose continuation passes through the node
                 x continue_prob[n] ** depth
where a match of length n found after the longest matching length lost `k` levels weighs
`backoff ** k`, and `continue_prob[n]` is a prior for "the next copied token is right" after an
n-token match (longer contexts copy more reliably). Shares and priors only shrink down a path,
so a node never scores above its parent.

State: one incremental index per sequence, `{n-gram tuple: [positions after it]}`, keyed by
`sequence_key(seq)` (its `seq_id`). Every entry point
syncs it with `seq.token_ids`, which only ever grows: it indexes the tokens appended since the
last call (and starts over when the list got shorter or its token at the last indexed position
changed: committed tokens never change, so that check is enough). So `start(seq)` at
admission and `observe(seq, outcome)` after each step are optional and idempotent (they move the
indexing cost off the propose path); `finish(seq)` frees the index. A view whose seq_id is None
or cannot be hashed gets a throwaway index, which is correct but costs O(length) a call.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable, Mapping, Optional

from outrider.generation.contract import DraftTree

from .config import OptionError, read_float, read_int
from .tree import SpecTree, build_dynamic_tree, merge_trees, prune_tree

# The tree helpers live in tree.py; drafter authors find them here too.
__all__ = ["NgramDrafter", "NgramIndex", "make_ngram_drafter", "sequence_key",
           "SpecTree", "build_dynamic_tree", "merge_trees", "prune_tree"]

# P(next copied token is right | the last n tokens matched), for n = 1, 2, 3, 4+. Rough priors
# (prompt lookup on chat and code text): a single-token match is a coin toss; 3-4 tokens of
# shared context mostly keep copying. They decide how deep each kind of match may draft before
# `prob_threshold` cuts it (0.05: 1-gram about 4 deep, 2-gram 8, longer ones to max_depth).
_CONTINUE_PROB = {1: 0.5, 2: 0.7, 3: 0.8, 4: 0.85}


def sequence_key(seq: Any) -> Optional[Hashable]:
    """What per-sequence state is keyed by: `seq.seq_id`; None (state rebuilt on every call) for a
    view whose seq_id is None or cannot be hashed."""
    key = seq.seq_id
    try:
        hash(key)
    except TypeError:
        return None
    return key


class NgramIndex:
    """Positions following every n-gram (min_n <= n <= max_n) of one growing token sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], list[int]] = {}

    def extend(self, new_tokens) -> None:
        """Append tokens and index the n-grams they complete."""
        tokens, after = self.tokens, self.after
        for token in new_tokens:
            tokens.append(int(token))
            end = len(tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n:end])
                positions = after.get(key)
                if positions is None:
                    after[key] = [end]
                else:
                    positions.append(end)

    def in_sync_with(self, token_ids) -> bool:
        """True when `token_ids` starts with the indexed tokens (checked at the last one)."""
        n = len(self.tokens)
        return n <= len(token_ids) and (n == 0 or int(token_ids[n - 1]) == self.tokens[-1])


class NgramDrafter:
    """Prompt-lookup drafting as a tree (see the module docstring)."""

    name = "ngram"

    def __init__(
        self,
        max_ngram: int = 4,
        min_ngram: int = 1,
        max_matches: int = 8,
        max_depth: int = 8,
        max_children: int = 4,
        prob_threshold: float = 0.05,
        backoff: float = 0.3,
        max_sequences: int = 4096,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram <= 16:
            raise ValueError(f"ngram: expected 1 <= min_ngram <= max_ngram <= 16 (got {min_ngram}, {max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self.max_depth = max_depth
        self.max_children = max_children
        self.prob_threshold = prob_threshold
        self.backoff = backoff
        self.max_sequences = max_sequences
        self._indexes: OrderedDict[Hashable, NgramIndex] = OrderedDict()
        self._lock = threading.Lock()  # instance threads may share one drafter

    # -- per-sequence index ---------------------------------------------------------------

    def start(self, seq: Any) -> None:
        """Index a new sequence's tokens now (optional: `propose` catches up by itself)."""
        self._index_for(seq)

    def observe(self, seq: Any, outcome: Any = None) -> None:
        """Index the tokens appended to `seq.token_ids` since the last call (idempotent)."""
        if sequence_key(seq) in self._indexes:
            self._index_for(seq)

    def finish(self, seq: Any) -> None:
        """Forget a sequence (it ended or was cancelled)."""
        key = sequence_key(seq)
        if key is not None:
            with self._lock:
                self._indexes.pop(key, None)

    def _index_for(self, seq: Any) -> NgramIndex:
        with self._lock:
            return self._sync(seq)

    def _sync(self, seq: Any) -> NgramIndex:
        token_ids = seq.token_ids
        key = sequence_key(seq)
        index = self._indexes.get(key) if key is not None else None
        if index is None or not index.in_sync_with(token_ids):
            index = NgramIndex(self.min_ngram, self.max_ngram)
            if key is not None:
                self._indexes[key] = index
                while len(self._indexes) > self.max_sequences:  # a forgotten finish() cannot grow memory forever
                    self._indexes.popitem(last=False)
        if key is not None:
            self._indexes.move_to_end(key)
        if len(index.tokens) < len(token_ids):
            index.extend(token_ids[len(index.tokens):])
        return index

    # -- proposing ------------------------------------------------------------------------

    def matches(self, index: NgramIndex) -> list[tuple[int, int, float]]:
        """(start of continuation, n, weight) of earlier occurrences of the sequence's suffix."""
        tokens = index.tokens
        length = len(tokens)
        found: list[tuple[int, int, float]] = []
        used: set[int] = set()
        weight = 1.0
        for n in range(min(self.max_ngram, length), self.min_ngram - 1, -1):
            positions = index.after.get(tuple(tokens[length - n:]), ())
            for pos in reversed(positions):  # most recent first
                if len(found) >= self.max_matches:
                    break
                if pos >= length or pos in used:  # the suffix itself / already matched longer
                    continue
                used.add(pos)
                found.append((pos, n, weight))
            if found:
                weight *= self.backoff
            if len(found) >= self.max_matches:
                break
        return found

    def propose(self, view: Any, budget: int) -> DraftTree:
        """A tree of earlier continuations of the sequence's suffix, at most `budget` nodes."""
        if budget <= 0:
            return SpecTree()
        index = self._index_for(view)
        found = self.matches(index)
        if not found:
            return SpecTree()
        tokens = index.tokens
        length = len(tokens)
        total = sum(weight for _, _, weight in found)
        # Trie of continuations: node -> accumulated weight x per-depth prior.
        trie = SpecTree()
        where: dict[tuple[int, int], int] = {}
        for pos, n, weight in found:
            keep_prob = _CONTINUE_PROB.get(n, _CONTINUE_PROB[4])
            parent = -1
            reach = 1.0
            for depth, token in enumerate(tokens[pos:min(pos + self.max_depth, length)], start=1):
                reach *= keep_prob
                share = weight / total * reach
                key = (parent, token)
                node = where.get(key)
                if node is None:
                    node = where[key] = len(trie.tokens)
                    trie.tokens.append(token)
                    trie.parents.append(parent)
                    trie.probs.append(share)
                else:
                    trie.probs[node] += share
                parent = node
        return prune_tree(trie, budget, self.max_depth, self.prob_threshold, self.max_children)


def make_ngram_drafter(model: Any, options: Optional[Mapping[str, Any]] = None, context: Any = None) -> NgramDrafter:
    """Drafter factory for `outrider_register_drafters`: `factory(model, options, context)` (the n-gram
    index needs neither the model nor the context); OptionError names a bad field."""
    options = dict(options or {})
    known = ("max_ngram", "min_ngram", "max_matches", "max_depth", "max_children", "prob_threshold", "backoff")
    for name in options:
        if name not in known:
            raise OptionError(name, f"unknown ngram option (misspelled?); expected one of {list(known)}")
    max_ngram = read_int(options, "max_ngram", 4, 1, 16)
    min_ngram = read_int(options, "min_ngram", min(1, max_ngram), 1, max_ngram)
    return NgramDrafter(
        max_ngram=max_ngram,
        min_ngram=min_ngram,
        max_matches=read_int(options, "max_matches", 8, 1, 1024),
        max_depth=read_int(options, "max_depth", 8, 1, 256),
        max_children=read_int(options, "max_children", 4, 1, 1024),
        prob_threshold=read_float(options, "prob_threshold", 0.05, 0.0, 1.0),
        backoff=read_float(options, "backoff", 0.3, 0.0, 1.0),
    )
