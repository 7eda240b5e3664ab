"""The draft-model drafter ("model"): a small model of the target's vocabulary drafts a tree.

    speculative:
      drafters: [model]
      model: {path: SmolLM2-135M-Q4_0.gguf}   # relative to the manifest's folder

Any model file the target's runtime can load (`CausalLM.load_draft_model`: on the llm backend's
native CPU runtime, any GGUF it serves) whose vocabulary is the target's: every token id below the
smaller vocabulary has the same text in both tokenizers, and the sizes differ by at most 128 ids
(padding), as llama.cpp's server checks its `--model-draft`. Anything else is refused at load,
naming the first id that differs.

State: the draft model has its own KV cache, one slot per sequence (LRU over `max_sequences`
slots: a sequence that lost its slot prefills the draft again). `propose` first feeds the draft
what the sequence gained since the last call (one forward, committed), whose last row gives the
distribution of the first drafted token; a long gap (the sequence decoded plain while drafting did
not pay) is bridged with its last `catch_up` tokens only.

`shape: chain` (the default): the draft's own continuation, one token a forward, each fed and
committed, so a draft of depth d costs d one-row forwards; the next step keeps the rows of the
tokens the target accepted and truncates the rest (llama.cpp's draft-simple, without re-feeding
the accepted tokens). It stops where the cumulative draft probability falls below
`prob_threshold` or at the step's budget, so its length follows the draft's confidence.
The sequences of one step draft together (`propose_batch`): their syncs in one forward, then one
forward per depth with a row for each chain still growing, not one per sequence and depth
(tests/test_draft_model.py counts them).

`shape: tree`: a best-first tree by cumulative draft probability (`tree.build_dynamic_tree`): wide
where the draft is unsure, deep where it is confident, cut at `prob_threshold`, up to `frontier`
nodes expanded per draft forward, the tree so far re-fed each forward with a tree mask,
uncommitted. Each re-fed row costs compute (at 135M about 0.85 ms a row on 2 cores), so this
pays only where rows are cheap next to the weights' bytes. A sliding-window draft (a ring cache,
which cannot truncate) always drafts trees.

Greedy requests get the draft's argmax (chain) or a node's top `max_children` tokens (tree) as
deterministic candidates; sampling requests get tokens drawn from the draft's q (its logits
through the request's temperature, top-k and top-p, the function the target's p comes from),
without replacement in a tree, recorded with q so the verifier accepts each draw with
min(1, p/q): lossless, and about sum min(p, q) accepted per draw.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Hashable, Mapping, Optional

import numpy as np

from outrider.generation.contract import Chunk, DrafterContext
from outrider.generation.sampling import SamplingParams, host_array, is_greedy, new_generator, target_distribution
from outrider.generation.verify import sampling_knobs

from .config import OptionError, path_drafter_options, read_bool, read_float, read_int
from .drafters import sequence_key
from .tree import SampledExpansion, SpecTree, build_dynamic_tree, sample_children

log = logging.getLogger("outrider.speculative")

OPTIONS = ("path", "max_depth", "max_children", "prob_threshold", "frontier", "sample", "max_sequences", "max_length",
           "catch_up", "shape")
VOCAB_SLACK = 128  # ids a draft's vocabulary may have more or fewer than the target's (llama.cpp's limit)
_FAR_BELOW = np.float32(-1e30)  # logit of a target id the draft has no row for: q = 0 there


class DraftModelDrafter:
    """Drafts with a small model of the target's vocabulary (see the module docstring)."""

    name = "model"

    def __init__(self, draft: Any, target_vocab: int, max_depth: int = 8, max_children: int = 4,
                 prob_threshold: float = 0.05, frontier: int = 8, sample: bool = True, max_sequences: int = 8,
                 max_length: int = 8192, catch_up: int = 16, shape: str = "chain") -> None:
        self.draft = draft
        self.target_vocab = target_vocab
        self.max_depth = max_depth
        self.max_children = max_children
        self.prob_threshold = prob_threshold
        self.frontier = frontier
        self.sample = sample
        self.catch_up = catch_up
        self.max_sequences = max_sequences
        self.cache = draft.new_cache(max_sequences, max_length)
        # A chain keeps its drafted rows and truncates what the target did not keep; a ring cache
        # cannot truncate, so a sliding-window draft drafts trees.
        self.shape = shape if self.cache.truncatable else "tree"
        self._chain: dict[int, list[int]] = {}  # slot -> drafted tokens committed after its covered ones
        self._rows: dict[int, int] = {}  # slot -> its cache rows when the covered tokens were committed
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # sequence -> draft cache slot, LRU first
        self._free = list(range(max_sequences))
        self._covered: dict[int, int] = {}  # slot -> sequence tokens it has seen (its cache may have holes)
        self._last: dict[int, int] = {}  # slot -> the last of those tokens
        self._root: dict[int, np.ndarray] = {}  # slot -> logits after its last committed token
        self._lock = threading.Lock()  # instance threads may share one drafter
        self.calls = 0  # draft forwards, for benchmarks
        self.seconds = 0.0  # spent in them

    # -- per-sequence slots ---------------------------------------------------------------

    def finish(self, seq: Any) -> None:
        """Free the sequence's slot (it ended or was cancelled)."""
        key = sequence_key(seq)
        with self._lock:
            slot = self._slots.pop(key, None) if key is not None else None
            if slot is not None:
                self._release(slot)

    def _release(self, slot: int) -> None:
        self.cache.reset(slot)
        self._covered.pop(slot, None)
        self._last.pop(slot, None)
        self._chain.pop(slot, None)
        self._rows.pop(slot, None)
        self._root.pop(slot, None)
        self._free.append(slot)

    def _slot(self, key: Optional[Hashable]) -> int:
        slot = self._slots.get(key) if key is not None else None
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        if not self._free:  # every slot taken: the least recently drafted sequence starts over later
            _, oldest = self._slots.popitem(last=False)
            self._release(oldest)
        slot = self._free.pop()
        if key is not None:
            self._slots[key] = slot
        return slot

    # -- the draft model's forwards ---------------------------------------------------------

    def _forward(self, chunks: list[Chunk], rows: list[int]) -> np.ndarray:
        """The logits of `rows` (indices into the chunks' tokens, concatenated) in the target's vocabulary."""
        started = time.perf_counter()
        logits = host_array(self.draft.forward(self.cache, chunks, logit_rows=np.asarray(rows, dtype=np.int64)).logits)
        self.calls += 1
        self.seconds += time.perf_counter() - started
        return self._in_target_vocab(np.asarray(logits, dtype=np.float32))

    def _in_target_vocab(self, logits: np.ndarray) -> np.ndarray:
        width = logits.shape[-1]
        if width == self.target_vocab:
            return logits
        if width > self.target_vocab:  # ids the target cannot emit: never drafted
            return np.ascontiguousarray(logits[:, :self.target_vocab])
        out = np.full((logits.shape[0], self.target_vocab), _FAR_BELOW, dtype=np.float32)
        out[:, :width] = logits
        return out

    def _sync(self, slot: int, tokens: list[int]) -> np.ndarray:
        """Commit what the sequence gained since the last call; the logits after its pending token."""
        chunk = self._sync_feed(slot, tokens)
        if chunk is None:
            return self._root[slot]
        return self._synced(slot, tokens, chunk, self._forward([chunk], [len(chunk.tokens) - 1])[0])

    def _sync_feed(self, slot: int, tokens: list[int]) -> Optional[Chunk]:
        """What the slot must be fed to have seen `tokens` (None: it has, and its root logits are kept).

        A gap longer than `catch_up` tokens (the sequence decoded plain while drafting did not pay)
        is bridged with its last `catch_up` tokens only, at their true positions: the draft's cache
        then has a hole, which costs draft quality, never correctness, and keeps a probe after a
        long plain stretch from prefilling the whole stretch in the draft."""
        n = len(tokens)
        have = self._covered.get(slot, 0)
        chain = self._chain.pop(slot, None)
        if chain is not None:  # the rows of the accepted part of last step's chain are kept
            new = tokens[have:]
            kept = 0
            while kept < len(chain) and kept < len(new) - 1 and chain[kept] == int(new[kept]):
                kept += 1
            self.cache.truncate(slot, self._rows[slot] + kept)
            if kept:
                have += kept
                self._covered[slot], self._last[slot] = have, int(tokens[have - 1])
                self._root.pop(slot, None)
        if have > n or (have and self._last.get(slot) != int(tokens[have - 1])):
            self.cache.reset(slot)  # not this sequence's prefix (a reused key): start over
            have = 0
        if have == n and slot in self._root:
            return None
        if have == n:  # committed without its logits kept (cannot happen after _sync; be safe): start over
            self.cache.reset(slot)
            have = 0
        if have and n - have > self.catch_up:
            have = n - self.catch_up
        new = np.asarray(tokens[have:], dtype=np.int64)
        if self.cache.length(slot) + len(new) + self.max_depth * self.max_children > self.cache.max_length:
            self.cache.reset(slot)  # full of old rows: start over on the last rows only
            have = max(0, n - self.catch_up)
            new = np.asarray(tokens[have:], dtype=np.int64)
        return Chunk(slot, new, np.arange(have, n, dtype=np.int64))

    def _synced(self, slot: int, tokens: list[int], chunk: Chunk, logits: np.ndarray) -> np.ndarray:
        """Commit `chunk` (from `_sync_feed`, just forwarded: `logits` after its last token)."""
        self.cache.commit(slot, list(range(len(chunk.tokens))))
        self._rows[slot] = self.cache.length(slot)
        self._covered[slot] = len(tokens)
        self._last[slot] = int(tokens[-1])
        self._root[slot] = logits
        return logits

    def _tree_rows(self, slot: int, nodes: list, committed: int) -> np.ndarray:
        """Logits after each of `nodes` (tree nodes, index >= 0): the tree drafted so far that they
        hang from fed with a tree mask after the `committed` tokens, uncommitted."""
        members: dict[int, Any] = {}
        for node in nodes:
            while node is not None and node.token is not None and node.index not in members:
                members[node.index] = node
                node = node.parent
        order = sorted(members)  # a parent's index is below its children's: topological
        row_of = {index: row for row, index in enumerate(order)}
        mask = np.zeros((len(order), len(order)), dtype=bool)
        for row, index in enumerate(order):
            node = members[index]
            while node is not None and node.token is not None:
                mask[row, row_of[node.index]] = True
                node = node.parent
        tokens = np.array([members[i].token for i in order], dtype=np.int64)
        positions = np.array([committed - 1 + members[i].depth for i in order], dtype=np.int64)
        return self._forward([Chunk(slot, tokens, positions, mask)], [row_of[node.index] for node in nodes])

    # -- proposing ------------------------------------------------------------------------

    def _top(self, logits: np.ndarray) -> list:
        """(token, probability) of the row's `max_children` most probable tokens (softmax at T=1)."""
        k = min(self.max_children, logits.shape[-1])
        top = np.argpartition(-logits, k - 1)[:k]
        top = top[np.argsort(-logits[top], kind="stable")]
        shifted = np.exp(logits - logits[top[0]])
        probs = shifted[top] / shifted.sum(dtype=np.float64)
        return [(int(t), float(p)) for t, p in zip(top, probs)]

    def _drawn(self, logits: np.ndarray, temperature: float, top_k: int, top_p: float,
               generator: Optional[np.random.Generator]) -> Any:
        q = target_distribution(logits, temperature, top_k, top_p)
        group = sample_children(q, self.max_children, generator if generator is not None else np.random.default_rng())
        if not group.draws:
            return []
        return SampledExpansion(group, [(t, float(q[t])) for t in group.draws])

    def _grow(self, chains: list["_Chain"]) -> None:
        """Grow every chain to its end, each round one forward that feeds (and commits) the token
        each unfinished chain just took: d rounds for chains of depth d, however many there are."""
        while True:
            taken = [(chain, token) for chain in chains if (token := chain.take(self.prob_threshold)) is not None]
            if not taken:
                break
            chunks = [Chunk(chain.slot, np.array([token], dtype=np.int64),
                            np.array([chain.n + len(chain.tree.tokens) - 1], dtype=np.int64)) for chain, token in taken]
            logits = self._forward(chunks, list(range(len(chunks))))
            for (chain, token), row in zip(taken, logits):
                self.cache.commit(chain.slot, [0])
                chain.fed.append(token)
                chain.logits = row
        for chain in chains:
            self._chain[chain.slot] = chain.fed

    def propose(self, view: Any, budget: int) -> SpecTree:
        """At most `budget` nodes after the pending token: a chain (default) or a best-first tree
        (`shape: tree`), drawn from q at T > 0."""
        if not self._can_draft(view, budget):
            return SpecTree()
        if self.shape == "chain":
            return self._draft_chains([(view, budget)])[0]
        tokens = view.token_ids
        n = len(tokens)
        temperature, top_k, top_p = sampling_knobs(view.params)
        sampled = self.sample and not is_greedy(temperature)
        generator = view.generator
        key = sequence_key(view)
        with self._lock:
            slot = self._slot(key)
            try:
                root = self._sync(slot, list(tokens))

                def expand_fn(nodes: list) -> list:
                    rows = root[None] if nodes[0].token is None else self._tree_rows(slot, nodes, n)
                    if sampled:
                        return [self._drawn(row, temperature, top_k, top_p, generator) for row in rows]
                    return [self._top(row) for row in rows]

                return build_dynamic_tree(expand_fn, budget, self.max_depth, self.prob_threshold,
                                          self.max_children, batched=True, frontier=self.frontier)
            finally:
                if key is None:  # nothing to find it by next time
                    self._release(slot)

    def _can_draft(self, view: Any, budget: int) -> bool:
        n = len(view.token_ids)
        return budget > 0 and n > 0 and n + self.max_depth <= self.cache.max_length

    def propose_batch(self, items: list[tuple[Any, int]]) -> list[SpecTree]:
        """`propose` for several sequences of one step: chains (the default shape) together, their
        syncs in one forward, then one forward a depth for every chain still growing; trees one
        sequence at a time. Each chain draws from its own sequence's random stream."""
        if self.shape != "chain":
            return [self.propose(view, budget) for view, budget in items]
        return self._draft_chains(items)

    def _draft_chains(self, items: list[tuple[Any, int]]) -> list[SpecTree]:
        out = [SpecTree() for _ in items]
        todo = [(i, view, budget) for i, (view, budget) in enumerate(items) if self._can_draft(view, budget)]
        with self._lock:
            # At most as many sequences at once as the cache has slots: one group never evicts its own.
            for start in range(0, len(todo), self.max_sequences):
                group = todo[start:start + self.max_sequences]
                slots = [self._slot(sequence_key(view)) for _, view, _ in group]
                try:
                    tokens = [list(view.token_ids) for _, view, _ in group]
                    feeds = [self._sync_feed(slot, t) for slot, t in zip(slots, tokens)]
                    fed = [j for j, chunk in enumerate(feeds) if chunk is not None]
                    if fed:
                        ends = np.cumsum([len(feeds[j].tokens) for j in fed]) - 1
                        logits = self._forward([feeds[j] for j in fed], [int(e) for e in ends])
                        for j, row in zip(fed, logits):
                            self._synced(slots[j], tokens[j], feeds[j], row)
                    chains = []
                    for (i, view, budget), slot, t in zip(group, slots, tokens):
                        temperature, top_k, top_p = sampling_knobs(view.params)
                        chains.append(_Chain(slot, len(t), self._root[slot], min(budget, self.max_depth),
                                             self.sample and not is_greedy(temperature), (temperature, top_k, top_p),
                                             view.generator))
                    self._grow(chains)
                    for (i, _, _), chain in zip(group, chains):
                        out[i] = chain.tree
                finally:
                    for (_, view, _), slot in zip(group, slots):
                        if sequence_key(view) is None:  # nothing to find it by next time
                            self._release(slot)
        return out

    def warmup(self) -> None:
        """One sync and one tree forward, so the first request pays no set-up."""
        class _View:  # greedy, and with no seq_id: propose releases its slot when done
            seq_id = None
            token_ids = [0, 0, 0]
            prompt_length = 3
            params = SamplingParams()
            generator = new_generator(0)
            last_hidden = None
            new_features = None
        self.propose(_View(), min(4, self.max_depth))
        with self._lock:
            self.calls, self.seconds = 0, 0.0


class _Chain:
    """One sequence's draft chain as it grows: the draft's argmax, or at T > 0 a draw from its q,
    one token a draft forward; it ends where the cumulative draft probability falls below the
    threshold or at its depth, so its length follows the draft's confidence."""

    def __init__(self, slot: int, n: int, logits: np.ndarray, depth: int, sampled: bool, knobs: tuple,
                 generator: Optional[np.random.Generator]) -> None:
        self.slot, self.n, self.logits, self.depth = slot, n, logits, depth
        self.sampled, self.knobs = sampled, knobs
        self.rng = generator if generator is not None else np.random.default_rng()
        self.tree = SpecTree()
        self.cumulative = 1.0
        self.fed: list[int] = []  # tokens fed to the draft and committed after the sequence's own
        self.ended = False

    def take(self, prob_threshold: float) -> Optional[int]:
        """Take the next token from `logits`; the token to feed next, or None once the chain has ended."""
        tree = self.tree
        if self.ended or len(tree.tokens) >= self.depth:
            self.ended = True
            return None
        parent = len(tree.tokens) - 1
        if self.sampled:
            q = target_distribution(self.logits, *self.knobs)
            group = sample_children(q, 1, self.rng)
            if not group.draws:
                self.ended = True
                return None
            token = group.draws[0]
            # Recorded before the threshold looks at it: a draw left out would bias the rule.
            tree.sampled.setdefault(parent, []).append(group)
            prob = float(q[token] / q.sum(dtype=np.float64))
        else:
            token = int(np.argmax(self.logits))
            prob = float(1.0 / np.exp(self.logits - self.logits[token]).sum(dtype=np.float64))
        self.cumulative *= prob
        if self.cumulative < prob_threshold:
            self.ended = True
            return None
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.probs.append(self.cumulative)
        if len(tree.tokens) >= self.depth:
            self.ended = True
            return None
        return token


def check_vocabulary(target: Any, draft: Any, path: str) -> None:
    """ValueError unless `draft` (a tokenizer) has `target`'s vocabulary (see the module docstring)."""
    if target is None:
        raise ValueError("the draft model's vocabulary cannot be checked: the target's tokenizer was not given")
    a, b = int(target.vocab_size), int(draft.vocab_size)
    if abs(a - b) > VOCAB_SLACK:
        raise ValueError(f"draft model {path!r} has {b} token ids, the target {a}: not the same vocabulary "
                         f"(at most {VOCAB_SLACK} ids may differ)")
    for token in range(min(a, b)):
        mine, theirs = target.token_text(token), draft.token_text(token)
        if mine != theirs:
            raise ValueError(f"draft model {path!r} has another vocabulary: token id {token} is {theirs!r} there "
                             f"and {mine!r} in the target; a draft model must share the target's tokenizer")


def _read_shape(options: Mapping[str, Any]) -> str:
    shape = options.get("shape", "chain")
    if shape not in ("chain", "tree"):
        raise OptionError("shape", f"expected 'chain' (one token a draft forward, rows kept) or 'tree' "
                                   f"(best-first, re-fed each forward), got {shape!r}")
    return shape


def make_draft_model_drafter(model: Any, options: Optional[Mapping[str, Any]] = None,
                             context: Optional[DrafterContext] = None) -> DraftModelDrafter:
    """Drafter factory: loads `options.path` on the target's runtime, checks its vocabulary, warms it up."""
    options, path = path_drafter_options(options, OPTIONS, "model-drafter",
                                         "the path of the draft model's file (a GGUF, or a directory `outrider bake` wrote)")
    context = context or DrafterContext()
    load = getattr(model, "load_draft_model", None)  # optional in CausalLM: probing is how it is told
    if load is None:
        raise OptionError("path", f"this target ({type(model).__name__}) cannot load a draft model: the draft-model "
                                  f"drafter runs on the llm backend's native CPU runtime")
    resolved = context.resolve(path)
    if not resolved.exists():  # a GGUF file, or a directory `outrider bake` wrote
        raise OptionError("path", f"draft model file {str(resolved)!r} does not exist")
    started = time.perf_counter()
    try:
        draft, tokenizer = load(str(resolved))
    except (ValueError, OSError) as exc:
        raise OptionError("path", f"draft model {str(resolved)!r} cannot be served: {exc}") from None
    try:
        check_vocabulary(context.tokenizer, tokenizer, str(resolved))
    except ValueError as exc:
        raise OptionError("path", str(exc)) from None
    max_length = draft.max_length
    drafter = DraftModelDrafter(
        draft, int(model.vocab_size),
        max_depth=read_int(options, "max_depth", 8, 1, 64),
        max_children=read_int(options, "max_children", 4, 1, 64),
        prob_threshold=read_float(options, "prob_threshold", 0.05, 0.0, 1.0),
        frontier=read_int(options, "frontier", 8, 1, 256),
        sample=read_bool(options, "sample", True),
        max_sequences=read_int(options, "max_sequences", 8, 1, 1024),
        max_length=read_int(options, "max_length", int(max_length), 16, 1 << 20),
        catch_up=read_int(options, "catch_up", 16, 1, 1 << 20),
        shape=_read_shape(options),
    )
    drafter.warmup()
    log.info("draft model %s loaded in %.2fs (%d-token vocabulary checked against the target's)", resolved,
             time.perf_counter() - started, tokenizer.vocab_size)
    return drafter
