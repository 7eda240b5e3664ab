"""The lossless accept rule: which drafted tokens the target keeps, and the token it adds.

Input: a draft tree, the target's logits for [pending token, node 0, node 1, ...] (row 0 is the
distribution of the pending token's children, row i+1 that of node i's children), the request's
sampling knobs and its generator. Output: a `Verdict` (accepted path, root first, and the bonus
token the target samples after it).

Both paths use the target as plain decoding defines it (`outrider.generation.sampling`): greedy is
`numpy.argmax` (the first maximal index; `greedy_token` is the same call), and sampling draws
from `target_distribution` (temperature, top_k, top_p, renormalized) with `sampling.draw`.
Losslessness is relative to that one function, so it must stay the only definition.

Greedy (temperature 0): from the root, descend into the child whose token is the argmax of the
current row; the bonus is the argmax of the last row reached. This is exactly plain greedy
decoding, whatever the tree.

Sampling: at each reached node, with p = target_distribution(row), the node's candidates are
tried one after another. A candidate c proposed from distribution q is accepted with probability
min(1, p(c) / q(c)); on rejection p <- normalize(max(0, p - q)), and the next candidate is
tried against that residual (kept unnormalized with its total: the same ratios, without a pass
over the vocabulary to divide). The first accepted candidate is descended into; if all are rejected
the bonus is drawn from the final residual; at a leaf it is drawn from the leaf's p.

- A deterministic candidate (chosen by a rule) has q = one-hot(c): accept with p(c), else zero
  p(c) and renormalize. Given the candidates, this outputs exactly p and accepts one of them
  with probability sum(p(c_i)), whatever their order and however they were chosen. So a tree
  that lost its sampled groups (a plain DraftTree copy) is still verified losslessly; it only
  accepts less than with its q (sum min(p, q) instead of sum q p per draw).
- Sampled candidates (SpecTree.sampled) use their q; after a rejection without replacement the
  group's q also loses the drawn token (q <- normalize(q with q(c) = 0)), because that is what
  the next draw came from (Sequoia). Sampled groups go first, then the deterministic children,
  which may thus depend on what was sampled without breaking the rule.

Each step is a speculative-sampling step with a proposal fixed before its own uniform draw, so by
induction every emitted token is distributed exactly as the target's. Nothing here looks at the
drafter's probabilities, thresholds or budgets.

What a drafter must respect for that induction to hold (verify.py cannot check it): the draws
recorded in a group are *all* the draws made from its q for that parent, in draw order, from a
q fixed before the first of them (a draw left out, or a group kept only when its draws look
good, conditions the later draws on something the rule does not know). Draws whose node was
pruned stay in `draws`. The randomness of drafting and of this rule may share the request's
generator: the draws are made before any uniform here is drawn.

Near-ties, by design: "identical to plain decoding" is relative to the logits of the forward
that verifies. The engine computes a step's logits in one batched forward over the pending
token and the tree (other matmul shapes, a tree mask, other sequences in the batch), where plain
decoding feeds one token; the two agree to floating-point rounding (about 1e-6 relative in fp32,
more with bf16 or quantized kernels), not bit for bit. When the two best logits of a row are
closer than that, the argmax can differ between the two forwards, and greedy output with and
without speculation then parts from that token on. Neither forward is the more correct one
(plain decoding is not bit-reproducible across batch compositions either). What is guaranteed:
every emitted token is exactly the argmax (T = 0), or exactly distributed as
`target_distribution` (T > 0), of the verifying forward's logits for exactly the tokens emitted
before it; greedy identity with plain decoding holds wherever the top two logits are further
apart than the forwards' rounding difference. The tests check exact identity, and the SmolLM2
test accepts a divergence only at a position whose top-two gap is below that tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from .contract import DraftTree
from .sampling import draw, host_array, is_greedy, new_generator, target_distribution  # the definitions plain sampling uses too

from .contract import children_of, sampled_groups


def sampling_knobs(params: Any) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) from a SamplingParams-like object or a mapping."""

    def get(name: str, default: Any) -> Any:
        value = params.get(name, default) if isinstance(params, dict) else getattr(params, name, default)
        return default if value is None else value

    return float(get("temperature", 0.0)), int(get("top_k", 0)), float(get("top_p", 1.0))


def uniform(generator: Optional[np.random.Generator]) -> float:
    """One U[0, 1) draw from the request's generator (None: fresh OS entropy)."""
    return float((generator if generator is not None else new_generator()).random())


def sample_from(probs: np.ndarray, generator: np.random.Generator) -> int:
    """One token from (unnormalized) probabilities, drawn as plain sampling draws (`sampling.draw`)."""
    return draw(probs, generator)


@dataclass
class Verdict:
    """What one verification keeps: the accepted path and the target's own next token."""

    accepted: list[int] = field(default_factory=list)  # node indices, root first
    tokens: list[int] = field(default_factory=list)  # their tokens
    bonus: int = -1  # the token after the accepted path, from the target
    draft_tokens: int = 0  # nodes in the verified tree

    @property
    def accepted_tokens(self) -> int:
        """How many drafted tokens were accepted."""
        return len(self.accepted)

    @property
    def emitted(self) -> list[int]:
        """Tokens this step adds to the sequence: the accepted path, then the bonus."""
        return self.tokens + [self.bonus]

    def keep(self) -> list[int]:
        """Chunk indices to commit in the KV cache: the pending token, then the accepted path."""
        return [0] + [i + 1 for i in self.accepted]


#: Row logits as the request's rules make them (constraints.TokenRules.apply): `adjust(row, path)`,
#: `path` = the tokens emitted before this row in this step. Called once per row reached, in order,
#: so call j gives the row emitted token j is drawn from.
Adjust = Callable[[np.ndarray, list[int]], np.ndarray]


def verify(tree: DraftTree, logits: np.ndarray, params: Any, generator: np.random.Generator,
           adjust: Optional[Adjust] = None) -> Verdict:
    """Greedy verification at temperature 0, lossless speculative sampling otherwise.

    With `adjust`, each row reached is first adjusted for the path that reaches it (a grammar's
    mask, logit_bias, penalties): the target distribution is the adjusted one, as plain decoding
    samples from `adjust(row, [])`, so the rule stays lossless under the same rules."""
    logits = host_array(logits)
    if logits.ndim != 2 or logits.shape[0] != len(tree) + 1:
        raise ValueError(f"verify: expected logits of shape [1 + {len(tree)}, vocab], got {tuple(logits.shape)}")
    temperature, top_k, top_p = sampling_knobs(params)
    if is_greedy(temperature):  # the same threshold plain decoding uses
        return verify_greedy(tree, logits, adjust)
    return verify_sampling(tree, logits, temperature, top_k, top_p, generator, adjust)


def verify_greedy(tree: DraftTree, logits: np.ndarray, adjust: Optional[Adjust] = None) -> Verdict:
    """Follow the argmax through the tree; the bonus is the argmax of the last row reached."""
    # Without rules, every row's argmax at once (the same function as sampling.greedy_token).
    best = np.argmax(logits, axis=-1).tolist() if adjust is None else None
    children = children_of(tree)
    verdict = Verdict(draft_tokens=len(tree))
    node = -1
    while True:
        want = best[node + 1] if best is not None else int(np.argmax(adjust(logits[node + 1], list(verdict.tokens))))
        nxt = next((c for c in children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            verdict.bonus = int(want)
            return verdict
        verdict.accepted.append(nxt)
        verdict.tokens.append(int(want))
        node = nxt


def _without(weights: np.ndarray, mass: float, token: int) -> float:
    """Zero a rejected deterministic candidate in unnormalized p of total `mass`; the new total.
    Where the token held all the mass (the rest is zero, or rounding left only a trace), p is left
    as it is: renormalized, the point mass on `token` is what remains."""
    removed = float(weights[token])
    left = mass - removed
    if left <= mass * 1e-12:
        left = float(weights.sum()) - removed
        if left <= 0.0:
            return mass
    weights[token] = 0.0
    return left


def _residual(p: np.ndarray, mass: float, q: np.ndarray, q_mass: float) -> tuple[np.ndarray, float]:
    """After a rejected draw from q: mass x max(0, p / mass - q / q_mass) and its total, unnormalized;
    p as it is where nothing is left (p == q up to rounding)."""
    residual = np.maximum(p - q * (mass / q_mass), 0.0)
    residual_mass = float(residual.sum())
    return (residual, residual_mass) if residual_mass > 0 else (p, mass)


def verify_sampling(
    tree: DraftTree,
    logits: np.ndarray,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: np.random.Generator,
    adjust: Optional[Adjust] = None,
) -> Verdict:
    """Multi-candidate speculative sampling over the tree (see the module docstring).

    p and a group's q are kept unnormalized with their totals: a rejection updates a total instead
    of dividing the whole vocabulary again (at Gemma's 262,144 tokens each such pass costs about a
    tenth of a millisecond or more). The probabilities compared are the same ratios."""
    children = children_of(tree)
    groups = sampled_groups(tree)
    verdict = Verdict(draft_tokens=len(tree))
    node = -1
    while True:
        row = logits[node + 1] if adjust is None else adjust(logits[node + 1], list(verdict.tokens))
        target = target_distribution(row, temperature, top_k, top_p)
        kids = children[node]
        if not kids and node not in groups:  # a leaf: exactly plain sampling's draw
            verdict.bonus = sample_from(target, generator)
            return verdict
        p = target.astype(np.float64)
        mass = float(p.sum())
        child_of_token: dict[int, int] = {}
        for c in kids:
            child_of_token.setdefault(int(tree.tokens[c]), c)
        chosen: Optional[int] = None  # accepted token
        tried: set[int] = set()
        for group in groups.get(node, []):
            q = np.asarray(group.q, dtype=np.float64).clip(min=0)  # a copy: draws without replacement zero it
            q_mass = float(q.sum())
            for token in group.draws:
                if not q_mass > 0 or q[token] <= 0:
                    raise ValueError(f"verify: draw {token} has no probability under its q (node {node})")
                if uniform(generator) * q[token] * mass < p[token] * q_mass:  # u < (p / mass) / (q / q_mass)
                    chosen = token
                    break
                tried.add(token)
                p, mass = _residual(p, mass, q, q_mass)
                if not group.replacement:  # the next draw came from q without this token
                    q_mass -= q[token]
                    q[token] = 0.0
            if chosen is not None:
                break
        if chosen is None:
            for c in kids:
                token = int(tree.tokens[c])
                if token in tried:  # already rejected: its residual probability is 0
                    continue
                tried.add(token)
                if uniform(generator) * mass < p[token]:
                    chosen = token
                    break
                mass = _without(p, mass, token)
        if chosen is None:
            verdict.bonus = sample_from(p, generator)
            return verdict
        nxt = child_of_token.get(chosen)
        if nxt is None:  # an accepted draw whose node was pruned: it ends the step
            verdict.bonus = chosen
            return verdict
        verdict.accepted.append(nxt)
        verdict.tokens.append(chosen)
        node = nxt
