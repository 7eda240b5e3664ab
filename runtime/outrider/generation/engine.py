"""The generation engine: continuous batching over a slot KV cache, with speculative decoding.

Each `step()` runs ONE forward pass for every active sequence together: new sequences are
prefilled, running ones feed their pending token plus a draft tree; the target's logits then
decide (losslessly) which drafted tokens are kept, tokens stream back, and finished or
cancelled sequences free their slot.

Isolation: one request's failure costs that request only. Its parameters are checked when it
is admitted; anything that raises while starting it (chat template, tokenizer, a drafter's
`start`) or while handling it alone in a step (drafting, verifying, sampling, streaming) fails
that request and frees its slot, and the step goes on for the others. Only an exception in the
forward pass all sequences share cannot be pinned on one: it fails the sequences in that step,
resets their slots, and the engine keeps serving (waiting requests stay queued).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Any, Optional, Union

import numpy as np

from outrider.errors import BadRequestError, ExecutionError, OutriderError
from outrider.serving.queue import RequestQueue
from outrider.serving.request import DEFERRED, PendingRequest
from outrider.serving.scheduler import Scheduler

from .constraints import TokenRules, check_grammar_state, parse_logit_bias, token_logprobs
from .contract import Chunk, DraftLimits, DraftTree, StepOutcome, check_tokenizer, children_of, sampled_groups
from .prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys
from .sampling import SamplingParams, host_array, new_generator, parse_prompt, parse_sampling, sample_token
from .text import IncrementalText
from .verify import verify

log = logging.getLogger("outrider.llm")

MAX_FORCED_DRAFT = 16  # forced tokens drafted in one step
_sequence_ids = itertools.count()


class Sequence:
    """One generation in flight. Also the `SequenceView` drafters read."""

    def __init__(self, request: Optional[PendingRequest], slot: int, prompt_ids: list[int],
                 params: SamplingParams, text: IncrementalText, speculate: bool) -> None:
        self.request = request
        self.seq_id = next(_sequence_ids)  # unique in the process: drafters key their state by it
        self.slot = slot
        self.token_ids: list[int] = list(prompt_ids)  # prompt + generated (+ the pending token)
        self.prompt_length = len(prompt_ids)
        self.generated: list[int] = []
        self.params = params
        self.text = text
        self.speculate = speculate
        # Sampling runs on the host (numpy) whatever computed the logits: one generator per request.
        self.generator = new_generator(params.seed)
        self.prefilled = False
        self.released = False
        self.last_hidden: Any = None  # the model's hidden-state row (numpy or torch), for draft heads
        # ForwardOutput.aux_hidden rows of the tokens the last step committed (the last ones of
        # token_ids[:-1]), when the model captures layers for an EAGLE-3 head; else None.
        self.new_features: Any = None
        self.finish_reason: Optional[str] = None
        # What ended it with finish_reason "stop" besides EOS: a stop string or a stop token id
        # (vLLM's `stop_reason`), and the tokens that end it (EOS unless ignored, stop_token_ids).
        self.stop_reason: Optional[Union[str, int]] = None
        self.ending: frozenset[int] = frozenset(params.stop_token_ids)
        self.started = time.monotonic()
        self.first_token_seconds: Optional[float] = None
        self.first_emitted: Optional[float] = None  # when the first / latest tokens were emitted
        self.last_emitted: Optional[float] = None
        self.steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.rules: Optional[TokenRules] = None  # the request's logit_bias, penalties, grammar
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        self.forced_draft = False  # this step's draft is the grammar's forced tokens
        self.deferred = False  # its prefill waited a step for another prompt's identical first block
        self.logprobs: list[dict] = []  # per generated token, when the request asks for them

    @property
    def cancelled(self) -> bool:
        return self.request is not None and self.request.done and self.finish_reason is None

    def stats(self) -> dict[str, Any]:
        decode_steps = max(self.steps - 1, 0)
        return {
            "prompt_tokens": self.prompt_length,
            "new_tokens": len(self.generated),
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            # tokens gained per decode step (1.0 = no speculation gain)
            "mean_accepted_length": round((len(self.generated) - 1) / decode_steps, 3) if decode_steps else 0.0,
            "seconds": round(time.monotonic() - self.started, 4),
            "time_to_first_token": round(self.first_token_seconds or 0.0, 4),
            "cached_tokens": self.cached_tokens,
        }


class GenerationEngine:
    """Owns the model, its KV cache and the sequences using it; driven by one instance thread."""

    def __init__(self, model: Any, tokenizer: Any, strategy: Any = None, max_sequences: int = 8,
                 max_length: int = 2048, stats: Any = None, prefix_cache_bytes: int = 0) -> None:
        check_tokenizer(tokenizer, "the generation engine's tokenizer")
        self.model = model
        self.tokenizer = tokenizer
        self.strategy = strategy
        self.max_sequences = max_sequences
        self.max_length = max_length
        self.cache = model.new_cache(max_sequences, max_length)
        self.free_slots = list(range(max_sequences - 1, -1, -1))
        self.active: list[Sequence] = []
        self.waiting: deque[PendingRequest] = deque()
        self.stats = stats
        self.eos = set(tokenizer.eos_token_ids)
        self.steps = 0  # forward passes run so far (warmup included): a backend tells idle spells apart by it
        self._grammars: Any = None  # grammar.GrammarCompiler, made on the first constrained request
        # Prompt prefixes' K/V, reused by later requests (the cache must offer read and write).
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None

    # -- admission ------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def capacity(self) -> int:
        """How many new requests to take from the queue now (the rest wait there, bounded)."""
        return max(0, len(self.free_slots) - len(self.waiting))

    def requests(self) -> list[PendingRequest]:
        return [s.request for s in self.active if s.request is not None] + list(self.waiting)

    def admit(self, requests: list[PendingRequest]) -> None:
        self.waiting.extend(requests)

    def _start(self, request: PendingRequest) -> Sequence:
        """A Sequence in a free slot for `request`, or raise (OutriderError: that request's answer)."""
        if request.kind != "generate":
            raise BadRequestError(f"model {request.model!r} generates text; send generate, not {request.kind}")
        params = parse_sampling(request.parameters, self.max_length)
        prompt, messages = parse_prompt(request.parameters)
        if messages is not None:
            if not self.tokenizer.chat_template:
                raise BadRequestError(f"model {request.model!r} has no chat template; send 'prompt' instead of 'messages'")
            try:
                text = self.tokenizer.apply_chat_template(messages)
            except OutriderError:
                raise
            except Exception as exc:  # e.g. the template's raise_exception: these messages do not fit it
                raise BadRequestError(
                    f"model {request.model!r} could not render 'messages' with its chat template: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
        else:
            text = prompt
        try:
            prompt_ids = self.tokenizer.encode(text)
        except OutriderError:
            raise
        except Exception as exc:
            raise ExecutionError(f"tokenizing the prompt failed: {type(exc).__name__}: {exc}") from None
        if not prompt_ids:
            raise BadRequestError("the prompt is empty after tokenization")
        room = self.max_length - len(prompt_ids) - 1
        if room < 1:
            raise BadRequestError(
                f"the prompt is {len(prompt_ids)} tokens; this model's context holds {self.max_length}"
            )
        params.max_tokens = min(params.max_tokens, room)
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        rules = self._rules(params)
        speculate = self.strategy is not None and params.speculative is not False
        if self.stats is not None:
            self.stats.observe("queue_seconds", time.monotonic() - request.received)
        slot = self.free_slots.pop()
        seq: Optional[Sequence] = None
        try:
            seq = Sequence(request, slot, prompt_ids, params,
                           IncrementalText(self.tokenizer.decode, params.stop, params.min_tokens), speculate)
            seq.rules = rules
            if not params.ignore_eos:
                seq.ending |= self.eos
            if self.stats is not None:
                self.stats.sequences(+1)  # given back in _release, whatever happens next
            self.cache.reset(slot)
            if speculate:
                self.strategy.start(seq)
        except Exception as exc:
            if seq is not None:
                self._release(seq)  # the slot goes back, drafters forget what they saw of it
            else:
                self.free_slots.append(slot)
            if isinstance(exc, OutriderError):
                raise
            log.exception("model %s: request %r: starting its generation failed", request.model, request.id)
            raise ExecutionError(f"starting this generation failed: {type(exc).__name__}: {exc}") from None
        return seq

    def _rules(self, params: SamplingParams) -> Optional[TokenRules]:
        """The request's TokenRules (None when it sets none); a bad bias or constraint is its 400."""
        vocab = int(self.model.vocab_size)
        bias = parse_logit_bias(params.logit_bias, vocab)
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            raise BadRequestError(f"parameter 'stop_token_ids': token id {outside[0]} is outside the vocabulary "
                                  f"(0 .. {vocab - 1})")
        grammar = None
        if params.constraint is not None:
            if self._grammars is None:
                from .grammar import GrammarCompiler

                tokenizer_json = self.tokenizer.to_json()
                if tokenizer_json is None:
                    raise BadRequestError("this model's tokenizer cannot be given to the grammar engine: "
                                          "parameter 'constraint' is not supported here")
                self._grammars = GrammarCompiler(tokenizer_json, vocab, sorted(self.eos))
            grammar = self._grammars.state(*params.constraint)
        ending = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos))
        rules = TokenRules(vocab, bias, params.presence_penalty, params.frequency_penalty, grammar, frozenset(self.eos),
                           params.min_tokens, ending)
        return rules if rules.active else None

    def warm_up(self, prompt_ids: list[int], max_tokens: int = 8, temperature: float = 0.0) -> list[int]:
        """Generate from `prompt_ids` outside any request (prefill, drafts, verification); not counted in stats."""
        stats, self.stats = self.stats, None  # warmup tokens are not served tokens
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
            seq = Sequence(None, self.free_slots.pop(), prompt_ids, params,
                           IncrementalText(self.tokenizer.decode, []), self.strategy is not None)
            self.cache.reset(seq.slot)
            if seq.speculate:
                self.strategy.start(seq)
            self.active.append(seq)
            while seq in self.active:
                self.step()
            return seq.generated
        finally:
            self.stats = stats

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> None:
        """One forward pass for all active sequences (prefill for new ones).

        Raises only when the shared forward fails; its sequences are then already answered
        and their slots free (see `fail_active`).
        """
        self.steps += 1
        self._drop_cancelled()
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            if request.done:  # cancelled or timed out while waiting for a slot
                continue
            try:
                self.active.append(self._start(request))
            except OutriderError as exc:  # _start has handed the slot back
                self._fail_request(request, exc)
            except Exception as exc:  # a bug in admission: still this request's alone
                log.exception("model %s: admitting request %r failed", request.model, request.id)
                self._fail_request(request, ExecutionError(
                    f"starting this generation failed: {type(exc).__name__}: {exc}"))
        if not self.active:
            return

        planned: list[tuple[Sequence, Chunk, Optional[DraftTree]]] = []
        prefilling: set[bytes] = set()  # first blocks of the prompts prefilled in this step
        for seq in list(self.active):
            if self._shares_a_prefill(seq, prefilling):
                continue  # next step it finds that prompt's blocks in the prefix cache
            try:
                planned.append((seq, *self._plan(seq)))
            except Exception as exc:  # drafting for this sequence: its own failure
                self._abort(seq, exc, "preparing its step")
        if not planned:
            return
        decoding = sum(1 for _, _, tree in planned if tree is not None)

        # Logits only where they are read: a prefill's last token, every row of a tree.
        rows: list[int] = []
        offset = 0
        for _, chunk, tree in planned:
            n = len(chunk.tokens)
            rows.extend([offset + n - 1] if tree is None else range(offset, offset + n))
            offset += n
        try:
            out = self.model.forward(self.cache, [chunk for _, chunk, _ in planned], logit_rows=np.array(rows, dtype=np.int64))
            logits_all = host_array(out.logits)  # one device-to-host copy a step (a CUDA model's logits)
        except Exception as exc:  # shared by every sequence of the step: none can be singled out
            error = exc if isinstance(exc, OutriderError) else ExecutionError(
                f"the forward pass shared by {len(planned)} sequence(s) failed: {type(exc).__name__}: {exc}")
            self.fail_active(error)
            raise
        offset = row = 0
        for seq, chunk, tree in planned:
            n = len(chunk.tokens)
            width = 1 if tree is None else n
            hidden = out.hidden[offset:offset + n]
            seq.new_features = None if out.aux_hidden is None else out.aux_hidden[offset:offset + n]
            logits = logits_all[row:row + width]
            offset += n
            row += width
            try:
                self._advance(seq, chunk, tree, hidden, logits)
            except Exception as exc:  # verifying, sampling or streaming this sequence
                self._abort(seq, exc, "finishing its step")
        if decoding and self.stats is not None:
            self.stats.add("decode_steps", 1)
            self.stats.add("decode_sequences", decoding)

    def _plan(self, seq: Sequence) -> tuple[Chunk, Optional[DraftTree]]:
        """What `seq` feeds this step: its prompt (tree None), or its pending token plus a draft tree."""
        length = self.cache.length(seq.slot)
        if not seq.prefilled:
            n = len(seq.token_ids)
            if self.prefix_cache is not None and seq.request is not None and length == 0:
                self._reuse_prefix(seq)
                length = self.cache.length(seq.slot)
            return Chunk(seq.slot, np.array(seq.token_ids[length:], dtype=np.int64),
                         np.arange(length, n, dtype=np.int64)), None
        tree = DraftTree()
        remaining = seq.params.max_tokens - len(seq.generated)
        room = min(self.max_length - length - 1, remaining - 1)
        seq.forced_draft = False
        if seq.speculate and room > 0:
            forced = seq.rules.forced_tokens(min(room, MAX_FORCED_DRAFT)) if seq.rules is not None else []
            if forced:
                # What the grammar forces next (a key, punctuation), drafted as a chain: the target
                # still verifies it, so this only saves steps (SGLang's jump-forward, kept lossless).
                tree = DraftTree(list(forced), list(range(-1, len(forced) - 1)), [1.0] * len(forced))
                seq.forced_draft = True
            else:
                tree = self.strategy.propose(seq, DraftLimits(room, len(self.active), self.steps))
                depth = max(tree.depths(), default=0)
                if depth > room:  # positions past the context: a strategy bug, this request's alone
                    raise ExecutionError(f"the decode strategy drafted {depth} tokens deep; room for {room}")
                if seq.rules is not None and seq.rules.grammar is not None and len(tree):
                    tree = _grammatical(tree, seq.rules)
        tokens = np.array([seq.token_ids[-1], *tree.tokens], dtype=np.int64)
        positions = length + np.array([0, *tree.depths()], dtype=np.int64)
        return Chunk(seq.slot, tokens, positions, tree.mask() if len(tree) else None), tree

    def _advance(self, seq: Sequence, chunk: Chunk, tree: Optional[DraftTree], hidden: Any,
                 logits: np.ndarray) -> None:
        """Keep what the target accepts of `seq`'s fed tokens and emit its new tokens."""
        seq.steps += 1
        rows: list[np.ndarray] = []  # the adjusted rows the emitted tokens are drawn from, in order
        adjust = _adjuster(seq, rows)
        if tree is None:
            self.cache.commit(seq.slot, list(range(len(chunk.tokens))))
            seq.last_hidden = hidden[-1]
            seq.prefilled = True
            self._store_prefix(seq)
            row = logits[-1] if adjust is None else adjust(logits[-1], [])
            token = sample_token(row, seq.params, seq.generator)
            seq.first_token_seconds = time.monotonic() - seq.started
            self._emit(seq, [token], rows, "prefill")
            return
        if len(tree):
            verdict = verify(tree, logits, seq.params, seq.generator, adjust)  # the one accept rule
            accepted, bonus = list(verdict.accepted), int(verdict.bonus)
        else:
            row = logits[0] if adjust is None else adjust(logits[0], [])
            accepted, bonus = [], sample_token(row, seq.params, seq.generator)
        keep = [0] + [i + 1 for i in accepted]
        self.cache.commit(seq.slot, keep)
        seq.last_hidden = hidden[keep[-1]]
        if seq.new_features is not None:
            seq.new_features = seq.new_features[keep]
        seq.draft_tokens += len(tree)
        seq.accepted_tokens += len(accepted)
        if len(tree) and self.stats is not None:
            self.stats.add("speculative_steps", 1)
        self._emit(seq, [tree.tokens[i] for i in accepted] + [bonus], rows,
                   "forced" if seq.forced_draft else "decode", len(tree), len(accepted))

    def _emit(self, seq: Sequence, tokens: list[int], rows: Optional[list[np.ndarray]] = None,
              phase: str = "decode", drafted: int = 0, accepted: int = 0) -> None:
        """Append `tokens` (up to EOS or max_tokens), tell the strategy what the step did, stream."""
        new: list[int] = []
        logprobs: list[dict] = []
        for index, token in enumerate(tokens):
            if token in seq.ending:  # EOS (unless ignored) or a stop token id: not part of the output
                seq.finish_reason = "stop"
                if token in seq.params.stop_token_ids:
                    seq.stop_reason = token
                break
            seq.generated.append(token)
            seq.token_ids.append(token)
            new.append(token)
            if seq.params.logprobs and rows:  # row j is the one emitted token j was drawn from
                logprobs.append(token_logprobs(rows[index], token, seq.params, seq.params.top_logprobs,
                                               self.tokenizer.decode))
            if len(seq.generated) >= seq.params.max_tokens:
                seq.finish_reason = "length"
                break
        if seq.rules is not None and new:
            seq.rules.commit(new)
            check_grammar_state(seq.rules.grammar)
            if seq.rules.finished and seq.finish_reason is None:
                seq.finish_reason = "stop"  # the grammar allows only the end now: EOS with probability 1
        seq.logprobs.extend(logprobs)
        if seq.speculate:  # before _finish below, which makes the strategy forget the sequence
            self.strategy.observe(seq, StepOutcome(phase, drafted, accepted, new))
        delta = seq.text.update(seq.generated, final=seq.finish_reason is not None)
        if seq.text.stopped:
            seq.finish_reason, seq.stop_reason = "stop", seq.text.matched
        if seq.request is not None and new and self.stats is not None:
            now = time.monotonic()
            if seq.last_emitted is None:
                self.stats.observe("first_token_seconds", now - seq.request.received)
            else:
                self.stats.observe("inter_token_seconds", now - seq.last_emitted)
            seq.last_emitted = now
            if seq.first_emitted is None:
                seq.first_emitted = now
        if seq.request is not None and seq.params.stream and (delta or new):
            seq.request.chunk(text=delta, token_ids=new, **({"logprobs": logprobs} if seq.params.logprobs else {}))
        if seq.finish_reason is not None:
            self._finish(seq)

    def _shares_a_prefill(self, seq: Sequence, prefilling: set[bytes]) -> bool:
        """Whether `seq`'s prompt starts with a block another prompt prefills in this step (n
        choices of one prompt, a burst of requests with one system prompt): it then waits one
        step and reuses that K/V instead of computing it again."""
        if seq.prefilled or self.prefix_cache is None or seq.request is None or seq.deferred:
            return False
        if len(seq.token_ids) <= BLOCK_TOKENS:  # a lookup leaves the last token: no block to share
            return False
        first = block_keys(seq.token_ids[:BLOCK_TOKENS])[0]
        if first in self.prefix_cache.blocks:
            return False
        if first in prefilling:
            seq.deferred = True  # once: a prompt never waits twice
            return True
        prefilling.add(first)
        return False

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Copy the cached blocks that start `seq`'s prompt into its slot (counted in stats)."""
        blocks = self.prefix_cache.lookup(seq.token_ids)
        restorable = getattr(self.cache, "restorable", None)  # a cache with windowed layers forgets rows
        if restorable is not None and blocks:
            blocks = blocks[:restorable([block.kv for block in blocks])]
        for block in blocks:
            self.cache.write(seq.slot, self.cache.length(seq.slot), block.kv)
        seq.cached_tokens = self.cache.length(seq.slot)
        if self.stats is not None:
            self.stats.add("prefix_cache_queries", len(seq.token_ids))
            self.stats.add("prefix_cache_hits", seq.cached_tokens)

    def _store_prefix(self, seq: Sequence) -> None:
        """Keep the full blocks of `seq`'s committed tokens for later requests (not warmup's)."""
        if self.prefix_cache is None or seq.request is None:
            return
        length = self.cache.length(seq.slot)
        try:
            self.prefix_cache.insert(seq.token_ids[:length], lambda start, end: self.cache.read(seq.slot, start, end))
        except Exception:  # a cache that cannot be read costs reuse, never this request
            log.exception("model %s: storing a prefix in the prefix cache failed", seq.request.model)

    def _finish(self, seq: Sequence) -> None:
        self._store_prefix(seq)
        stats = seq.stats()
        if self.stats is not None:
            self.stats.add("prompt_tokens", stats["prompt_tokens"])
            if stats["new_tokens"] > 1 and seq.first_emitted is not None:
                self.stats.observe("per_output_token_seconds",
                                   (time.monotonic() - seq.first_emitted) / (stats["new_tokens"] - 1))
            self.stats.add("generated_tokens", stats["new_tokens"])
            self.stats.add("draft_tokens", stats["draft_tokens"])
            self.stats.add("accepted_tokens", stats["accepted_tokens"])
        if seq.request is not None:
            extra: dict[str, Any] = {"logprobs": seq.logprobs} if seq.params.logprobs else {}
            if seq.stop_reason is not None:
                extra["stop_reason"] = seq.stop_reason
            seq.request.answer(None, self.stats, text=seq.text.text, token_ids=seq.generated,
                               finish_reason=seq.finish_reason, stats=stats, **extra)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Free `seq`'s slot and drafter state, once, whatever fails on the way."""
        if seq.released:
            return
        seq.released = True
        if seq.request is not None and self.stats is not None:
            self.stats.sequences(-1)
        if seq in self.active:
            self.active.remove(seq)
        try:
            self.cache.reset(seq.slot)
        except Exception:  # the next sequence in this slot resets it again before use
            log.exception("resetting KV cache slot %d failed", seq.slot)
        self.free_slots.append(seq.slot)
        if seq.speculate:
            try:
                self.strategy.finish(seq)
            except Exception:
                log.exception("the decode strategy failed to forget a sequence")

    def _fail_request(self, request: PendingRequest, error: OutriderError) -> None:
        request.answer(error, self.stats)

    def _abort(self, seq: Sequence, exc: Exception, stage: str) -> None:
        """`seq` alone failed: answer its request with the error, free its slot."""
        self._release(seq)
        if seq.request is None:  # warm-up: a failure there must fail the load
            raise exc
        if isinstance(exc, OutriderError):
            error = exc
        else:
            log.exception("model %s: request %r failed while %s", seq.request.model, seq.request.id, stage)
            error = ExecutionError(f"generation failed while {stage}: {type(exc).__name__}: {exc}")
        seq.finish_reason = seq.finish_reason or "error"
        self._fail_request(seq.request, error)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.active if s.cancelled]:
            seq.finish_reason = "cancelled"
            self._release(seq)  # the cache slot is free for the next request at once

    def fail_active(self, error: OutriderError) -> None:
        """Answer every active sequence with `error` and free every slot (the cache starts clean).

        For a failure no single sequence can be blamed for; waiting requests stay queued.
        """
        for seq in list(self.active):
            if seq.request is not None:
                self._fail_request(seq.request, error)
            self._release(seq)
        for slot in range(self.max_sequences):
            try:
                self.cache.reset(slot)
            except Exception:
                log.exception("resetting KV cache slot %d failed", slot)


def _adjuster(seq: Sequence, rows: list[np.ndarray]) -> Any:
    """verify.Adjust for `seq` (its rules, each row it returns recorded in `rows` for the
    log-probabilities), or None when the request sets no rules and asks for no logprobs."""
    rules = seq.rules
    if rules is None and not seq.params.logprobs:
        return None
    argmax_only = seq.params.greedy and not seq.params.logprobs  # all greedy reads of a row is its argmax

    def adjust(row: np.ndarray, path: list[int]) -> np.ndarray:
        out = rules.apply(row, path, argmax_only) if rules is not None else row
        rows.append(out)
        return out

    return adjust


def _grammatical(tree: DraftTree, rules: TokenRules) -> DraftTree:
    """`tree` without the nodes the grammar refuses (and their subtrees): a draft-side cut, like a
    probability threshold. Sampled groups keep their draws (verify.py: a pruned draw stays)."""
    import copy

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


class GenerationScheduler(Scheduler):
    """Feeds the engine from the model's queue; each plan is the requests of one engine step."""

    stateful = True

    def next_batch(self, queue: RequestQueue, idle: Optional[Any] = None, backend: Any = None) -> list[PendingRequest]:
        """Admit what fits into the engine; the requests the next step serves (what a hang or crash
        must answer), or none when nothing came within a short wait."""
        engine: GenerationEngine = backend.engine
        if engine.busy():
            new = queue.take_more(engine.capacity())
        else:
            request = queue.take(timeout=0.25, idle=idle)
            if request is None:
                return []
            new = [request] + queue.take_more(engine.capacity() - 1)
        engine.admit(new)
        return engine.requests()

    def execute(self, backend: Any, batch: list[PendingRequest]) -> list[Any]:
        """One engine step; the engine answers each request (now or in a later step)."""
        engine: GenerationEngine = backend.engine
        try:
            engine.step()
        except Exception as exc:
            # The shared forward failed: step() answered its sequences and freed their slots.
            # Anything else that escaped is a bug here; either way answer what is active, keep
            # the instance and the waiting requests, and start the next step clean.
            if not isinstance(exc, OutriderError):
                log.exception("generation step failed")
            engine.fail_active(exc if isinstance(exc, OutriderError) else
                               ExecutionError(f"generation step failed: {type(exc).__name__}: {exc}"))
        return [DEFERRED] * len(batch)
