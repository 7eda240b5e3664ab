"""Speculative decoding's draft side and accept rule, checked without a real model.

The target here is a Markov chain over a tiny vocabulary (the logits of the next token depend
only on the current one), so "the model forward" is a table lookup and the exact distribution of
the first generated tokens has a closed form. Losslessness is then a statistical statement we can
test: generate many times through propose -> verify and compare the empirical distribution of the
first three tokens with the exact one, and check that the same test rejects deliberately wrong
accept rules.
"""

from __future__ import annotations

import collections
import itertools
import math
import subprocess
import sys
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch

from outrider.errors import ManifestError
from outrider.manifest import Manifest
from outrider.plugins import create_registry
from outrider.generation.contract import DraftLimits, DraftTree, StepOutcome
from outrider.generation.sampling import (SamplingParams, draw, greedy_token, new_generator, sample_token,
                                          target_distribution)
from outrider_speculative.config import SpeculativeConfig
from outrider_speculative.drafters import NgramDrafter, NgramIndex
from outrider_speculative.strategy import BudgetController, CostGate, SpeculativeStrategy
from outrider_speculative.tree import (
    SampledChildren,
    SampledExpansion,
    SpecTree,
    build_dynamic_tree,
    children_of,
    merge_trees,
    prune_tree,
    sample_children,
    sampled_groups,
)
from outrider.generation.verify import Verdict, verify

V = 6
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(1)) * 1.5  # target logits [prev, next]
# A draft distribution that is close to, but not, the target's: stochastic drafters sample from it.
Q_TABLE = torch.softmax(TABLE + torch.randn(V, V, generator=torch.Generator().manual_seed(2)), dim=-1)


def _markov_sample(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    out = [0]
    probs = torch.softmax(TABLE, dim=-1)
    while len(out) < length:
        out.append(int(torch.multinomial(probs[out[-1]], 1, generator=gen)))
    return out


PROMPT = _markov_sample(24, seed=3)


_seq_ids = itertools.count()


class Seq:
    """A SequenceView of a greedy request, with its own seq_id like the engine's Sequence."""

    def __init__(self, token_ids: list[int], prompt_length: int | None = None) -> None:
        self.seq_id = next(_seq_ids)
        self.token_ids = list(token_ids)
        self.prompt_length = len(token_ids) if prompt_length is None else prompt_length
        self.params = SamplingParams()
        self.generator = new_generator(0)
        self.last_hidden = None
        self.new_features = None


def _check_topological(tree: DraftTree) -> None:
    assert len(tree.tokens) == len(tree.parents) == len(tree.probs)
    for i, parent in enumerate(tree.parents):
        assert -1 <= parent < i


# -- statistics -----------------------------------------------------------------------------


def _exact(params: SamplingParams, count: int = 3) -> dict[tuple[int, ...], float]:
    """P(first `count` tokens) under the target, from the prompt's last token."""
    rows = target_distribution(TABLE, params.temperature, params.top_k, params.top_p).astype(np.float64)
    out = {}
    for seq in itertools.product(range(V), repeat=count):
        prob, prev = 1.0, PROMPT[-1]
        for token in seq:
            prob *= float(rows[prev, token])
            prev = token
        out[seq] = prob
    return out


def _chi_square(counts: collections.Counter, exact: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic (cells expecting < 5 pooled) and its degrees of freedom."""
    if any(exact.get(key, 0.0) == 0.0 for key in counts):
        return math.inf, 1  # an impossible sequence was generated
    stat, cells, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for key, prob in exact.items():
        expected, observed = prob * n, counts.get(key, 0)
        if prob == 0.0:
            continue
        if expected < 5:
            pooled_obs += observed
            pooled_exp += expected
            continue
        stat += (observed - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return stat, cells - 1


def _chi_square_limit(df: int, z: float = 4.5) -> float:
    """Upper quantile of chi-square(df) at about p = 3e-6 (Wilson-Hilferty)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


Propose = Callable[[Seq], DraftTree]
Verify = Callable[[DraftTree, Any, Any, np.random.Generator], Verdict]


def _first_tokens(propose: Propose, check: Verify, params: SamplingParams, samples: int, seed: int,
                  after: Callable[[Seq, DraftTree, Verdict], None] | None = None,
                  count: int = 3) -> collections.Counter:
    """Run the engine's loop `samples` times; count the first `count` generated tokens."""
    gen = new_generator(seed)
    counts: collections.Counter = collections.Counter()
    for _ in range(samples):
        seq = Seq(PROMPT)
        produced = 0
        while produced < count:
            tree = propose(seq)
            logits = TABLE[[seq.token_ids[-1], *tree.tokens]]  # the "forward": one row per fed token
            verdict = check(tree, logits, params, gen)
            assert verdict.keep() == [0] + [i + 1 for i in verdict.accepted]
            seq.token_ids += verdict.emitted
            produced += len(verdict.emitted)
            if after is not None:
                after(seq, tree, verdict)
        counts[tuple(seq.token_ids[len(PROMPT):len(PROMPT) + count])] += 1
    return counts


class SampledDrafter:
    """A stochastic drafter: root candidates drawn from q without replacement, their children with."""

    name = "sampled"

    def __init__(self, seed: int = 7, width: int = 3, fanout: int = 2) -> None:
        self.gen = new_generator(seed)
        self.width = width
        self.fanout = fanout

    def propose(self, seq: Any, budget: int) -> SpecTree:
        tree = SpecTree()
        last = seq.token_ids[-1]
        root = sample_children(Q_TABLE[last], self.width, self.gen, replacement=False)
        tree.sampled[-1] = [root]
        for token in root.draws:
            tree.tokens.append(token)
            tree.parents.append(-1)
            tree.probs.append(float(Q_TABLE[last, token]))
            node = len(tree.tokens) - 1
            below = sample_children(Q_TABLE[token], self.fanout, self.gen, replacement=True)
            tree.sampled[node] = [below]
            for child in dict.fromkeys(below.draws):
                tree.tokens.append(child)
                tree.parents.append(node)
                tree.probs.append(tree.probs[node] * float(Q_TABLE[token, child]))
        return tree


def _ngram_strategy(**knobs: Any) -> SpeculativeStrategy:
    config = SpeculativeConfig.from_section({"drafters": ["ngram"], "prob_threshold": 0.0, "cost_gate": False, **knobs})
    strategy = SpeculativeStrategy(config)
    strategy.attach()
    return strategy


def _room(room: int = 64) -> DraftLimits:
    """DraftLimits of one sequence alone in a step, `room` tokens from its end."""
    return DraftLimits(room=room, n_active=1, step=0)


def _engine_like(strategy: SpeculativeStrategy) -> tuple[Propose, Callable]:
    """propose/after callbacks that drive the strategy the way the engine does (the engine verifies)."""

    def propose(seq: Seq) -> DraftTree:
        if len(seq.token_ids) == len(PROMPT):
            strategy.start(seq)
        return strategy.propose(seq, _room())

    def after(seq: Seq, tree: DraftTree, verdict: Verdict) -> None:
        strategy.observe(seq, StepOutcome("decode", len(tree), verdict.accepted_tokens, verdict.emitted))

    return propose, after


def _assert_lossless(counts: collections.Counter, params: SamplingParams) -> None:
    stat, df = _chi_square(counts, _exact(params), sum(counts.values()))
    assert stat < _chi_square_limit(df), (stat, df, _chi_square_limit(df))


def _assert_detected(counts: collections.Counter, params: SamplingParams) -> None:
    stat, df = _chi_square(counts, _exact(params), sum(counts.values()))
    assert stat > _chi_square_limit(df), (stat, df, _chi_square_limit(df))


# Deliberately wrong accept rules, to show the distribution test has teeth.


def _wrong_verify(mode: str) -> Verify:
    def check(tree: DraftTree, logits: Any, params: Any, gen: np.random.Generator) -> Verdict:
        children, groups = children_of(tree), sampled_groups(tree)
        verdict = Verdict(draft_tokens=len(tree))
        node = -1
        while True:
            p = target_distribution(logits[node + 1], params.temperature, params.top_k, params.top_p).astype(np.float64)
            kids, chosen = children[node], None
            if mode == "always_accept":  # take the drafter's first guess, whatever the target says
                chosen = kids[0] if kids else None
            elif mode == "no_residual":  # test every candidate against the original p
                chosen = next((c for c in kids if gen.random() < p[tree.tokens[c]]), None)
            elif mode == "q_over_p":  # the ratio upside down
                node_of = {tree.tokens[c]: c for c in kids}
                for group in groups.get(node, []):
                    q = group.q.astype(np.float64) / group.q.sum()
                    for token in group.draws:
                        if gen.random() * p[token] < q[token]:
                            if token not in node_of:  # an accepted draw whose node was pruned ends the step
                                verdict.bonus = token
                                return verdict
                            chosen = node_of[token]
                            break
                        p = np.maximum(p - q, 0)
                        p = p / p.sum()
                        if not group.replacement:
                            q = q.copy()
                            q[token] = 0
                            q = q / q.sum()
                    if chosen is not None:
                        break
            if chosen is None:
                verdict.bonus = draw(p, gen)
                return verdict
            verdict.accepted.append(chosen)
            verdict.tokens.append(tree.tokens[chosen])
            node = chosen

    return check


# -- losslessness ---------------------------------------------------------------------------


def test_ngram_tree_sampling_matches_the_target_distribution():
    params = SamplingParams(temperature=1.0)
    strategy = _ngram_strategy(max_draft_tokens=8, max_children=3)
    propose, after = _engine_like(strategy)
    counts = _first_tokens(propose, verify, params, samples=15000, seed=11, after=after)
    _assert_lossless(counts, params)
    # The trees were real trees, and drafts were accepted.
    assert strategy.stats["accepted_tokens"] > 0.2 * 15000
    # Wrong rules on the same trees fail the same test.
    _assert_detected(_first_tokens(propose, _wrong_verify("always_accept"), params, 3000, seed=12), params)
    _assert_detected(_first_tokens(propose, _wrong_verify("no_residual"), params, 6000, seed=13), params)


def test_sampled_tree_with_its_q_matches_the_target_distribution():
    params = SamplingParams(temperature=1.0)
    drafter = SampledDrafter()
    propose = lambda seq: drafter.propose(seq, 16)  # noqa: E731
    counts = _first_tokens(propose, verify, params, samples=15000, seed=21)
    _assert_lossless(counts, params)
    _assert_detected(_first_tokens(propose, _wrong_verify("q_over_p"), params, 6000, seed=22), params)


def test_merged_pruned_trees_with_temperature_top_k_top_p_match_the_target_distribution():
    # ngram (deterministic) + sampled (q-based) drafters, merged, then cut to 5 nodes, so some
    # sampled draws lose their node; at T=0.7 with top_k and top_p the target has zeros too.
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    config = SpeculativeConfig.from_section(
        {"drafters": ["ngram", "sampled"], "max_draft_tokens": 5, "prob_threshold": 0.0, "adaptive": False,
         "cost_gate": False})
    strategy = SpeculativeStrategy(config)
    strategy.bind_registry({"sampled": lambda model, options, context: SampledDrafter(seed=31)})
    strategy.attach()
    propose, after = _engine_like(strategy)
    counts = _first_tokens(propose, verify, params, samples=10000, seed=32, after=after)
    _assert_lossless(counts, params)
    assert any(sampled_groups(strategy.propose(Seq(PROMPT), _room())) for _ in range(3))
    _assert_detected(_first_tokens(propose, _wrong_verify("always_accept"), params, 3000, seed=33), params)


def test_an_empty_tree_draws_exactly_what_plain_sampling_draws():
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    for seed in range(50):
        logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(seed))
        a = verify(SpecTree(), logits, params, new_generator(seed))
        b = sample_token(logits[0], params, new_generator(seed))
        assert (a.accepted, a.bonus) == ([], b)


def test_a_tree_without_its_q_is_still_verified_losslessly():
    # Dropping the sampled groups turns the draws into deterministic candidates: fewer accepted,
    # same distribution.
    params = SamplingParams(temperature=1.0)
    drafter = SampledDrafter(seed=41)

    def propose(seq: Seq) -> DraftTree:
        tree = drafter.propose(seq, 16)
        return DraftTree(tree.tokens, tree.parents, tree.probs)

    _assert_lossless(_first_tokens(propose, verify, params, samples=8000, seed=42), params)


def test_knowing_q_accepts_more_than_treating_draws_as_deterministic():
    params = SamplingParams(temperature=1.0)
    drafter = SampledDrafter(seed=43, width=1, fanout=1)
    gen = new_generator(44)
    with_q = without_q = 0
    for _ in range(3000):
        tree = drafter.propose(Seq(PROMPT), 16)
        logits = TABLE[[PROMPT[-1], *tree.tokens]]
        with_q += verify(tree, logits, params, gen).accepted_tokens
        without_q += verify(DraftTree(tree.tokens, tree.parents, tree.probs), logits, params, gen).accepted_tokens
    assert with_q > 1.2 * without_q  # sum min(p, q) against sum p q per draw


def test_an_accepted_draw_whose_node_was_pruned_ends_the_step():
    logits = torch.full((2, 8), -30.0)
    logits[0, 3] = 10.0  # the target all but insists on token 3
    tree = SpecTree(tokens=[5], parents=[-1], probs=[0.5])
    tree.sampled = {-1: [SampledChildren(q=torch.ones(8), draws=[3, 5])]}  # token 3 drawn, its node pruned
    verdict = verify(tree, logits, {"temperature": 1.0}, new_generator(0))
    assert (verdict.accepted, verdict.bonus, verdict.keep()) == ([], 3, [0])


# -- greedy -----------------------------------------------------------------------------------


def test_greedy_verification_is_plain_greedy_decoding_even_with_ties():
    # Integer logits tie often: the first maximum must win in both paths.
    table = torch.randint(0, 3, (8, 8), generator=torch.Generator().manual_seed(5)).float()
    prompt = [0, 1, 2, 3, 1, 2, 3, 1, 2]
    plain = list(prompt)
    for _ in range(40):
        plain.append(greedy_token(table[plain[-1]]))
    gen = torch.Generator().manual_seed(6)
    params = SamplingParams(temperature=0.0)
    strategy = _ngram_strategy()
    for trial in range(30):
        seq = Seq(prompt)
        while len(seq.token_ids) < len(plain):
            tree = strategy.propose(seq, _room())
            if trial % 2:  # random extra branches, sometimes right, sometimes not
                noise = SpecTree(tokens=torch.randint(0, 8, (6,), generator=gen).tolist(),
                                 parents=[-1, 0, 1, -1, 3, 0], probs=[0.5] * 6)
                tree = merge_trees(tree, noise)
            verdict = verify(tree, table[[seq.token_ids[-1], *tree.tokens]], params, gen)
            seq.token_ids += verdict.emitted
        assert seq.token_ids[:len(plain)] == plain


def test_greedy_walk_follows_the_argmax_through_random_trees():
    gen = torch.Generator().manual_seed(8)
    for _ in range(300):
        n = int(torch.randint(0, 20, (1,), generator=gen))
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
        logits = torch.randint(0, 4, (n + 1, 10), generator=gen).float()
        tokens = []
        for i, parent in enumerate(parents):  # half the nodes carry their row's argmax
            best = greedy_token(logits[parent + 1])
            other = int(torch.randint(0, 10, (1,), generator=gen))
            tokens.append(best if torch.rand((), generator=gen) < 0.5 else other)
        tree = DraftTree(tokens, parents, [1.0] * n)
        verdict = verify(tree, logits, {"temperature": 0}, None)
        node, expect = -1, []
        while True:
            best = greedy_token(logits[node + 1])
            nxt = next((c for c in range(n) if parents[c] == node and tokens[c] == best), None)
            if nxt is None:
                break
            expect.append(nxt)
            node = nxt
        assert verdict.accepted == expect
        assert verdict.bonus == greedy_token(logits[node + 1])
        assert verdict.emitted == [tokens[i] for i in expect] + [verdict.bonus]


def test_verify_rejects_logits_of_the_wrong_shape():
    tree = DraftTree([1, 2], [-1, 0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"1 \+ 2"):
        verify(tree, torch.zeros(2, 5), {"temperature": 0}, None)


# -- the n-gram drafter --------------------------------------------------------------------


def _words(text: str) -> tuple[list[int], dict[int, str]]:
    vocab: dict[str, int] = {}
    ids = [vocab.setdefault(w, len(vocab)) for w in text.split()]
    return ids, {i: w for w, i in vocab.items()}


def _paths(tree: DraftTree, names: dict[int, str]) -> set[str]:
    """Every root-to-leaf path, as words."""
    children = children_of(tree)
    out = set()
    for node in range(len(tree)):
        if not children[node]:
            path, at = [], node
            while at >= 0:
                path.append(names[tree.tokens[at]])
                at = tree.parents[at]
            out.add(" ".join(reversed(path)))
    return out


def test_ngram_drafter_proposes_the_earlier_continuation():
    ids, names = _words("def add ( a , b ) : return a + b \n def add ( a ,")
    tree = NgramDrafter(max_depth=6).propose(Seq(ids), budget=16)
    _check_topological(tree)
    assert "b ) : return a +" in _paths(tree, names)
    assert [names[t] for t in tree.tokens[:3]] == ["b", ")", ":"]  # the best chain comes first


def test_ngram_drafter_branches_where_earlier_continuations_differ():
    ids, names = _words("a b c x y . a b c x z . a b c x y . a b c")
    tree = NgramDrafter(max_depth=2, prob_threshold=0.0).propose(Seq(ids), budget=16)
    _check_topological(tree)
    assert _paths(tree, names) == {"x y", "x z"}
    prob = {names[t]: tree.probs[i] for i, t in enumerate(tree.tokens)}
    assert prob["x"] > prob["y"] > prob["z"] > 0  # y followed twice, z once
    assert tree.parents == [-1, 0, 0] and names[tree.tokens[1]] == "y"  # likelier sibling first


def test_ngram_drafter_respects_budget_depth_fanout_and_threshold():
    ids = _markov_sample(400, seed=9)  # plenty of repeated n-grams with varied continuations
    seq = Seq(ids)
    full = NgramDrafter(max_depth=8, max_children=8, max_matches=32, prob_threshold=0.0).propose(seq, 64)
    assert len(full) > 20
    for budget, depth, fanout in [(1, 8, 8), (5, 8, 8), (16, 2, 8), (16, 8, 1), (64, 3, 2)]:
        drafter = NgramDrafter(max_depth=depth, max_children=fanout, max_matches=32, prob_threshold=0.0)
        tree = drafter.propose(seq, budget)
        _check_topological(tree)
        assert 0 < len(tree) <= budget
        assert max(tree.depths()) <= depth
        assert max(collections.Counter(tree.parents).values()) <= fanout
    pruned = NgramDrafter(max_depth=8, max_children=8, max_matches=32, prob_threshold=0.2).propose(seq, 64)
    assert 0 < len(pruned) < len(full)
    assert min(pruned.probs) >= 0.2
    # Scores never grow down a path, so a threshold cuts whole subtrees.
    for i, parent in enumerate(full.parents):
        assert parent < 0 or full.probs[i] <= full.probs[parent]


def test_ngram_drafter_proposes_nothing_without_a_match():
    assert len(NgramDrafter().propose(Seq([1, 2, 3, 4, 5]), 16)) == 0
    assert len(NgramDrafter().propose(Seq([1, 2, 1, 2]), 0)) == 0


def test_ngram_index_kept_incrementally_equals_one_built_at_once():
    ids = _markov_sample(200, seed=10)
    drafter = NgramDrafter()
    seq = Seq(ids[:50])
    drafter.start(seq)
    for i in range(50, 200, 7):
        new = ids[i:i + 7]
        seq.token_ids += new
        drafter.observe(seq, StepOutcome("decode", 0, 0, new))
        drafter.observe(seq, StepOutcome("decode", 0, 0, new))  # idempotent: it syncs with seq.token_ids
    once = NgramIndex(1, 4)
    once.extend(ids)
    assert drafter._indexes[seq.seq_id].after == once.after
    # A list that got shorter, or changed at the last indexed token, is re-indexed, not trusted.
    for changed in (ids[:120], ids[:199] + [(ids[199] + 1) % V] + ids[:30]):
        seq.token_ids = list(changed)
        drafter.propose(seq, 8)
        fresh = NgramIndex(1, 4)
        fresh.extend(changed)
        assert drafter._indexes[seq.seq_id].after == fresh.after
    drafter.finish(seq)
    assert seq not in drafter._indexes


# -- tree helpers -----------------------------------------------------------------------------


def _toy_expand(node) -> list[tuple[int, float]]:
    return [(0, 0.5), (1, 0.3), (2, 0.15), (3, 0.05)]


def test_build_dynamic_tree_keeps_the_most_likely_nodes():
    tree = build_dynamic_tree(_toy_expand, budget=10, max_depth=3, prob_threshold=0.02, max_children=3)
    _check_topological(tree)
    assert len(tree) == 10
    assert max(tree.depths()) <= 3
    assert max(collections.Counter(tree.parents).values()) <= 3
    # Brute force: every path of up to 3 tokens from {0,1,2} (max_children), scored by product.
    weights = dict(_toy_expand(None))
    scores = sorted((math.prod(weights[t] for t in path) for d in (1, 2, 3)
                     for path in itertools.product(range(3), repeat=d)), reverse=True)
    assert sorted(tree.probs, reverse=True) == pytest.approx(scores[:10])
    low = build_dynamic_tree(_toy_expand, budget=100, max_depth=8, prob_threshold=0.1, max_children=4)
    assert min(low.probs) >= 0.1 and len(low) < 100


def test_build_dynamic_tree_hands_back_state_and_can_expand_in_batches():
    calls = []

    def expand_many(nodes):
        calls.append(len(nodes))
        for node in nodes:
            assert node.state == tuple(node.path())  # what the parent's expansion attached
        return [[(t, p, tuple(node.path()) + (t,)) for t, p in _toy_expand(node)] for node in nodes]

    tree = build_dynamic_tree(expand_many, budget=20, max_depth=4, prob_threshold=0.0, max_children=2,
                              root_state=(), batched=True, frontier=4)
    _check_topological(tree)
    assert len(tree) == 20
    assert len(calls) < 20 and max(calls) > 1


def test_build_dynamic_tree_records_sampled_expansions_under_the_expanded_node():
    # Each node draws 3 children from Q_TABLE (its row = its token); with a threshold some draws
    # get no node, and must still be in their group, in draw order.
    gen = new_generator(3)
    made: dict[int, SampledChildren] = {}

    def expand(node):
        row = Q_TABLE[PROMPT[-1] if node.token is None else node.token]
        group = sample_children(row, 3, gen)
        made[node.index] = group
        return SampledExpansion(group, [(t, float(row[t])) for t in group.draws])

    tree = build_dynamic_tree(expand, budget=6, max_depth=3, prob_threshold=0.05, max_children=3)
    _check_topological(tree)
    assert set(tree.sampled) == set(made)  # one group per expanded node, under its final index
    for parent, (group,) in tree.sampled.items():
        assert group is made[parent]
        kids = [tree.tokens[i] for i, p in enumerate(tree.parents) if p == parent]
        assert set(kids) <= set(group.draws) and len(group.draws) == 3
    assert any(len([i for i, p in enumerate(tree.parents) if p == parent]) < 3 for parent in tree.sampled), \
        "no draw was left without a node: the 'pruned draws stay' case is not exercised"


def test_merged_and_pruned_trees_keep_every_group_whole_and_under_its_node():
    """Whatever merge and prune do, a kept group still hangs under the node it was drawn for."""
    gen = torch.Generator().manual_seed(17)
    drafter = SampledDrafter(seed=18)
    strategy = _ngram_strategy()
    for trial in range(200):
        seq = Seq(_markov_sample(30 + trial % 7, seed=trial))
        sampled = drafter.propose(seq, 16)
        paths = {}  # group -> the token path of the node it was drawn under
        for parent, groups in sampled.sampled.items():
            path, at = [], parent
            while at >= 0:
                path.append(sampled.tokens[at])
                at = sampled.parents[at]
            for group in groups:
                paths[id(group)] = tuple(reversed(path))
        merged = merge_trees(strategy.drafters[0].propose(seq, 8), sampled)
        budget = int(torch.randint(1, 12, (1,), generator=gen))
        pruned = prune_tree(merged, budget, max_depth=int(torch.randint(1, 4, (1,), generator=gen)),
                            max_children=int(torch.randint(1, 4, (1,), generator=gen)))
        _check_topological(pruned)
        for parent, groups in pruned.sampled.items():
            assert -1 <= parent < len(pruned)
            path, at = [], parent
            while at >= 0:
                path.append(pruned.tokens[at])
                at = pruned.parents[at]
            for group in groups:
                assert paths[id(group)] == tuple(reversed(path)), "a group moved to another node"
        # No group is lost while its node stays.
        kept_paths = set()
        for node in range(-1, len(pruned)):
            path, at = [], node
            while at >= 0:
                path.append(pruned.tokens[at])
                at = pruned.parents[at]
            kept_paths.add(tuple(reversed(path)))
        assert sum(len(g) for g in pruned.sampled.values()) == sum(1 for p in paths.values() if p in kept_paths)


def test_merge_trees_unites_shared_prefixes_and_keeps_the_higher_probability():
    a = DraftTree([5, 6, 7], [-1, 0, 1], [0.9, 0.8, 0.3])
    b = SpecTree([5, 6, 8, 9], [-1, 0, 1, -1], [0.7, 0.85, 0.4, 0.2])
    q = torch.full((10,), 0.1)
    b.sampled = {1: [sample_children(q, 1, new_generator(0))]}
    merged = merge_trees(a, b)
    _check_topological(merged)
    assert merged.tokens == [5, 6, 7, 8, 9]
    assert merged.parents == [-1, 0, 1, 1, -1]
    assert merged.probs == [0.9, 0.85, 0.3, 0.4, 0.2]
    assert list(merged.sampled) == [1]  # node 1 of b is node 1 of the merged tree


def test_prune_tree_cuts_to_budget_and_remaps_sampled_groups():
    tree = SpecTree([1, 2, 3, 4, 5], [-1, -1, 1, 2, 0], [0.2, 0.9, 0.8, 0.7, 0.9])
    tree.sampled = {2: [sample_children(torch.ones(8), 2, None)], 0: [sample_children(torch.ones(8), 1, None)]}
    pruned = prune_tree(tree, budget=3, max_depth=8)
    assert pruned.tokens == [2, 3, 4] and pruned.parents == [-1, 0, 1]
    assert pruned.probs == [0.9, 0.8, 0.7]
    assert list(pruned.sampled) == [1]  # node 2 became node 1; node 0's group went with node 0
    # Node 4's own 0.9 is capped by its parent's 0.2: it cannot jump ahead of its parent.
    assert prune_tree(tree, budget=5, max_depth=8, prob_threshold=0.5).tokens == [2, 3, 4]


# -- strategy: budget, knobs, registration ----------------------------------------------------


def test_budget_grows_with_acceptance_shrinks_without_and_shares_a_full_batch():
    control = BudgetController(max_tokens=16, min_tokens=2, batch_tokens=64)
    assert control.budget("a") == 16
    for _ in range(4):
        control.observe("a", drafted_depth=8, accepted=0)
    assert control.budget("a") == 2  # shrunk to the floor, still probing
    for _ in range(6):
        control.observe("a", drafted_depth=2, accepted=2)
    assert control.budget("a") == 16  # grew back
    assert [control.batch_budget(n) for n in (1, 4, 8, 32, 128)] == [16, 16, 8, 2, 0]
    assert control.budget("a", n_active=8) == 8
    fixed = BudgetController(max_tokens=16, adaptive=False)
    fixed.observe("a", 8, 0)
    assert fixed.budget("a") == 16


def test_strategy_budget_follows_recorded_acceptance():
    strategy = _ngram_strategy(max_draft_tokens=8)
    seq = Seq([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])
    tree = strategy.propose(seq, _room())
    assert len(tree) > 0
    for _ in range(4):
        strategy.observe(seq, StepOutcome("decode", len(tree), 0, []))
    assert strategy.budget(seq) == strategy.config.min_draft_tokens
    assert len(strategy.propose(seq, _room())) <= strategy.config.min_draft_tokens
    # The grammar's forced tokens and the prefill teach it nothing about the drafters.
    for phase in ("forced", "prefill"):
        strategy.observe(seq, StepOutcome(phase, 8, 8, []))
    assert strategy.budget(seq) == strategy.config.min_draft_tokens
    assert max(strategy.propose(seq, _room(1)).depths()) == 1  # cut to the room the engine gives
    strategy.finish(seq)
    assert strategy.budget(seq) == 8


def _gated_run(gate: CostGate, steps: int, step_cost: Callable[[bool, int], tuple[float, int]]) -> tuple[int, float, int]:
    """Drive `gate` through `steps` steps of one sequence on a simulated clock: step_cost(drafting,
    step index) -> (seconds, tokens emitted). (drafting steps, total seconds, total tokens)."""
    now, drafted, tokens = 0.0, 0, 0
    for i in range(steps):
        drafting = gate.begin("s", now)
        seconds, emitted = step_cost(drafting, i)
        gate.tokens("s", emitted)
        now += seconds
        drafted += drafting
        tokens += emitted
    return drafted, now, tokens


def test_cost_gate_keeps_drafting_that_pays_and_still_measures_plain():
    # Drafting steps: 10 ms for 3 tokens (300 tok/s); plain steps: 8 ms for 1 (125 tok/s).
    drafted, seconds, tokens = _gated_run(CostGate(), 400, lambda d, i: (0.010, 3) if d else (0.008, 1))
    plain = 400 - drafted
    assert 400 / 34 <= plain <= 400 / 30, plain  # a plain step about every 32: the plain rate kept current
    assert tokens / seconds > 0.95 * 300


def test_cost_gate_stops_a_drafter_that_never_pays_within_3_percent():
    # Drafting steps: 12 ms for 1 token (nothing accepted); plain: 8 ms for 1.
    drafted, seconds, tokens = _gated_run(CostGate(), 1000, lambda d, i: (0.012, 1) if d else (0.008, 1))
    assert drafted <= 45, drafted  # 2-step probes spaced so that their extra 4 ms stay within 2% of the plain time
    assert tokens / seconds >= 0.97 * 125, tokens / seconds


def test_cost_gate_resumes_drafting_when_it_starts_to_pay():
    # The first 100 steps drafting loses; then the output starts copying its input and it wins 3x.
    def cost(drafting: bool, i: int) -> tuple[float, int]:
        if not drafting:
            return 0.008, 1
        return (0.012, 1) if i < 100 else (0.010, 3)

    gate = CostGate()
    early, _, _ = _gated_run(gate, 100, cost)
    assert early <= 10
    late, _, _ = _gated_run(gate, 200, lambda d, i: cost(d, i + 100))
    assert late >= 200 - 64 - 8, late  # back within one wait (at most 64 steps by then), then mostly drafting


def test_cost_gate_does_not_judge_a_drafter_by_its_first_steps_one_time_work():
    # A draft model reads the whole prompt on its first drafting step (500 ms here); after that a
    # drafting step costs 10 ms for 3 tokens against a plain step's 8 ms for 1. Timed, the first
    # step alone sank the EMA the first verdict rests on, and drafting that pays stopped.
    first = [True]

    def cost(drafting: bool, i: int) -> tuple[float, int]:
        if not drafting:
            return 0.008, 1
        seconds, first[0] = (0.500 if first[0] else 0.010), False
        return seconds, 3

    drafted, seconds, tokens = _gated_run(CostGate(), 400, cost)
    assert drafted >= 400 - 400 // 30, drafted
    assert tokens / seconds > 230, tokens / seconds  # 1,170 tokens in 4.5 s: 260 tok/s; plain is 125


def test_cost_gate_judges_a_bursty_cheap_drafter_by_the_steps_it_drafts():
    # An n-gram drafter on a model whose output copies its input now and then: most steps it finds
    # nothing (asking took 0.1 ms, and the step 5% more than a plain one, 8.4 against 8 ms, for one
    # token); every 100 steps a 10-step copy, where it drafts 4 tokens a step at 9 ms. Timed as
    # drafting, the empty steps lost by their 5% and the gate waited through bursts; they are plain
    # steps plus a cheap asking, so drafting is judged by the steps that drafted.
    def run(gate: Optional[CostGate]) -> float:
        now, tokens = 0.0, 0
        for i in range(2000):
            drafting = gate.begin("s", now) if gate is not None else True
            burst = i % 100 >= 90
            if drafting:
                if gate is not None:
                    gate.spent("s", 0.0001)
                    gate.proposed("s", 8 if burst else 0)
                seconds, emitted = (0.009, 4) if burst else (0.0084, 1)
            else:
                seconds, emitted = 0.008, 1
            if gate is not None:
                gate.tokens("s", emitted)
            now += seconds
            tokens += emitted
        return tokens / now

    ungated, gated = run(None), run(CostGate())
    assert gated >= 0.95 * ungated, (gated, ungated)  # 0.87x when the empty steps counted as drafting


def test_a_gated_sequence_peeks_with_one_cheap_draft_token_and_catches_a_late_copy():
    # 40 requests of 48 tokens whose output starts copying its input only after its first 16
    # tokens. Before, the n-gram drafter proposes wrong drafts (7 ms a step against 5 ms plain, one
    # token); then right ones (5.5 ms, 4 tokens). The early steps lose, and the wait they earn
    # outlasts the request. A peek (one draft token, 5.1 ms) on a waiting step finds the copy.
    def run(gated: bool, peeking: bool, copies: bool = True) -> float:
        gate, now, tokens = CostGate(), 0.0, 0
        for request in range(40):
            made = 0
            while made < 48:
                copying = copies and made >= 16
                drafting = gate.begin(request, now) if gated else True
                if drafting:
                    gate.spent(request, 0.0001)
                    gate.proposed(request, 8)
                    seconds, emitted = (0.0055, 4) if copying else (0.007, 1)
                elif peeking and gate.peek(request):
                    seconds, emitted = 0.0051, 2 if copying else 1
                else:
                    seconds, emitted = 0.005, 1
                gate.tokens(request, emitted)
                now, tokens, made = now + seconds, tokens + emitted, made + emitted
            gate.release(request)
        return tokens / now

    ungated, peeks, no_peeks = run(False, False), run(True, True), run(True, False)
    assert peeks >= 0.95 * ungated and peeks > 1.15 * no_peeks, (peeks, ungated, no_peeks)
    # a drafter that is never right: the peeks' extra row costs within the gate's bound
    assert run(True, True, copies=False) >= 0.97 * 200


def test_cost_gate_learns_across_short_sequences_that_an_expensive_drafter_loses():
    # Each drafting step costs 10x a plain one and yields nothing more; 80 requests of 50 steps each.
    gate, now, tokens, drafted = CostGate(), 0.0, 0, 0
    for request in range(80):
        for _ in range(50):
            drafting = gate.begin(request, now)
            now += 0.050 if drafting else 0.005
            gate.tokens(request, 1)
            tokens += 1
            drafted += drafting
        gate.release(request)
    assert tokens / now >= 0.97 * 200, (tokens / now, drafted)  # within 3% of plain's 200 tok/s
    assert drafted >= 2  # it did measure


def test_cost_gate_keeps_a_paying_sequence_drafting_beside_one_that_does_not():
    # "fast" drafts for 1 ms and gets 3 tokens a step; after 20 steps "slow" joins, drafting for
    # 40 ms and gaining nothing. One engine step serves both; the forward they share takes 6 ms.
    gate, now = CostGate(), 0.0
    drafted = {"slow": 0, "fast": 0}
    costs = {"slow": (0.040, 1), "fast": (0.001, 3)}
    for i in range(320):
        step = {}
        for key in (["fast"] if i < 20 else ["fast", "slow"]):
            step[key] = gate.begin(key, now)
            if step[key]:
                gate.spent(key, costs[key][0])
                now += costs[key][0]
            if i >= 20:
                drafted[key] += step[key]
        now += 0.006
        for key, drafting in step.items():
            gate.tokens(key, costs[key][1] if drafting else 1)
    assert drafted["fast"] >= 0.9 * 300, drafted  # not stopped by its neighbour's cost
    assert drafted["slow"] <= 0.1 * 300, drafted


def test_cost_gate_lets_one_sequence_probe_at_a_time_while_drafting_loses():
    # 8 sequences decode together; drafting costs 10x a plain step for nothing. Once the first
    # batch has learned it, the instance probes about once a wait, not once per sequence.
    gate, now, drafted = CostGate(), 0.0, []
    for batch, steps in enumerate((100, 800, 800)):
        keys = [(batch, k) for k in range(8)]
        for _ in range(steps):
            spent = 0.0
            for key in keys:
                if gate.begin(key, now):
                    gate.spent(key, 0.045)
                    spent += 0.045
                    drafted.append(key)
            now += spent + 0.005
            for key in keys:
                gate.tokens(key, 1)
        for key in keys:
            gate.release(key)
    later = [key for key in drafted if key[0] >= 1]
    # 12,800 sequence-steps over a wait of about 3,700: at most 4 probes of 3 steps (not 8 per probe)
    assert 3 <= len(later) <= 4 * 3, len(later)


def test_steps_that_also_feed_a_prompt_teach_the_gates_nothing(monkeypatch):
    """Under steady load a new request's prompt is fed beside the decoding rows about one step in ten,
    at many times a decode step's cost: timed, those steps would sink whichever kind of step they
    fell on. The engine says so in DraftLimits.prefilling, and neither the step gate nor a
    sequence's gate learns from them."""
    import types

    import outrider_speculative.strategy as strategy_module

    clock = [0.0]
    monkeypatch.setattr(strategy_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    strategy = SpeculativeStrategy(SpeculativeConfig.from_section({"drafters": ["ngram"], "prob_threshold": 0.0}))
    strategy.attach()
    sequences = [Seq([1, 2, 3] * 4), Seq([4, 5, 6] * 4)]
    for step in range(1, 121):
        prefilling = 1 if step % 5 == 0 else 0
        for seq in sequences:
            tree = strategy.propose(seq, DraftLimits(8, 3, step, prefilling))
            strategy.observe(seq, StepOutcome("decode", len(tree), 0, [seq.token_ids[-1]]))
        clock[0] += 0.5 if prefilling else 0.01  # a step beside a prompt costs 50 decode steps
    gates = [strategy.step_gate._state[("streams", 3)]]
    gates += [strategy.gates["greedy"]._state[seq.seq_id] for seq in sequences]
    seconds = [gate[kind] for gate in gates for kind in ("draft_s", "plain_s") if gate[kind] is not None]
    assert len(seconds) >= 3 and max(seconds) == pytest.approx(0.01), seconds


def test_the_cost_gate_stops_a_slow_useless_drafter_in_the_engine():
    """A drafter that sleeps 20 ms and is never right: the engine asks it on few steps, output unchanged."""
    import time as _time

    from outrider.generation.engine import GenerationEngine
    from outrider.serving.request import PendingRequest

    class SlowWrong:
        name = "slow"
        calls = 0

        def propose(self, seq, budget):
            SlowWrong.calls += 1
            _time.sleep(0.02)
            return SpecTree([int(seq.token_ids[-1]) ^ 1], [-1], [1.0])  # rarely the target's next token

    from outrider_llm.loading import tiny_random_llama
    from test_generate import CharTokenizer

    model, tokenizer = tiny_random_llama(vocab_size=16, hidden_size=32, num_layers=2, seed=3), CharTokenizer(16)
    outputs = {}
    for gated in (False, True):
        config = SpeculativeConfig.from_section({"drafters": ["slow"], "prob_threshold": 0.0, "cost_gate": gated})
        strategy = SpeculativeStrategy(config)
        strategy.bind_registry({"slow": lambda model, options, context: SlowWrong()})
        strategy.attach(model, tokenizer)
        engine = GenerationEngine(model, tokenizer, strategy, max_sequences=1, max_length=256)
        finals = []
        request = PendingRequest(b"r", 1, "generate", "t", {}, {"prompt": "abcabcabc", "max_tokens": 120},
                                 lambda r, kind, header, out: finals.append(header) if kind != "chunk" else None)
        SlowWrong.calls = 0
        engine.admit([request])
        while engine.busy():
            engine.step()
        outputs[gated] = (finals[-1]["token_ids"], SlowWrong.calls, strategy.stats["gated_steps"])
    assert outputs[True][0] == outputs[False][0]
    assert outputs[False][1] >= 60 and outputs[False][2] == 0  # ungated: asked every step
    assert outputs[True][1] <= 20, outputs[True]  # gated: the first steps and the probes
    assert outputs[True][2] >= 60


@pytest.mark.parametrize("section, field", [
    ({"max_draft_tokens": 0}, "speculative.max_draft_tokens"),
    ({"max_draft_tokens": "16"}, "speculative.max_draft_tokens"),
    ({"min_draft_tokens": 20}, "speculative.min_draft_tokens"),
    ({"max_depth": True}, "speculative.max_depth"),
    ({"prob_threshold": 1.5}, "speculative.prob_threshold"),
    ({"max_children": 0}, "speculative.max_children"),
    ({"adaptive": "yes"}, "speculative.adaptive"),
    ({"drafters": []}, "speculative.drafters"),
    ({"drafters": ["ngram", "ngram"]}, "speculative.drafters"),
    ({"max_drafts": 3}, "speculative.max_drafts"),
    ({"ngram": 4}, "speculative.ngram"),
])
def test_bad_knobs_fail_naming_the_field(section, field):
    manifest = Manifest(name="m", backend="llm", speculative=section)
    with pytest.raises(ManifestError, match=f"m: field '{field}'"):
        SpeculativeStrategy.from_manifest(manifest)


def test_bad_drafter_names_and_options_fail_naming_the_field():
    strategy = SpeculativeStrategy.from_manifest(Manifest(name="m", backend="llm", speculative={"drafters": ["eagle"]}))
    with pytest.raises(ManifestError, match="field 'speculative.drafters': .*'eagle'"):
        strategy.bind_registry({"ngram": object})
    for options, field in [({"max_ngram": 0}, "max_ngram"), ({"min_ngram": 5, "max_ngram": 3}, "min_ngram"),
                           ({"maxngram": 3}, "maxngram")]:
        strategy = SpeculativeStrategy.from_manifest(Manifest(name="m", backend="llm", speculative={"ngram": options}))
        with pytest.raises(ManifestError, match=f"field 'speculative.ngram.{field}'"):
            strategy.attach()


def test_defaults_and_drafter_options():
    config = SpeculativeConfig.from_section({})
    assert (config.drafters, config.max_draft_tokens, config.max_depth, config.adaptive) == (("ngram",), 16, 8, True)
    strategy = SpeculativeStrategy.from_manifest(
        Manifest(name="m", backend="llm", speculative={"max_depth": 5, "ngram": {"max_ngram": 3}}))
    strategy.attach()
    (ngram,) = strategy.drafters
    assert (ngram.max_ngram, ngram.max_depth) == (3, 5)


def test_plugin_registers_the_accelerator_and_the_ngram_drafter():
    registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)
    assert ("decode_strategy", "speculative-decoding") in registry.accelerators
    assert {"ngram", "eagle"} <= set(registry.drafters)
    manifest = Manifest(name="m", backend="llm", speculative={"max_draft_tokens": 8})
    strategy = registry.accelerators_for(manifest, registry.backends["llm"])["speculative"]
    assert isinstance(strategy, SpeculativeStrategy) and strategy.config.max_draft_tokens == 8
    strategy.attach()
    assert [d.name for d in strategy.drafters] == ["ngram"]
    twin = strategy.for_instance()  # one per engine when a model runs several instances
    assert twin.config is strategy.config and not twin.attached and twin.factories == strategy.factories


def test_importing_the_plugin_imports_no_torch():
    code = "import sys, outrider_speculative; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)



def test_seeded_sampling_requests_follow_the_sampling_gates_verdict_not_the_greedy_ones():
    """A seeded request at T > 0 must not depend on timing: it drafts for its whole length only where
    the instance's *sampling* gate found drafting paying when it started. The greedy gate's verdict
    says nothing about T > 0 (fewer drafts are accepted there)."""
    config = SpeculativeConfig.from_section({"drafters": ["ngram"], "prob_threshold": 0.0})
    strategy = SpeculativeStrategy(config)
    strategy.attach()
    repeating = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]

    def seq(temperature: float, seed):
        view = Seq(repeating)
        view.params = SamplingParams(temperature=temperature, seed=seed)
        return view

    def drafts(view) -> int:
        return sum(len(strategy.propose(view, DraftLimits(8, 1, step))) for step in range(6))

    paying = {"known": True, "losing": False}
    strategy.gates["greedy"].shared.update(paying)
    seeded = seq(1.0, 7)
    assert drafts(seeded) == 0  # the sampling gate knows nothing yet: plain, whatever the greedy one says
    strategy.gates["sampling"].shared.update(paying)
    assert drafts(seeded) == 0  # decided at its start, for its whole length
    later = seq(1.0, 8)
    assert drafts(later) > 0
    strategy.gates["sampling"].shared.update(losing=True)
    assert drafts(later) > 0 and drafts(seq(1.0, 9)) == 0
    assert strategy._gate(seq(0.0, None)) is strategy.gates["greedy"]
    assert strategy._gate(seq(0.7, None)) is strategy.gates["sampling"]


class _TimedModel:
    """A model whose forward takes `base + per_row * rows` seconds on a simulated clock."""

    def __init__(self, clock: list, base: float, per_row: float) -> None:
        self.clock, self.base, self.per_row, self.rows_seen = clock, base, per_row, []

    def new_cache(self, num_slots: int, max_length: int):
        class Cache:
            def reset(self, slot: int) -> None:
                pass
        return Cache()

    def forward(self, cache, chunks):
        rows = len(chunks[0].tokens)
        self.rows_seen.append(rows)
        self.clock[0] += self.base + self.per_row * rows
        return type("Out", (), {"logits": np.zeros((rows, 4), np.float32)})()


def test_the_draft_budget_is_capped_where_verifying_it_costs_more_than_max_verify_cost(monkeypatch):
    """A step over 1 + k rows costs 1 + 0.05 k one-row steps here: 16 drafts 1.8x, 8 drafts 1.4x. The
    default cap (1.5) keeps 8; 2.0 keeps the configured 16; 0 measures nothing; below 1 is refused."""
    from outrider_speculative import verify_cost

    clock = [0.0]
    monkeypatch.setattr(verify_cost.time, "perf_counter", lambda: clock[0])
    cap, ratios = verify_cost.verify_cap(_TimedModel(clock, 0.0095, 0.0005), 16, 1.5)
    assert cap == 8 and ratios[16] == pytest.approx(1.8) and ratios[8] == pytest.approx(1.4)

    def attached(**knobs: Any) -> tuple[SpeculativeStrategy, _TimedModel]:
        model = _TimedModel(clock, 0.0095, 0.0005)
        strategy = SpeculativeStrategy(SpeculativeConfig.from_section({"drafters": ["ngram"], **knobs}))
        strategy.attach(model)
        return strategy, model

    strategy, _ = attached()
    assert strategy.controller.max_tokens == 8 and strategy.budget(Seq([1, 2, 3])) == 8
    assert strategy.verify_costs[16] == pytest.approx(1.8)
    assert attached(max_verify_cost=2.0)[0].controller.max_tokens == 16
    strategy, model = attached(max_verify_cost=0)
    assert strategy.controller.max_tokens == 16 and model.rows_seen == []
    # every row costs what a whole step costs: nothing fits, one draft token is left (the gate judges it)
    assert verify_cost.verify_cap(_TimedModel(clock, 0.0, 0.001), 16, 1.5)[0] == 1
    with pytest.raises(ManifestError, match="max_verify_cost.*at least 1"):
        SpeculativeConfig.from_section({"drafters": ["ngram"], "max_verify_cost": 0.5})


def test_a_step_of_several_sequences_verifies_only_the_draft_rows_it_can_afford(monkeypatch):
    """Rows cost 0.95 + 0.05 R one-row steps here (measured up to 17 rows, priced past them along
    the last segment). A step of 8 sequences (1.35) may add the rows that keep it within 1.5 times
    itself: 13; of 4, 11; of 1, 10. The engine's first sequences take their budgets, each spending
    what it drafted, and the rest draft what is left; a new step has all its rows again."""
    from outrider_speculative import verify_cost

    clock = [0.0]
    monkeypatch.setattr(verify_cost.time, "perf_counter", lambda: clock[0])
    strategy = SpeculativeStrategy(SpeculativeConfig.from_section({"drafters": ["ngram"], "cost_gate": False,
                                                                   "prob_threshold": 0.0}))
    strategy.attach(_TimedModel(clock, 0.0095, 0.0005))
    assert [strategy.step_draft_rows(n) for n in (1, 4, 8)] == [10, 11, 13]
    assert strategy._cheap_peek  # one draft row costs 1.05 steps: a gated sequence may peek (CostGate.peek)
    dear = SpeculativeStrategy(SpeculativeConfig.from_section({"drafters": ["ngram"]}))
    dear.attach(_TimedModel(clock, 0.0, 0.001))
    assert not dear._cheap_peek  # each row a whole step's cost: no peeks
    points = verify_cost.row_costs(strategy.verify_costs)
    assert verify_cost.cost_at(points, 33) == pytest.approx(0.95 + 0.05 * 33)
    # noise that timed more rows as cheaper does not make them so
    assert verify_cost.row_costs({1: 1.2, 2: 1.1, 4: 1.3}) == [(1, 1.0), (2, 1.2), (3, 1.2), (5, 1.3)]

    sequences = [Seq([1, 2, 3, 4, 5, 6, 7, 8, 9] * 3) for _ in range(8)]  # each repeats: the n-gram drafts its budget
    for step in (1, 2):
        sizes = [len(strategy.propose(seq, DraftLimits(64, 8, step))) for seq in sequences]
        assert sizes == [8, 5, 0, 0, 0, 0, 0, 0], sizes  # the cap (8) a sequence, 13 a step
    # without a measured cost (max_verify_cost 0) a step shares batch_draft_tokens as before
    free = SpeculativeStrategy(SpeculativeConfig.from_section({"drafters": ["ngram"], "cost_gate": False,
                                                               "prob_threshold": 0.0, "max_verify_cost": 0}))
    free.attach(_TimedModel(clock, 0.0095, 0.0005))
    assert [len(free.propose(seq, DraftLimits(64, 8, 1))) for seq in sequences] == [8] * 8


def test_a_group_whose_draw_has_no_probability_under_its_q_is_refused():
    """A drafter bug, not a request's: a draw q gives no mass to, or a token drawn twice from a group
    without replacement, fails verification with a clear error (the engine fails that request)."""
    from outrider.generation.contract import SampledChildren

    logits = np.array([[10.0, -30.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)  # p(1) ~ e^-40: rejected
    for draws, q in (([1, 1], [0.0, 1.0, 0.0, 0.0]), ([2], [0.0, 1.0, 0.0, 0.0])):
        tree = SpecTree()
        tree.tokens, tree.parents, tree.probs = [draws[0]], [-1], [1.0]
        tree.sampled[-1] = [SampledChildren(q=np.array(q, np.float32), draws=draws, replacement=False)]
        with pytest.raises(ValueError, match="no probability under its q"):
            verify(tree, logits, SamplingParams(temperature=1.0), new_generator(0))
