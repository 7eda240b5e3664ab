"""Draft trees: the sampled-children side record, pruning to a budget, merging, best-first building.

`contract.DraftTree` (tokens, parents, probs; topological order) is frozen. A drafter that
*samples* its candidates from a draft distribution q (SpecInfer / Sequoia style) must tell the
verifier which q each candidate came from, or verification is not lossless; `SpecTree` adds
exactly that:

    SpecTree.sampled: {parent node (-1 = the pending token): [SampledChildren, ...]}
    SampledChildren(q, draws, replacement): the tokens drawn from q for that parent, in draw
        order (repeats allowed when drawn with replacement; without replacement each draw came
        from q renormalized over the tokens not drawn yet).

Children of a node that no SampledChildren mentions are *deterministic* candidates (chosen by a
rule, e.g. n-gram lookup or the top-k of a draft head) and are verified as one-hot proposals.
A plain DraftTree is a SpecTree with no sampled groups. Draws whose node was pruned away may stay
in `draws`: if such a draw is accepted it becomes the step's last token (see verify.py).

Every heuristic (probabilities, thresholds, budgets, depth) lives here, on the draft side.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from outrider.generation.contract import DraftTree, SampledChildren, SpecTree, children_of, sampled_groups
from outrider.generation.sampling import draw, host_array


def check_tree(tree: DraftTree) -> None:
    """Raise ValueError unless the tree is well formed (lengths agree, parents come first)."""
    n = len(tree.tokens)
    if len(tree.parents) != n or (tree.probs and len(tree.probs) != n):
        raise ValueError(f"draft tree: {n} tokens, {len(tree.parents)} parents, {len(tree.probs)} probs")
    for i, parent in enumerate(tree.parents):
        if not -1 <= parent < i:
            raise ValueError(f"draft tree: node {i} has parent {parent}; parents must come before children")
    for parent in sampled_groups(tree):
        if not -1 <= parent < n:
            raise ValueError(f"draft tree: sampled group for missing node {parent}")


def prune_tree(
    tree: DraftTree,
    budget: int,
    max_depth: int,
    prob_threshold: float = 0.0,
    max_children: int = 0,
) -> SpecTree:
    """The best `budget` nodes of a tree, closed under ancestors, in topological order.

    A node's score is its probability, capped by its ancestors' (so scores never grow down a
    path); nodes below `prob_threshold`, deeper than `max_depth`, or beyond the first
    `max_children` of their parent (0 = no cap) go, with their subtrees. The kept nodes come out
    sorted by score (ties: shallower first), which is a topological order, so siblings appear
    most likely first.
    """
    check_tree(tree)
    n = len(tree.tokens)
    probs = list(tree.probs) if tree.probs else [1.0] * n
    depths = tree.depths()
    score: list[float] = []
    for i, parent in enumerate(tree.parents):
        score.append(probs[i] if parent < 0 else min(probs[i], score[parent]))
    order = sorted(range(n), key=lambda i: (-score[i], depths[i], i))
    new_index: dict[int, int] = {-1: -1}
    child_count: dict[int, int] = {}
    out = SpecTree()
    for i in order:
        if len(out.tokens) >= budget:
            break
        parent = tree.parents[i]
        if parent not in new_index or depths[i] > max_depth or score[i] < prob_threshold:
            continue
        if max_children and child_count.get(parent, 0) >= max_children:
            continue
        child_count[parent] = child_count.get(parent, 0) + 1
        new_index[i] = len(out.tokens)
        out.tokens.append(tree.tokens[i])
        out.parents.append(new_index[parent])
        out.probs.append(score[i])
    for parent, groups in sampled_groups(tree).items():
        if parent in new_index:
            out.sampled[new_index[parent]] = list(groups)
    return out


def merge_trees(*trees: DraftTree) -> SpecTree:
    """Union of trees rooted at the same pending token: shared token prefixes become one node.

    A merged node keeps the highest probability any input gave it; sampled groups of all inputs
    are kept (verified one group after another, which stays lossless: each group's draws are
    independent of the other groups).
    """
    out = SpecTree()
    where: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for tree in trees:
        check_tree(tree)
        mapped: list[int] = []
        probs = tree.probs or [1.0] * len(tree.tokens)
        for token, parent, prob in zip(tree.tokens, tree.parents, probs):
            key = (mapped[parent] if parent >= 0 else -1, int(token))
            node = where.get(key)
            if node is None:
                node = where[key] = len(out.tokens)
                out.tokens.append(int(token))
                out.parents.append(key[0])
                out.probs.append(float(prob))
            else:
                out.probs[node] = max(out.probs[node], float(prob))
            mapped.append(node)
        for parent, groups in sampled_groups(tree).items():
            out.sampled.setdefault(mapped[parent] if parent >= 0 else -1, []).extend(groups)
    return out


@dataclass
class TreeNode:
    """A node while a tree is being built (index -1 = the pending token)."""

    index: int
    token: Optional[int]
    depth: int
    prob: float  # cumulative path probability
    parent: Optional["TreeNode"] = None
    state: Any = None  # whatever expand_fn attached to this node (e.g. a draft head's hidden state)

    def path(self) -> list[int]:
        """Tokens from the first drafted one down to this node."""
        out: list[int] = []
        node: Optional[TreeNode] = self
        while node is not None and node.token is not None:
            out.append(node.token)
            node = node.parent
        return out[::-1]


@dataclass
class SampledExpansion:
    """A node's children drawn at random from a draft distribution, for `build_dynamic_tree`.

    `group` is what the verifier needs (q and every draw, in draw order); `items` are the
    draws as (token, prob[, state]) candidates for the tree. Every draw stays in the group even
    when the tree does not take its node (below the threshold, beyond the budget): dropping a
    draw from the record would change what the later draws were conditioned on.
    """

    group: SampledChildren
    items: list[Sequence[Any]] = field(default_factory=list)


Expansion = Iterable[Sequence[Any]]  # (token, prob) or (token, prob, state); or a SampledExpansion


def build_dynamic_tree(
    expand_fn: Callable[[Any], Any],
    budget: int,
    max_depth: int,
    prob_threshold: float = 0.0,
    max_children: int = 4,
    *,
    root_state: Any = None,
    batched: bool = False,
    frontier: int = 8,
) -> SpecTree:
    """Best-first tree growth by cumulative path probability, for drafters that score tokens.

    `expand_fn(node) -> [(token, prob[, state]), ...]` gives a node's candidate children with
    their conditional draft probabilities (the optional state is stored on the child and handed
    back when the child is expanded). With `batched=True`, `expand_fn(nodes)` takes a list of
    nodes and returns one such list per node; up to `frontier` nodes are expanded per call
    (one draft-model forward for several nodes).

    The candidate with the highest cumulative probability is added next; a node is added only if
    its cumulative probability reaches `prob_threshold`, and growth stops at `budget` nodes.
    Only the best `max_children` candidates of a node are considered; nodes at `max_depth` are
    not expanded. Children given as a plain list are deterministic (e.g. a top-k), so the
    verifier treats them as one-hot proposals; an expansion given as a `SampledExpansion` is
    recorded in `tree.sampled` under the expanded node (whose index is final by then: a node is
    expanded only after it joined the tree), so the verifier uses its q.
    """
    tree = SpecTree()
    if budget <= 0 or max_depth <= 0:
        return tree
    tie = itertools.count()
    heap: list[tuple[float, int, TreeNode]] = []
    seen: set[tuple[int, int]] = set()

    def push_children(node: TreeNode, expansion: "Expansion | SampledExpansion") -> None:
        if isinstance(expansion, SampledExpansion):
            tree.sampled.setdefault(node.index, []).append(expansion.group)
            expansion = expansion.items
        ranked = sorted((tuple(item) for item in expansion), key=lambda item: -float(item[1]))
        taken = 0
        for item in ranked:
            if taken >= max_children:
                break
            token, prob = int(item[0]), float(item[1])
            if (node.index, token) in seen:
                continue
            seen.add((node.index, token))
            taken += 1
            cumulative = node.prob * prob
            if cumulative < prob_threshold or cumulative <= 0:
                continue
            child = TreeNode(-2, token, node.depth + 1, cumulative, node, item[2] if len(item) > 2 else None)
            heapq.heappush(heap, (-cumulative, next(tie), child))

    def expand(nodes: list[TreeNode]) -> None:
        nodes = [n for n in nodes if n.depth < max_depth]
        if not nodes:
            return
        if batched:
            for node, expansion in zip(nodes, expand_fn(nodes)):
                push_children(node, expansion)
        else:
            for node in nodes:
                push_children(node, expand_fn(node))

    expand([TreeNode(-1, None, 0, 1.0, None, root_state)])
    while heap and len(tree.tokens) < budget:
        added: list[TreeNode] = []
        while heap and len(tree.tokens) < budget and len(added) < (frontier if batched else 1):
            _, _, node = heapq.heappop(heap)
            node.index = len(tree.tokens)
            tree.tokens.append(node.token)
            tree.parents.append(node.parent.index)
            tree.probs.append(node.prob)
            added.append(node)
        if len(tree.tokens) < budget:
            expand(added)
    return tree


def draw_distinct(weights: np.ndarray, count: int, generator: np.random.Generator) -> list[int]:
    """`count` indices drawn one after another from `weights` (renormalized), each draw's index
    removed before the next: the draws, in order, that a group without replacement records."""
    weights = np.asarray(weights, dtype=np.float64).clip(min=0)  # a copy: draws zero it
    draws: list[int] = []
    for _ in range(min(count, int(np.count_nonzero(weights)))):
        token = draw(weights, generator)
        draws.append(token)
        weights[token] = 0.0
    return draws


def sample_children(q: Any, count: int, generator: np.random.Generator, replacement: bool = False) -> SampledChildren:
    """Draw `count` candidates from q (with or without replacement) and record how, for the verifier."""
    q = host_array(q)
    if replacement:
        weights = np.asarray(q, dtype=np.float64).clip(min=0)
        draws = [draw(weights, generator) for _ in range(count)]
    else:
        draws = draw_distinct(q, count, generator)
    return SampledChildren(q=q, draws=draws, replacement=replacement)
