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

import logging
import time
from collections import deque
from typing import Any, Optional

import numpy as np

from outrider.errors import ExecutionError, OutriderError
from outrider.serving.queue import RequestQueue
from outrider.serving.request import DEFERRED, PendingRequest
from outrider.serving.scheduler import Scheduler

from .constraints import check_grammar_state, token_logprobs
from .contract import Chunk, DraftLimits, DraftTree, StepOutcome, check_tokenizer
from .drafting import draft_trees
from .prefix_cache import PrefixCache
from .prefix_sharing import reuse_prefix, shares_a_prefill, store_prefix
from .request_reader import RequestReader
from .sampling import SamplingParams, host_array, sample_token
from .sequence import Sequence
from .reasoning import ReasoningText
from .text import IncrementalText
from .verify import verify

log = logging.getLogger("outrider.llm")


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
        self.reader = RequestReader(model, tokenizer, max_length, self.eos)
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
        read = self.reader.read(request)
        params = read.params
        speculate = self.strategy is not None and params.speculative is not False
        if self.stats is not None:
            self.stats.observe("queue_seconds", time.monotonic() - request.received)
        slot = self.free_slots.pop()
        seq: Optional[Sequence] = None
        try:
            seq = Sequence(request, slot, read.prompt_ids, params, read.text, speculate, read.ending)
            seq.rules = read.rules
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

    def warm_up(self, prompt_ids: list[int], max_tokens: int = 8, temperature: float = 0.0) -> list[int]:
        """Generate from `prompt_ids` outside any request (prefill, drafts, verification); not counted in stats."""
        stats, self.stats = self.stats, None  # warmup tokens are not served tokens
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
            seq = Sequence(None, self.free_slots.pop(), prompt_ids, params,
                           IncrementalText(self.tokenizer.decode, []), self.strategy is not None, frozenset(self.eos))
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
        prefills = sum(1 for seq in self.active if not seq.prefilled)  # DraftLimits.prefilling
        steps: list[tuple[Sequence, "Chunk | DraftLimits"]] = []
        for seq in list(self.active):
            if shares_a_prefill(self.prefix_cache, seq, prefilling):
                continue  # next step it finds that prompt's blocks in the prefix cache
            try:
                steps.append((seq, self._plan(seq, prefills)))
            except Exception as exc:  # preparing this sequence's prompt: its own failure
                self._abort(seq, exc, "preparing its step")
        # The decoding sequences' drafts, asked together so a drafting model runs once for all.
        wanted = [(seq, plan) for seq, plan in steps if isinstance(plan, DraftLimits) and seq.speculate and plan.room > 0]
        drafts = dict(zip((id(seq) for seq, _ in wanted), draft_trees(wanted, self.strategy))) if wanted else {}
        for seq, plan in steps:
            if isinstance(plan, Chunk):
                planned.append((seq, plan, None))
                continue
            tree = drafts.get(id(seq), DraftTree())
            try:
                if isinstance(tree, Exception):
                    raise tree
                planned.append((seq, self._decode_chunk(seq, tree), tree))
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

    def _plan(self, seq: Sequence, prefills: int) -> "Chunk | DraftLimits":
        """What `seq` feeds this step: its prompt (a Chunk), or, decoding, the limits of its draft
        (`prefills` sequences of the step feed their prompts: DraftLimits.prefilling)."""
        length = self.cache.length(seq.slot)
        if not seq.prefilled:
            n = len(seq.token_ids)
            if self.prefix_cache is not None and seq.request is not None and length == 0:
                reuse_prefix(self.prefix_cache, self.cache, seq, self.stats)
                length = self.cache.length(seq.slot)
            return Chunk(seq.slot, np.array(seq.token_ids[length:], dtype=np.int64),
                         np.arange(length, n, dtype=np.int64))
        seq.forced_draft = False
        remaining = seq.params.max_tokens - len(seq.generated)
        room = min(self.max_length - length - 1, remaining - 1)
        return DraftLimits(room, len(self.active), self.steps, prefills)

    def _decode_chunk(self, seq: Sequence, tree: DraftTree) -> Chunk:
        """`seq`'s pending token and its draft tree, each at its position (depth past the pending one)."""
        length = self.cache.length(seq.slot)
        tokens = np.array([seq.token_ids[-1], *tree.tokens], dtype=np.int64)
        positions = length + np.array([0, *tree.depths()], dtype=np.int64)
        return Chunk(seq.slot, tokens, positions, tree.mask() if len(tree) else None)

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
            store_prefix(self.prefix_cache, self.cache, seq)
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
            before = len(seq.generated) - len(new)
            keep = seq.text.tokens_to_stop(seq.generated, before) - before  # of this step's tokens
            extra = len(new) - keep
            if extra > 0:  # a step that went past the stop string keeps plain decoding's tokens
                del seq.generated[-extra:], seq.token_ids[-extra:]
                if logprobs:
                    del seq.logprobs[-extra:]
                new, logprobs = new[:keep], logprobs[:keep]
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
            fields: dict[str, Any] = {"logprobs": logprobs} if seq.params.logprobs else {}
            if isinstance(seq.text, ReasoningText):  # a thinking model's chat: its thinking apart
                fields["reasoning"] = seq.text.reasoning_delta
            seq.request.chunk(text=delta, token_ids=new, **fields)
        if seq.finish_reason is not None:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        store_prefix(self.prefix_cache, self.cache, seq)
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
            if isinstance(seq.text, ReasoningText):
                extra["reasoning"] = seq.text.reasoning
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
