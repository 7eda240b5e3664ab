"""The shapes shared by the generation engine, a generating backend's model and decode strategies.

Conventions (read these first):
- A sequence lives in one *slot* of a KV cache. `cache.length(slot)` tokens are
  committed there (positions 0 .. length-1).
- The *pending* token is the last token chosen (sampled or accepted) but not yet in the cache.
  Every decode step feeds the pending token plus the draft tree's nodes in ONE forward pass.
- Position of the pending token = length(slot); a tree node at depth d (children of the
  pending token have depth 1) sits at position length(slot) + d.
- `forward` appends the K/V of every token it is fed, tentatively, after the committed ones;
  `cache.commit(slot, keep)` then keeps only the fed tokens listed in `keep` (indices into the
  chunk, in order: the pending token, then the accepted path), compacting them to positions
  length .. length+len(keep)-1. Prefill is a chunk with a causal mask, committed whole.
- Logits and hidden states come back for every fed token, in chunk order (logits only for
  `logit_rows` when given: the engine asks for a prefill's last token and every row of a tree).
- `hidden` is the last layer's output after the final norm: what a draft head reads.
- Arrays: what the engine hands a model (tokens, positions, masks, logit rows) is numpy; a model
  returns logits as numpy or as a torch tensor on any device (the engine reads them on the host,
  `sampling.host_array`), and hidden states as whatever its drafters read. This package imports
  no torch, so a model without it (the CPU GGUF path) serves without torch loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Optional, Protocol

import numpy as np


@dataclass
class Chunk:
    """Tokens of one sequence fed to one forward pass."""

    slot: int
    tokens: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n], absolute positions (RoPE)
    # bool [n, n]: mask[i, j] = token i may attend to fed token j (itself included).
    # None means causal (prefill, or a plain chain). Every token also sees all committed tokens.
    tree_mask: Optional[np.ndarray] = None


@dataclass
class ForwardOutput:
    logits: Any  # float32 [total_tokens, vocab], chunks concatenated in order (numpy or torch)
    hidden: Any  # float32 [total_tokens, hidden_size], last layer after the final norm
    # float32 [total_tokens, k x hidden_size] once `capture_hidden(layers)` was called: the residual
    # stream entering each of those k layers (what an EAGLE-3 head reads); None otherwise.
    aux_hidden: Any = None


class KVCache(Protocol):
    num_slots: int
    max_length: int

    def length(self, slot: int) -> int: ...
    def commit(self, slot: int, keep: list[int]) -> None: ...
    def reset(self, slot: int) -> None: ...  # may hand memory back once no slot is in use
    # For the prefix cache (an engine given prefix_cache_bytes uses these): a copy of committed
    # positions start..end-1, and committing such a copy right after the committed ones.
    def read(self, slot: int, start: int, end: int) -> Any: ...
    def write(self, slot: int, start: int, kv: Any) -> None: ...
    # Required of a draft model's cache (CausalLM.load_draft_model), whose chain keeps the rows the
    # target accepted: whether `truncate(slot, length)` may drop a slot's rows from `length` on (a
    # ring of windowed layers cannot).
    # truncatable: bool
    # def truncate(self, slot: int, length: int) -> None: ...
    # Optional, for a cache whose windowed layers forget old rows: how many leading blocks (copies
    # of `read`, in order) can be written back exactly (the engine copies no more).
    # def restorable(self, blocks: list[Any]) -> int: ...


class Tokenizer(Protocol):
    """What the engine and the fronts use of a generating backend's tokenizer (`backend.tokenizer`;
    plugins/outrider_llm's ChatTokenizer is one). Checked when an engine is made (`check_tokenizer`)."""

    vocab_size: int
    eos_token_ids: Collection[int]  # ids that end a generation
    chat_template: Optional[str]  # None or "": no template, so chat messages are refused with a 400

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str: ...
    def token_text(self, token_id: int) -> Optional[str]: ...  # the token's own text (None: no such id)
    def to_json(self) -> Optional[str]: ...  # tokenizers' JSON for the grammar engine; None: no structured output


TOKENIZER_MEMBERS = ("vocab_size", "eos_token_ids", "chat_template", "encode", "decode", "apply_chat_template",
                     "token_text", "to_json")


def check_tokenizer(tokenizer: Any, where: str = "the tokenizer") -> None:
    """TypeError naming every member of `Tokenizer` that `tokenizer` lacks."""
    missing = [name for name in TOKENIZER_MEMBERS if not hasattr(tokenizer, name)]
    if missing:
        raise TypeError(f"{where} ({type(tokenizer).__name__}) lacks {', '.join(missing)}: a generating backend's "
                        f"tokenizer implements outrider.generation.contract.Tokenizer")


class CausalLM(Protocol):
    """A decoder with a slot KV cache and tree attention (one implementation: plugins/outrider_llm).

    What a draft head needs is here too, so a drafter never imports a backend: the input
    embeddings, the LM head, `make_linear` (a matmul in the model's own compute format, e.g.
    prepacked or quantized) and `fingerprint()` (identifies the weights a head was trained on).
    """

    vocab_size: int
    hidden_size: int
    dtype: Any  # the compute dtype of its matmuls (float32, bfloat16, ...)
    device: Any  # where its tensors live ("cpu", "cuda:0", a torch.device): where a drafter puts its own
    array_api: str  # "torch" or "numpy": the arrays the drafters' interface below takes and returns

    def new_cache(self, num_slots: int, max_length: int) -> KVCache: ...
    def forward(self, cache: KVCache, chunks: list[Chunk],
                logit_rows: Optional[np.ndarray] = None) -> ForwardOutput: ...
    # The drafters' interface (torch tensors or numpy arrays, as `array_api` says):
    def embed(self, tokens: Any) -> Any: ...  # int64 [n] -> float32 [n, hidden]
    def lm_head(self, hidden: Any) -> Any: ...  # [n, hidden] -> float32 [n, vocab]
    def lm_head_rows(self, tokens: Any) -> Any: ...  # the head's rows for `tokens`, fp32 [k, hidden]
    # y = x @ W.T in the model's compute format (or `dtype`), any float input, output in that dtype.
    # A drafter may pass `quantize="int4"` (speed over exactness: drafts are verified anyway); a
    # model without a fast kernel for it ignores it, and one that lacks the keyword is not asked.
    def make_linear(self, weight: Any, dtype: Any = None) -> Callable[[Any], Any]: ...
    def fingerprint(self) -> str: ...
    # Optional, for the draft-model drafter: another model file loaded the way this one was (same
    # runtime, same artifact cache, same KV cache type) with its tokenizer. A model without it
    # cannot be drafted for by a draft model (the drafter's factory says so). The draft model it
    # returns has `max_length` (the longest context its positions are made for), and its caches
    # say whether they are `truncatable` (KVCache).
    # def load_draft_model(self, path: str) -> tuple["CausalLM", Any]: ...
    # Optional, for EAGLE-3 heads: make every later forward return `aux_hidden` for these layers
    # (ascending, 0 .. num_layers - 1); `num_layers` says how many it has. A model without it cannot
    # serve such a head (the drafter's factory says so).
    # def capture_hidden(self, layers: tuple[int, ...]) -> None: ...


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

    def mask(self) -> np.ndarray:
        """bool [1+n, 1+n] tree mask over [pending, nodes...] (row attends to column)."""
        n = len(self.tokens)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents):
            row = i + 1
            mask[row, row] = True
            if parent >= 0:
                mask[row] |= mask[parent + 1]
        mask[0, 1:] = False
        return mask


@dataclass
class DrafterContext:
    """What a drafter factory gets beside the target and its options: `factory(model, options, context)`."""

    tokenizer: Any = None  # the target's tokenizer (vocab_size, token_text, encode, decode), or None
    directory: Optional[Path] = None  # the manifest's folder: relative paths in options resolve against it

    def resolve(self, path: "str | Path") -> Path:
        """`path` with ~ expanded, relative to the manifest's folder when it is relative."""
        path = Path(path).expanduser()
        return path if path.is_absolute() or self.directory is None else Path(self.directory) / path


@dataclass
class DraftLimits:
    """What bounds one sequence's draft in one step (the engine's side of the budget).

    The strategy decides how many nodes to draft (its adaptive budget, the share of a step that
    `n_active` sequences split, whether drafting pays); the engine only says how deep a tree can
    go: `room` more tokens fit in the context and in the request's max_tokens after the pending
    one. `step` numbers the engine's steps (consecutive steps differ by one), so a strategy can
    tell when a new step begins without a separate call. `prefilling` sequences feed their prompts
    in the same step: its time is mostly theirs, so a strategy that times steps learns nothing from it.
    """

    room: int
    n_active: int
    step: int
    prefilling: int = 0


@dataclass
class StepOutcome:
    """What one step did to a sequence, handed to the strategy and its drafters to learn from.

    `phase`: "prefill" (the prompt was fed, its first token sampled), "decode" (the pending token
    and the strategy's draft were verified) or "forced" (the draft was what the grammar forces,
    not the drafters': nothing to learn about them). `drafted` nodes were verified, `accepted` of
    them kept; `new_tokens` were appended to `seq.token_ids` (empty when the step emitted EOS).
    """

    phase: str
    drafted: int
    accepted: int
    new_tokens: list[int]


class Drafter(Protocol):
    """Proposes a draft tree for a sequence: drafts are data, the engine verifies them.

    Registered by a plugin (`outrider_register_drafters(register)`: `register(name, factory)`)
    and made once per engine by `factory(model, options, context)` (model: the target CausalLM;
    options: the manifest's `speculative.<name>` mapping merged over the shared limits; context:
    DrafterContext). A factory raises ValueError/TypeError for bad options (the manifest error
    names the field), or the speculative plugin's OptionError to name a sub-field.

    `propose(seq, budget)` returns at most `budget` nodes (more are cut by probability): a
    DraftTree of deterministic candidates (one-hot proposals: n-gram lookups, a head's top-k), or
    a SpecTree whose `sampled` groups say which q each sampled child was drawn from, so that the
    accept rule takes a draw with min(1, p/q) and the output keeps the target's distribution. A
    drafter never verifies, commits or counts: the engine does (verify.verify), and an exception
    in `propose` costs that step's draft, never the request.

    `propose_batch(items)` (optional): the same for several sequences of one step at once, items
    [(seq, budget)] in the engine's order, one tree per item: a drafter that runs a model of its
    own answers them with one forward per draft depth instead of one per sequence and depth.

    Optional hooks, each given the engine's Sequence as a SequenceView: `start(seq)` (admitted),
    `observe(seq, outcome: StepOutcome)` (after every step of it, its new tokens appended),
    `finish(seq)` (ended or cancelled: drop its state) and `warmup()` (before the model is
    reported ready). An exception in `start` or `observe` fails that request alone.
    """

    name: str

    def propose(self, seq: "SequenceView", budget: int) -> DraftTree: ...
    # def propose_batch(self, items: list[tuple["SequenceView", int]]) -> list[DraftTree]: ...


DRAFTER_MEMBERS = ("name", "propose")


def check_drafter(drafter: Any, where: str) -> None:
    """TypeError naming what `drafter` lacks of `Drafter` (its optional hooks aside)."""
    missing = [name for name in DRAFTER_MEMBERS if not hasattr(drafter, name)]
    if not missing and not callable(drafter.propose):
        missing = ["propose(seq, budget)"]
    if missing:
        raise TypeError(f"{where} returned a {type(drafter).__name__} without {' or '.join(missing)} "
                        "(outrider.generation.contract.Drafter)")


class SequenceView(Protocol):
    """What a drafter may read about a sequence (the engine's Sequence; read only)."""

    seq_id: Any  # identifies the sequence while it lives (a key for per-sequence state)
    token_ids: list[int]  # prompt + generated so far, including the pending token (last)
    prompt_length: int
    params: Any  # sampling.SamplingParams: temperature, top_k, top_p, seed, ...
    generator: np.random.Generator  # the request's own random stream (seeded requests reproduce)
    last_hidden: Any  # [hidden] target's last-layer hidden state at the last committed position
    # [k, layers x hidden] the model's captured layers (CausalLM.capture_hidden) at the k positions
    # the last step committed, which end at the last committed one; None when nothing is captured.
    new_features: Any


class DecodeStrategy(Protocol):
    """What a generating engine asks about drafts (the `speculative` accelerator implements it).

        strategy = accelerator.for_instance()                    # one per engine
        strategy.bind_registry(registry)                         # core: the drafter factories
        strategy.attach(model, tokenizer)                        # once the model is loaded
        strategy.start(seq)                                      # a sequence was admitted
        each step, for the decoding sequences, in the engine's order:
            trees = strategy.propose_batch([(seq, DraftLimits(room, n_active, step)), ...])
            (or tree = strategy.propose(seq, limits) for each, where there is no propose_batch)
            ... the engine: one forward over every [pending, *tree.tokens] with tree.mask(),
                verify.verify (the only accept rule), cache.commit, emit ...
            strategy.observe(seq, StepOutcome(...))              # also after the prefill step
        strategy.finish(seq)                                     # ended or cancelled

    `propose` is the one place the draft budget is decided (nodes, depth within `room`, whether
    drafting pays at all); the engine refuses a tree deeper than `room` (that request fails).
    `propose_batch` (optional) returns one tree per item, so drafters can serve the step's
    sequences together; should it raise, the engine asks `propose` one sequence at a time.
    Everything here is draft-side: the output is the target's whatever the strategy proposes.
    """

    def for_instance(self) -> "DecodeStrategy": ...
    def bind_registry(self, registry: Any) -> None: ...  # {name: factory} of every loaded plugin
    def attach(self, model: CausalLM, tokenizer: Any) -> None: ...
    def start(self, seq: SequenceView) -> None: ...
    def propose(self, seq: SequenceView, limits: DraftLimits) -> DraftTree: ...
    # def propose_batch(self, items: list[tuple[SequenceView, DraftLimits]]) -> list[DraftTree]: ...
    def observe(self, seq: SequenceView, outcome: StepOutcome) -> None: ...
    def finish(self, seq: SequenceView) -> None: ...


@dataclass
class SampledChildren:
    """Candidates drawn at random from a draft distribution q for one parent node."""

    q: np.ndarray  # [vocab] the draft distribution (need not be normalized)
    draws: list[int]  # tokens in the order drawn
    replacement: bool = False  # False: each draw came from q with the earlier draws removed


@dataclass
class SpecTree(DraftTree):
    """A DraftTree that may say, per parent, which children were sampled from which q."""

    sampled: dict[int, list[SampledChildren]] = field(default_factory=dict)

    def children(self) -> dict[int, list[int]]:
        """Children of every node (key -1 = the pending token), in node order."""
        return children_of(self)


def children_of(tree: DraftTree) -> dict[int, list[int]]:
    """Children of every node of any DraftTree (key -1 = the pending token), in node order."""
    out: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(tree.parents):
        out.setdefault(parent, []).append(i)
        out.setdefault(i, [])
    return out


def sampled_groups(tree: DraftTree) -> dict[int, list[SampledChildren]]:
    """The tree's sampled groups ({} for a plain DraftTree)."""
    return tree.sampled if isinstance(tree, SpecTree) else {}
