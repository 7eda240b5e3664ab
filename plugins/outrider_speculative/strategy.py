"""`SpeculativeStrategy`: what the generation engine asks each step, per sequence.

    strategy = SpeculativeStrategy.from_manifest(manifest)   # the accelerator factory
    strategy.bind_registry(registry)                         # core: drafter factories by name
    strategy.attach(model, tokenizer)                        # once the model is loaded
    strategy.start(seq)                                      # admitted (indexes the prompt)
    each step:
        share = strategy.batch_budget(len(active))
        tree = strategy.propose(seq, min(share, room))       # capped by seq's adaptive budget too
        ... one forward over [pending, *tree.tokens], tree.mask(), positions length + depth ...
        verdict = strategy.verify(tree, logits, seq.params, seq.generator)
        cache.commit(slot, verdict.keep()); emit verdict.emitted
        strategy.record(seq, len(tree), verdict.accepted_tokens)
        strategy.extend(seq, new_tokens)                     # after seq.token_ids grew
    strategy.finish(seq)                                     # ended or cancelled

`seq` is the engine's Sequence (the SequenceView drafters read); per-sequence state is keyed by
`seq.seq_id` when it has one, else by the object itself (drafters.sequence_key).

The budget has two parts. `batch_budget(n_active)` shares `batch_draft_tokens` among the active
sequences, because a full batch has no spare compute for tokens that will mostly be thrown away;
and a `BudgetController` keeps one budget per sequence, grown when most of the drafted depth is
accepted and shrunk when little is. `propose` applies the smaller of the two.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Hashable, Optional

import numpy as np

from outrider.errors import ManifestError
from outrider.generation.contract import DraftTree, DrafterContext

from .config import OptionError, SpeculativeConfig
from .drafters import make_ngram_drafter, sequence_key
from .tree import SpecTree, merge_trees, prune_tree
from outrider.generation.verify import Verdict, verify

log = logging.getLogger("outrider.speculative")

BUILTIN_DRAFTERS: dict[str, Callable[..., Any]] = {"ngram": make_ngram_drafter}


class BudgetController:
    """Draft tokens per sequence per step, adapted online to how much of the drafts is accepted.

    After each verification, r = accepted length / depth of the drafted tree feeds an EMA
    (weight `alpha`). EMA >= `grow_at`: the drafter was right most of the way, so the budget
    doubles (up to `max_tokens`); EMA <= `shrink_at`: most drafted tokens were wasted, so it
    halves (down to `min_tokens`, which keeps probing so that a sequence can recover).
    """

    def __init__(
        self,
        max_tokens: int,
        min_tokens: int = 2,
        batch_tokens: int = 64,
        adaptive: bool = True,
        alpha: float = 0.3,
        grow_at: float = 0.6,
        shrink_at: float = 0.3,
    ) -> None:
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.batch_tokens = batch_tokens
        self.adaptive = adaptive
        self.alpha = alpha
        self.grow_at = grow_at
        self.shrink_at = shrink_at
        self._budget: dict[Hashable, int] = {}
        self._ema: dict[Hashable, float] = {}

    def batch_budget(self, n_active: int) -> int:
        """The most draft tokens one sequence may get when `n_active` sequences share a step."""
        return min(self.max_tokens, self.batch_tokens // max(1, n_active))

    def budget(self, seq_id: Optional[Hashable], n_active: int = 1) -> int:
        """This sequence's draft budget for the next step."""
        own = self._budget.get(seq_id, self.max_tokens) if self.adaptive else self.max_tokens
        return min(own, self.batch_budget(n_active))

    def acceptance(self, seq_id: Hashable) -> Optional[float]:
        """The sequence's EMA of accepted length / drafted depth (None before any draft)."""
        return self._ema.get(seq_id)

    def observe(self, seq_id: Hashable, drafted_depth: int, accepted: int) -> None:
        """Learn from one verification of a tree `drafted_depth` deep, `accepted` tokens kept."""
        if not self.adaptive or drafted_depth <= 0:
            return  # nothing was drafted: nothing learned
        ratio = accepted / drafted_depth
        ema = self._ema.get(seq_id, 0.5)
        ema = (1 - self.alpha) * ema + self.alpha * ratio
        self._ema[seq_id] = ema
        budget = self._budget.get(seq_id, self.max_tokens)
        if ema >= self.grow_at:
            budget = min(self.max_tokens, max(budget * 2, budget + 1))
        elif ema <= self.shrink_at:
            budget = max(self.min_tokens, budget // 2)
        self._budget[seq_id] = budget

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence."""
        self._budget.pop(seq_id, None)
        self._ema.pop(seq_id, None)


class SpeculativeStrategy:
    """Draft with the configured drafters, verify losslessly, adapt the budget (see module doc)."""

    def __init__(self, config: Optional[SpeculativeConfig] = None, where: str = "manifest",
                 directory: Optional[Path] = None) -> None:
        self.config = config or SpeculativeConfig()
        self.where = where
        self.directory = directory  # the manifest's folder (drafter options' relative paths)
        self.controller = BudgetController(
            self.config.max_draft_tokens, self.config.min_draft_tokens,
            self.config.batch_draft_tokens, self.config.adaptive,
        )
        self.factories: dict[str, Callable[..., Any]] = dict(BUILTIN_DRAFTERS)
        self.drafters: list[Any] = []
        self.attached = False
        self.stats: dict[str, int] = {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0, "drafter_errors": 0}
        self._depth: dict[Hashable, int] = {}  # depth of each sequence's last proposal

    @classmethod
    def from_manifest(cls, manifest: Any) -> "SpeculativeStrategy":
        """Build from a manifest's `speculative` section (the accelerator factory)."""
        where = getattr(manifest, "source_file", None) or getattr(manifest, "name", "manifest")
        return cls(SpeculativeConfig.from_section(getattr(manifest, "speculative", None), where), where,
                   getattr(manifest, "directory", None))

    def for_instance(self) -> "SpeculativeStrategy":
        """A fresh, unattached strategy with the same knobs and drafter factories (one per engine)."""
        twin = SpeculativeStrategy(self.config, self.where, self.directory)
        twin.factories = dict(self.factories)
        return twin

    def bind_registry(self, registry: Any) -> None:
        """Take the drafter factories plugins registered; an unknown drafter name fails here."""
        self.factories = {**BUILTIN_DRAFTERS, **dict(getattr(registry, "drafters", registry) or {})}
        self._check_names()

    def _check_names(self) -> None:
        missing = [name for name in self.config.drafters if name not in self.factories]
        if missing:
            raise ManifestError(
                f"{self.where}: field 'speculative.drafters': no loaded plugin registers drafter "
                f"{missing[0]!r} (known: {sorted(self.factories)})"
            )

    def attach(self, model: Any = None, tokenizer: Any = None) -> None:
        """Make the configured drafters, `factory(model, options, context)` each, once the model is loaded."""
        self._check_names()
        drafters = []
        context = DrafterContext(tokenizer=tokenizer, directory=self.directory)
        for name in self.config.drafters:
            try:
                drafters.append(self.factories[name](model, self.config.options_for(name), context))
            except OptionError as exc:
                raise ManifestError(f"{self.where}: field 'speculative.{name}.{exc.field}': {exc.message}") from None
            except (TypeError, ValueError) as exc:
                raise ManifestError(f"{self.where}: field 'speculative.{name}': {exc}") from None
        self.drafters = drafters
        self.attached = True

    # -- per-sequence state ---------------------------------------------------------------

    def start(self, seq: Any) -> None:
        """A sequence was admitted: drafters may index its prompt now."""
        self._each_drafter("start", seq)

    def extend(self, seq: Any, new_tokens: Any) -> None:
        """Tokens were appended to `seq.token_ids`: drafters may update their state."""
        self._each_drafter("extend", seq, new_tokens)

    def finish(self, seq: Any) -> None:
        """A sequence ended or was cancelled: drop its budget and every drafter's state for it."""
        key = sequence_key(seq)
        if key is not None:
            self.controller.release(key)
            self._depth.pop(key, None)
        self._each_drafter("finish", seq)

    def _each_drafter(self, method: str, *args: Any) -> None:
        if not self.attached:
            self.attach()
        for drafter in self.drafters:
            hook = getattr(drafter, method, None)
            if hook is not None:
                hook(*args)

    # -- budget ---------------------------------------------------------------------------

    def batch_budget(self, n_active: int) -> int:
        """The most draft tokens one sequence may get when `n_active` sequences share a step."""
        return self.controller.batch_budget(n_active)

    def budget(self, seq: Any, n_active: int = 1) -> int:
        """Draft nodes for this sequence this step: its adaptive budget, capped by the batch share."""
        return self.controller.budget(sequence_key(seq), n_active)

    # -- one step ---------------------------------------------------------------------------

    def limit_depth(self, tree: DraftTree, max_depth: int) -> DraftTree:
        """Drop nodes deeper than `max_depth` (room left in the context or in max_tokens)."""
        depths = tree.depths()
        if not depths or max(depths) <= max_depth:
            return tree
        return prune_tree(tree, len(tree), max_depth)

    def propose(self, seq: Any, budget: Optional[int] = None) -> SpecTree:
        """Ask every drafter, merge, and cut to the budget, depth, threshold and fan-out caps."""
        if not self.attached:
            self.attach()
        key = sequence_key(seq)
        own = self.controller.budget(key)
        budget = own if budget is None else min(budget, own)
        tree = SpecTree()
        if budget > 0:
            trees: list[DraftTree] = []
            for drafter in self.drafters:
                try:
                    trees.append(drafter.propose(seq, budget))
                except Exception:  # a drafter bug costs speed, never a request: an empty draft is valid
                    self.stats["drafter_errors"] += 1
                    log.exception("drafter %r failed; drafting without it", getattr(drafter, "name", drafter))
            trees = [t for t in trees if len(t)]
            if trees:
                merged = trees[0] if len(trees) == 1 else merge_trees(*trees)
                cfg = self.config
                tree = prune_tree(merged, budget, cfg.max_depth, cfg.prob_threshold, cfg.max_children)
        if key is not None:
            self._depth[key] = max(tree.depths(), default=0)
        return tree

    def verify(
        self, tree: DraftTree, logits: np.ndarray, params: Any, generator: np.random.Generator,
        adjust: Any = None,
    ) -> Verdict:
        """The lossless verdict on `tree` (verify.verify, rows adjusted by the request's rules), counted in `stats`."""
        verdict = verify(tree, logits, params, generator, adjust)
        self.stats["steps"] += 1
        self.stats["draft_tokens"] += verdict.draft_tokens
        self.stats["accepted_tokens"] += verdict.accepted_tokens
        return verdict

    def record(self, seq: Any, draft_tokens: int, accepted_tokens: int) -> None:
        """Feed one step's outcome to the sequence's adaptive budget."""
        key = sequence_key(seq)
        if key is None or draft_tokens <= 0:
            return
        depth = self._depth.get(key) or draft_tokens
        self.controller.observe(key, min(depth, draft_tokens), accepted_tokens)
