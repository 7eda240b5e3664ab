"""`SpeculativeStrategy`: what the generation engine asks each step, per sequence.

    strategy = SpeculativeStrategy.from_manifest(manifest)   # the accelerator factory
    strategy.bind_registry(registry)                         # core: drafter factories by name
    strategy.attach(model, tokenizer)                        # once the model is loaded
    strategy.start(seq)                                      # admitted (indexes the prompt)
    each step, for the decoding sequences:
        trees = strategy.propose_batch([(seq, DraftLimits(room, n_active, step)), ...])
        ... the engine: one forward over each [pending, *tree.tokens], verify.verify, commit, emit ...
        strategy.observe(seq, StepOutcome(phase, drafted, accepted, new_tokens))
    strategy.finish(seq)                                     # ended or cancelled

`seq` is the engine's Sequence (the SequenceView drafters read); per-sequence state is keyed by
`seq.seq_id` (drafters.sequence_key).

`propose` is the one place the draft budget is decided: the smallest of the sequence's adaptive
budget (a `BudgetController`, grown when most of the drafted depth is accepted and shrunk when
little is, up to `max_draft_tokens` as capped at attach where verifying it costs more than
`max_verify_cost` one-row steps: verify_cost.py), its share of `batch_draft_tokens` among the `n_active` sequences of the step (a full
batch has no spare compute for tokens that will mostly be thrown away), what is left of the step's
draft rows (the rows a step of `n_active` sequences can add within `max_verify_cost` of itself, by
the same measurement: taken in the engine's order, each sequence's proposal spending what it
drafted), and nothing at all when a `CostGate` finds drafting slower than plain for the sequence
or for the step; the tree is also cut to `room` deep.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Optional

from outrider.errors import ManifestError
from outrider.manifest import Manifest
from outrider.generation.contract import DraftLimits, DraftTree, DrafterContext, StepOutcome, check_drafter
from outrider.generation.sampling import is_greedy

from .config import OptionError, SpeculativeConfig
from .cost_gate import TOLERANCE, CostGate
from .drafters import make_ngram_drafter, sequence_key
from .tree import SpecTree, merge_trees, prune_tree
from .verify_cost import affordable_drafts, row_costs, verify_cap

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

    def cap(self, max_tokens: int) -> None:
        """Lower the most draft tokens a sequence may get (the measured verify cost's cap)."""
        self.max_tokens = max(1, min(self.max_tokens, max_tokens))  # budget() caps every sequence by it
        self.min_tokens = min(self.min_tokens, self.max_tokens)

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence."""
        self._budget.pop(seq_id, None)
        self._ema.pop(seq_id, None)


def _seeded(seq: Any) -> bool:
    """A sampling request with a seed: its output must not depend on timing, so the gate decides for
    it once, at its start (at T = 0 the output never depends on the drafts)."""
    return seq.params.seed is not None and not is_greedy(seq.params.temperature)


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
        # Greedy and sampling sequences gain differently from the same drafts (at T > 0 fewer are
        # accepted): each kind has its own gate, and its own instance verdict.
        clock = [0.0]
        self.gates = {kind: CostGate(clock=clock) for kind in ("greedy", "sampling")} if self.config.cost_gate else None
        # Several streams share a step, and one sequence's draft rows make the step slower for all:
        # whether drafting pays is then judged on the whole step's tokens per second, per stream count.
        # Its keys are stream counts, not sequences: no drafter's one-time work falls on a key's first step.
        self.step_gate = CostGate(setup_steps=0) if self.config.cost_gate else None
        self._step_key: Optional[tuple] = None  # this step's key in step_gate, None when not judged
        self._step_drafts = True  # step_gate's verdict for this step
        self._step: Optional[int] = None  # the engine's step number the above belong to
        self._seeded_drafts: dict[Hashable, bool] = {}  # seeded sampling sequences: draft or not, fixed
        self.factories: dict[str, Callable[..., Any]] = dict(BUILTIN_DRAFTERS)
        self.drafters: list[Any] = []
        self.attached = False
        self.stats: dict[str, int] = {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0, "drafter_errors": 0,
                                      "gated_steps": 0}
        self._depth: dict[Hashable, int] = {}  # depth of each sequence's last proposal
        self.verify_costs: dict[int, float] = {}  # draft tokens -> a verifying step's cost in one-row steps
        self._cheap_peek = False  # one draft row measured as cheap: a gated sequence may peek (CostGate.peek)
        self._row_costs: list[tuple[int, float]] = []  # (rows, cost in one-row steps), from verify_costs
        self._step_rows: dict[int, int] = {}  # n_active -> draft rows a step of that many may add
        self._rows_left = self.config.batch_draft_tokens  # of this step's draft rows
        self._step_seqs: set = set()  # the sequences that proposed in this step

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> "SpeculativeStrategy":
        """Build from a manifest's `speculative` section (the accelerator factory)."""
        where = manifest.where
        return cls(SpeculativeConfig.from_section(manifest.section("speculative"), where), where, manifest.directory)

    def for_instance(self) -> "SpeculativeStrategy":
        """A fresh, unattached strategy with the same knobs and drafter factories (one per engine)."""
        twin = SpeculativeStrategy(self.config, self.where, self.directory)
        twin.factories = dict(self.factories)
        return twin

    def bind_registry(self, registry: Mapping[str, Callable[..., Any]]) -> None:
        """Take the drafter factories plugins registered ({name: factory}); an unknown drafter name fails here."""
        self.factories = {**BUILTIN_DRAFTERS, **registry}
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
                drafter = self.factories[name](model, self.config.options_for(name), context)
                # The registration-time check of the Drafter contract: later calls read its members plainly.
                check_drafter(drafter, f"the factory registered as drafter {name!r}")
                drafters.append(drafter)
            except OptionError as exc:
                raise ManifestError(f"{self.where}: field 'speculative.{name}.{exc.field}': {exc.message}") from None
            except (TypeError, ValueError) as exc:
                raise ManifestError(f"{self.where}: field 'speculative.{name}': {exc}") from None
        self.drafters = drafters
        if model is not None and self.config.max_verify_cost > 0:
            self._cap_budget(model)
        self.attached = True

    def _cap_budget(self, model: Any) -> None:
        """Measure what verifying drafts costs on `model` (verify_cost.py) and cap the budget there."""
        limit, budget = self.config.max_verify_cost, self.controller.max_tokens
        try:
            cap, ratios = verify_cap(model, budget, limit)
        except Exception as exc:  # a model that cannot be timed so keeps the configured budget
            log.warning("speculative: could not time verification on this model (%s: %s); max_draft_tokens "
                        "stays %d", type(exc).__name__, exc, budget)
            return
        self.verify_costs = ratios
        # a peek's one draft row, taken every other waiting step at most, must cost the step at most
        # twice the gate's tolerance (6% of a plain step; Gemma 3 270M measured 1.00-1.05x, SmolLM2
        # 0.97-1.04x, the 3B Q4_0 about 1.07x)
        self._cheap_peek = ratios.get(1, 2.0) <= 1.0 + 2 * TOLERANCE
        self._row_costs, self._step_rows = row_costs(ratios), {}
        log.info("speculative: a step verifying drafts costs (one row = 1x) %s; max_draft_tokens %d -> %d "
                 "(max_verify_cost %.2g)", ", ".join(f"{k} drafts {r:.2f}x" for k, r in sorted(ratios.items())),
                 budget, cap, limit)
        self.controller.cap(cap)

    # -- per-sequence state ---------------------------------------------------------------

    def start(self, seq: Any) -> None:
        """A sequence was admitted: drafters may index its prompt now."""
        self._each_drafter("start", seq)

    def observe(self, seq: Any, outcome: StepOutcome) -> None:
        """What a step did to `seq` (its new tokens already appended): the gates and the adaptive
        budget learn from a drafted step, every drafter hears of every step."""
        if outcome.drafted > 0:
            self.stats["steps"] += 1
            self.stats["draft_tokens"] += outcome.drafted
            self.stats["accepted_tokens"] += outcome.accepted
        if outcome.phase == "decode":  # not the prefill, nor the grammar's forced tokens
            self._learn(seq, outcome.drafted, outcome.accepted)
        self._each_drafter("observe", seq, outcome)

    def finish(self, seq: Any) -> None:
        """A sequence ended or was cancelled: drop its budget and every drafter's state for it."""
        key = sequence_key(seq)
        if key is not None:
            self.controller.release(key)
            self._depth.pop(key, None)
            if self.gates is not None:
                for gate in self.gates.values():
                    gate.release(key)
            self._seeded_drafts.pop(key, None)
        self._each_drafter("finish", seq)

    def _each_drafter(self, method: str, *args: Any) -> None:
        if not self.attached:
            self.attach()
        for drafter in self.drafters:
            hook = getattr(drafter, method, None)  # start/observe/finish: optional Drafter hooks
            if hook is not None:
                hook(*args)

    def _gate(self, seq: Any) -> Optional[CostGate]:
        """The cost gate of `seq`'s kind (greedy or sampling), None when the gate is off."""
        if self.gates is None:
            return None
        return self.gates["greedy" if is_greedy(seq.params.temperature) else "sampling"]

    def _instance_drafts(self) -> bool:
        """Whether the instance's sampling gate has found drafting paying (unseeded sampling requests
        teach it); until it has, seeded sampling requests decode plain, which is never slower."""
        gate = self.gates["sampling"] if self.gates is not None else None
        return gate is None or (gate.shared["known"] and not gate.shared["losing"])

    # -- budget ---------------------------------------------------------------------------

    def _begin_step(self, limits: DraftLimits, share: int) -> None:
        """The first proposal of an engine step: with several streams, close the last step's
        timing and ask the step gate whether this one drafts."""
        previous, self._step = self._step, limits.step
        self._step_drafts = True
        self._rows_left = self.step_draft_rows(limits.n_active)
        self._step_seqs.clear()
        if self.step_gate is None:
            return
        now = time.perf_counter()
        if self._step_key is not None:
            if previous is not None and limits.step == previous + 1:
                self.step_gate.end(self._step_key, now)
            else:  # steps without proposals came between: not one step's time
                self.step_gate.forget_step(self._step_key)
        self._step_key = None
        if limits.n_active >= 2 and min(share, self._rows_left) > 0:
            self._step_key = ("streams", limits.n_active)
            # A losing step still lets seeded sampling requests draft, for reproducibility.
            # A prompt fed beside the decoding rows costs the step many times a decode step: timed,
            # it would sink whichever kind of step it fell on (in steady serving, a step in ten).
            self._step_drafts = self.step_gate.begin(self._step_key, now, timed=not limits.prefilling)

    def step_draft_rows(self, n_active: int) -> int:
        """Draft rows a step of `n_active` sequences may verify: `batch_draft_tokens`, and where the
        verify cost was measured, no more than keep the step within `max_verify_cost` of itself.
        Why: with several streams the step's rows are already many, so a draft row costs more of the
        step than it does beside one sequence (Gemma 3 270M, 8 streams: 1-2 draft tokens a sequence
        gained 1.15-1.26x plain, the default budget 0.96-1.04x; tools/bench_gate.py --streams 8)."""
        most = self.config.batch_draft_tokens
        if not self._row_costs:
            return most
        rows = self._step_rows.get(n_active)
        if rows is None:
            rows = affordable_drafts(self._row_costs, max(1, n_active), self.config.max_verify_cost, most)
            if n_active <= 1:  # alone, at least the one draft token the cap leaves (the gate judges it)
                rows = max(rows, min(1, most))
            self._step_rows[n_active] = rows
        return rows

    def budget(self, seq: Any, n_active: int = 1) -> int:
        """Draft nodes for this sequence this step: its adaptive budget, capped by the batch share."""
        return self.controller.budget(sequence_key(seq), n_active)

    # -- one step ---------------------------------------------------------------------------

    def propose(self, seq: Any, limits: DraftLimits) -> SpecTree:
        """Decide this step's budget, ask every drafter, merge, and cut to the budget, `limits.room`
        deep, the probability threshold and the fan-out cap."""
        return self.propose_batch([(seq, limits)])[0]

    def propose_batch(self, items: list[tuple[Any, DraftLimits]]) -> list[SpecTree]:
        """`propose` for the step's decoding sequences, in the engine's order. Drafters with a
        `propose_batch` of their own (a draft model) are asked once for all the sequences that
        draft, so their forwards serve every sequence at once; the others are asked per sequence.
        Such a drafter's rows are reserved at each sequence's full budget while the step's rows are
        shared out, and what it leaves unspent is handed back after it answers."""
        if not self.attached:
            self.attach()
        together = [d for d in self.drafters if callable(getattr(d, "propose_batch", None))] if len(items) > 1 else []
        alone = [d for d in self.drafters if not any(d is t for t in together)]
        trees = [SpecTree() for _ in items]
        waiting: list[tuple[int, int, list[DraftTree], float]] = []  # (item, budget, its trees, seconds spent)
        for index, (seq, limits) in enumerate(items):
            budget = self._budget_of(seq, limits)
            if budget is None:
                continue
            drafted: list[DraftTree] = []
            started = time.perf_counter()
            if budget > 0:
                for drafter in alone:
                    drafted.extend(self._asked(drafter, lambda d: [d.propose(seq, budget)], 1))
            spent = time.perf_counter() - started
            if budget > 0 and together:
                self._rows_left -= budget  # reserved until the drafters that serve the batch answer
                waiting.append((index, budget, drafted, spent))
            else:
                trees[index] = self._proposed(seq, limits, budget, drafted, spent)
        if waiting:
            started = time.perf_counter()
            asks = [(items[index][0], budget) for index, budget, _, _ in waiting]
            answers = [self._asked(drafter, lambda d: d.propose_batch(asks), len(asks)) for drafter in together]
            shared = (time.perf_counter() - started) / len(waiting)  # each sequence's part of the batch's time
            for j, (index, budget, drafted, spent) in enumerate(waiting):
                self._rows_left += budget
                drafted += [answer[j] for answer in answers if answer]
                trees[index] = self._proposed(items[index][0], items[index][1], budget, drafted, spent + shared)
        return trees

    def _asked(self, drafter: Any, ask: Callable[[Any], Any], count: int) -> list[DraftTree]:
        """What `ask(drafter)` proposed (`count` trees), or nothing: a drafter bug costs speed, never
        a request, as an empty draft is valid."""
        try:
            trees = list(ask(drafter))
            if len(trees) != count:
                raise ValueError(f"{len(trees)} drafts for {count} sequences")
            return trees
        except Exception:
            self.stats["drafter_errors"] += 1
            log.exception("drafter %r failed; drafting without it", drafter.name)
            return []

    def _budget_of(self, seq: Any, limits: DraftLimits) -> Optional[int]:
        """This step's draft nodes for `seq` (0: gated), or None where it has no rows or room at all
        (then nothing of it is timed or counted)."""
        key = sequence_key(seq)
        gate = self._gate(seq)
        share = self.controller.batch_budget(limits.n_active)
        if limits.step != self._step or key in self._step_seqs:  # a sequence proposes once a step
            self._begin_step(limits, share)
        self._step_seqs.add(key)
        budget = min(share, self._rows_left, self.controller.budget(key))
        if budget <= 0 or limits.room <= 0:
            if gate is not None and key is not None:
                gate.forget_step(key)  # no rows left for it: not the sequence's choice, not timed
            return None
        if _seeded(seq):
            # A seeded sampling request's output must not depend on timing: it follows the instance's
            # verdict as it stood when the request started, for its whole length.
            if key is not None and not self._seeded_drafts.setdefault(key, self._instance_drafts()):
                budget = 0
                self.stats["gated_steps"] += 1
        elif not self._step_drafts:
            budget = 0  # drafting does not pay on this step now
            self.stats["gated_steps"] += 1
        elif gate is not None and key is not None and not gate.begin(key, time.perf_counter(),
                                                                     timed=not limits.prefilling):
            # Drafting does not pay on this sequence now; one cheap draft token may still look for
            # the start of a burst (CostGate.peek) where verifying it costs the step next to nothing.
            budget = 1 if self._cheap_peek and gate.peek(key) else 0
            self.stats["gated_steps"] += 1
        return budget

    def _proposed(self, seq: Any, limits: DraftLimits, budget: int, drafted: list[DraftTree],
                  seconds: float) -> SpecTree:
        """The drafters' trees merged and cut to the budget, `limits.room` deep, the probability
        threshold and the fan-out cap; the step's rows and the gate told what it cost."""
        key = sequence_key(seq)
        tree = SpecTree()
        if budget > 0:
            drafted = [t for t in drafted if len(t)]
            if drafted:
                merged = drafted[0] if len(drafted) == 1 else merge_trees(*drafted)
                cfg = self.config
                tree = prune_tree(merged, budget, min(cfg.max_depth, limits.room), cfg.prob_threshold,
                                  cfg.max_children)
            gate = self._gate(seq)
            if gate is not None and key is not None:
                gate.spent(key, seconds)
                gate.proposed(key, len(tree))
        self._rows_left -= len(tree)
        if key is not None:
            self._depth[key] = max(tree.depths(), default=0)
        return tree

    def _learn(self, seq: Any, draft_tokens: int, accepted_tokens: int) -> None:
        """Feed one decode step's outcome to the gates and the sequence's adaptive budget."""
        key = sequence_key(seq)
        if self._step_key is not None:
            self.step_gate.tokens(self._step_key, accepted_tokens + 1)
        gate = self._gate(seq)
        if key is not None and gate is not None:
            if self._step_key is not None and not self._step_drafts:
                gate.forget_step(key)  # not this sequence's choice: a plain step of the whole batch
            else:
                gate.tokens(key, accepted_tokens + 1)
        if key is None or draft_tokens <= 0:
            return
        depth = self._depth.get(key) or draft_tokens
        self.controller.observe(key, min(depth, draft_tokens), accepted_tokens)
