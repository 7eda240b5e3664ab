"""What a decoding sequence drafts in one step: the grammar's forced tokens, else the decode
strategy's tree cut to what the grammar allows. The target verifies either (verify.py).

`draft_trees` asks the strategy for every sequence of a step at once where it can
(`propose_batch`), so that a drafter with a model of its own runs one forward for all of them."""

from __future__ import annotations

import copy
import logging
from typing import Any, Union

from outrider.errors import ExecutionError

from .constraints import TokenRules
from .contract import DraftLimits, DraftTree, children_of, sampled_groups
from .sequence import Sequence

log = logging.getLogger("outrider.llm")

MAX_FORCED_DRAFT = 16  # forced tokens drafted in one step


def draft_trees(wanted: list[tuple[Sequence, DraftLimits]], strategy: Any) -> list[Union[DraftTree, Exception]]:
    """Each sequence's draft for this step, in order: a tree at most its `limits.room` deep, or the
    exception that fails that sequence alone. Sequences the grammar forces draft what it forces (and
    are marked `forced_draft`, which the engine clears each step); the rest are asked of the strategy
    together (`propose_batch`, where it has one; else one by one)."""
    out: list[Union[DraftTree, Exception, None]] = [None] * len(wanted)
    asked: list[int] = []
    for index, (seq, limits) in enumerate(wanted):
        try:
            forced = seq.rules.forced_tokens(min(limits.room, MAX_FORCED_DRAFT)) if seq.rules is not None else []
        except Exception as exc:  # the grammar engine on this sequence's state
            out[index] = exc
            continue
        if forced:
            # What the grammar forces next (a key, punctuation), drafted as a chain: the target
            # still verifies it, so this only saves steps (SGLang's jump-forward, kept lossless).
            out[index] = DraftTree(list(forced), list(range(-1, len(forced) - 1)), [1.0] * len(forced))
            seq.forced_draft = True
        else:
            asked.append(index)
    for index, tree in zip(asked, _proposals([wanted[i] for i in asked], strategy)):
        seq, limits = wanted[index]
        out[index] = tree if isinstance(tree, Exception) else _checked(seq, tree, limits.room)
    return out  # type: ignore[return-value]  (every entry is set above)


def _proposals(items: list[tuple[Sequence, DraftLimits]], strategy: Any) -> list[Union[DraftTree, Exception]]:
    batch = getattr(strategy, "propose_batch", None)
    if batch is not None and len(items) > 1:
        try:
            trees = list(batch(items))
            if len(trees) == len(items):
                return trees
            log.error("the decode strategy's propose_batch gave %d drafts for %d sequences; asking one by one",
                      len(trees), len(items))
        except Exception:  # cannot be pinned on one sequence: ask each alone, so a failure stays its own
            log.exception("the decode strategy's propose_batch failed; asking one sequence at a time")
    out: list[Union[DraftTree, Exception]] = []
    for seq, limits in items:
        try:
            out.append(strategy.propose(seq, limits))
        except Exception as exc:
            out.append(exc)
    return out


def _checked(seq: Sequence, tree: DraftTree, room: int) -> Union[DraftTree, Exception]:
    try:
        depth = max(tree.depths(), default=0)
        if depth > room:  # positions past the context: a strategy bug, this request's alone
            return ExecutionError(f"the decode strategy drafted {depth} tokens deep; room for {room}")
        if seq.rules is not None and seq.rules.grammar is not None and len(tree):
            tree = grammatical(tree, seq.rules)
        return tree
    except Exception as exc:
        return exc


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
