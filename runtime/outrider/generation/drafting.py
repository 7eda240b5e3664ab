"""What a decoding sequence drafts in one step: the grammar's forced tokens, else the decode
strategy's tree cut to what the grammar allows. The target verifies either (verify.py)."""

from __future__ import annotations

import copy
from typing import Any

from outrider.errors import ExecutionError

from .constraints import TokenRules
from .contract import DraftLimits, DraftTree, children_of, sampled_groups
from .sequence import Sequence

MAX_FORCED_DRAFT = 16  # forced tokens drafted in one step


def draft_tree(seq: Sequence, strategy: Any, limits: DraftLimits) -> DraftTree:
    """`seq`'s draft for this step, at most `limits.room` deep; marks `seq.forced_draft` when the grammar forced it."""
    room = limits.room
    forced = seq.rules.forced_tokens(min(room, MAX_FORCED_DRAFT)) if seq.rules is not None else []
    if forced:
        # What the grammar forces next (a key, punctuation), drafted as a chain: the target
        # still verifies it, so this only saves steps (SGLang's jump-forward, kept lossless).
        tree = DraftTree(list(forced), list(range(-1, len(forced) - 1)), [1.0] * len(forced))
        seq.forced_draft = True
        return tree
    tree = strategy.propose(seq, limits)
    depth = max(tree.depths(), default=0)
    if depth > room:  # positions past the context: a strategy bug, this request's alone
        raise ExecutionError(f"the decode strategy drafted {depth} tokens deep; room for {room}")
    if seq.rules is not None and seq.rules.grammar is not None and len(tree):
        tree = grammatical(tree, seq.rules)
    return tree


def grammatical(tree: DraftTree, rules: TokenRules) -> DraftTree:
    """`tree` without the nodes the grammar refuses (and their subtrees): a draft-side cut, like a
    probability threshold. Sampled groups keep their draws (verify.py: a pruned draw stays)."""
    children = children_of(tree)
    keep: list[int] = []

    def walk(node: int, path: list[int]) -> None:
        for child in children[node]:
            candidate = path + [tree.tokens[child]]
            if rules.allowed_prefix(candidate) == len(candidate):
                keep.append(child)
                walk(child, candidate)

    walk(-1, [])
    if len(keep) == len(tree):
        return tree
    keep.sort()  # topological order is node order
    index = {old: new for new, old in enumerate(keep)}
    out = copy.copy(tree)
    out.tokens = [tree.tokens[i] for i in keep]
    out.parents = [-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in keep]
    out.probs = [tree.probs[i] for i in keep] if tree.probs else []
    sampled = sampled_groups(tree)
    if sampled:  # groups hang off parents; a pruned parent's groups go with it
        out.sampled = {(-1 if p < 0 else index[p]): g for p, g in sampled.items() if p < 0 or p in index}
    return out
