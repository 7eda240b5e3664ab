"""The generation engine: continuous batching over a slot KV cache, with speculative decoding.

Each `step()` runs ONE forward pass for every active sequence together: new sequences are
prefilled, running ones feed their pending token plus a draft tree; the target's logits then
decide (losslessly) which drafted tokens are kept, tokens stream back, and finished or
cancelled sequences free their slot.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Optional

import torch

from outrider.errors import BadRequestError, ExecutionError, OutriderError
from outrider.model import PendingRequest, RequestQueue, Scheduler

from .contract import Chunk, DraftTree
from .sampling import SamplingParams, parse_prompt, parse_sampling, sample_token
from .text import IncrementalText

log = logging.getLogger("outrider.llm")


class Sequence:
    """One generation in flight. Also the `SequenceView` drafters read."""

    def __init__(self, request: Optional[PendingRequest], slot: int, prompt_ids: list[int],
                 params: SamplingParams, text: IncrementalText, speculate: bool) -> None:
        self.request = request
        self.slot = slot
        self.token_ids: list[int] = list(prompt_ids)  # prompt + generated (+ the pending token)
        self.prompt_length = len(prompt_ids)
        self.generated: list[int] = []
        self.params = params
        self.text = text
        self.speculate = speculate
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
        self.prefilled = False
        self.last_hidden: Optional[torch.Tensor] = None
        self.finish_reason: Optional[str] = None
        self.started = time.monotonic()
        self.first_token_seconds: Optional[float] = None
        self.steps = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

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
        }


class GenerationEngine:
    """Owns the model, its KV cache and the sequences using it; driven by one instance thread."""

    def __init__(self, model: Any, tokenizer: Any, strategy: Any = None, max_sequences: int = 8,
                 max_length: int = 2048, stats: Any = None) -> None:
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

    def _start(self, request: PendingRequest) -> Optional[Sequence]:
        params = parse_sampling(request.parameters, self.max_length)
        prompt, messages = parse_prompt(request.parameters)
        text = self.tokenizer.apply_chat_template(messages) if messages is not None else prompt
        prompt_ids = self.tokenizer.encode(text)
        if not prompt_ids:
            raise BadRequestError("the prompt is empty after tokenization")
        room = self.max_length - len(prompt_ids) - 1
        if room < 1:
            raise BadRequestError(
                f"the prompt is {len(prompt_ids)} tokens; this model's context holds {self.max_length}"
            )
        params.max_tokens = min(params.max_tokens, room)
        speculate = self.strategy is not None and params.speculative is not False
        seq = Sequence(request, self.free_slots.pop(), prompt_ids, params,
                       IncrementalText(self.tokenizer.decode, params.stop), speculate)
        self.cache.reset(seq.slot)
        if speculate:
            self.strategy.start(seq)
        return seq

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
        """One forward pass for all active sequences (prefill for new ones)."""
        self._drop_cancelled()
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            if request.done:  # cancelled or timed out while waiting for a slot
                continue
            try:
                self.active.append(self._start(request))
            except OutriderError as exc:
                request.fail(exc)
        if not self.active:
            return

        decoding = [s for s in self.active if s.prefilled]
        budget = self.strategy.batch_budget(len(self.active)) if self.strategy is not None else 0
        chunks: list[Chunk] = []
        trees: list[Optional[DraftTree]] = []
        for seq in self.active:
            length = self.cache.length(seq.slot)
            if not seq.prefilled:
                n = len(seq.token_ids)
                chunks.append(Chunk(seq.slot, torch.tensor(seq.token_ids), torch.arange(n)))
                trees.append(None)
                continue
            tree = DraftTree()
            remaining = seq.params.max_tokens - len(seq.generated)
            room = min(self.max_length - length - 1, remaining - 1)
            if seq.speculate and budget > 0 and room > 0:
                tree = self.strategy.propose(seq, min(budget, room))
                tree = self.strategy.limit_depth(tree, room)
            tokens = torch.tensor([seq.token_ids[-1], *tree.tokens])
            positions = length + torch.tensor([0, *tree.depths()], dtype=torch.long)
            chunks.append(Chunk(seq.slot, tokens, positions, tree.mask() if len(tree) else None))
            trees.append(tree)

        # Logits only where they are read: a prefill's last token, every row of a tree.
        rows: list[int] = []
        offset = 0
        for chunk, tree in zip(chunks, trees):
            n = len(chunk.tokens)
            rows.extend([offset + n - 1] if tree is None else range(offset, offset + n))
            offset += n
        out = self.model.forward(self.cache, chunks, logit_rows=torch.tensor(rows))
        offset = row = 0
        for seq, chunk, tree in zip(list(self.active), chunks, trees):
            n = len(chunk.tokens)
            hidden = out.hidden[offset:offset + n]
            width = 1 if tree is None else n
            logits = out.logits[row:row + width]
            offset += n
            row += width
            seq.steps += 1
            if tree is None:
                self.cache.commit(seq.slot, list(range(n)))
                seq.last_hidden = hidden[-1]
                seq.prefilled = True
                token = sample_token(logits[-1], seq.params, seq.generator)
                seq.first_token_seconds = time.monotonic() - seq.started
                self._emit(seq, [token])
                continue
            if len(tree):
                verdict = self.strategy.verify(tree, logits, seq.params, seq.generator)
                accepted, bonus = list(verdict.accepted), int(verdict.bonus)
            else:
                accepted, bonus = [], sample_token(logits[0], seq.params, seq.generator)
            keep = [0] + [i + 1 for i in accepted]
            self.cache.commit(seq.slot, keep)
            seq.last_hidden = hidden[keep[-1]]
            seq.draft_tokens += len(tree)
            seq.accepted_tokens += len(accepted)
            if seq.speculate:
                self.strategy.record(seq, len(tree), len(accepted))
            self._emit(seq, [tree.tokens[i] for i in accepted] + [bonus])
        if decoding and self.stats is not None:
            self.stats.add("decode_steps", 1)
            self.stats.add("decode_sequences", len(decoding))

    def _emit(self, seq: Sequence, tokens: list[int]) -> None:
        new: list[int] = []
        for token in tokens:
            if token in self.eos:
                seq.finish_reason = "stop"
                break
            seq.generated.append(token)
            seq.token_ids.append(token)
            new.append(token)
            if len(seq.generated) >= seq.params.max_tokens:
                seq.finish_reason = "length"
                break
        if seq.speculate and new:
            self.strategy.extend(seq, new)
        delta = seq.text.update(seq.generated, final=seq.finish_reason is not None)
        if seq.text.stopped:
            seq.finish_reason = "stop"
        if seq.request is not None and seq.params.stream and (delta or new):
            seq.request.chunk(text=delta, token_ids=new)
        if seq.finish_reason is not None:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        stats = seq.stats()
        if self.stats is not None:
            self.stats.add("generated_tokens", stats["new_tokens"])
            self.stats.add("draft_tokens", stats["draft_tokens"])
            self.stats.add("accepted_tokens", stats["accepted_tokens"])
        if seq.request is not None and seq.request.claim():
            if self.stats is not None:
                self.stats.success()
            seq.request.reply(text=seq.text.text, token_ids=seq.generated, finish_reason=seq.finish_reason,
                              stats=stats, claimed=True)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.active.remove(seq)
        self.cache.reset(seq.slot)
        self.free_slots.append(seq.slot)
        if seq.speculate:
            self.strategy.finish(seq)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.active if s.cancelled]:
            seq.finish_reason = "cancelled"
            self._release(seq)  # the cache slot is free for the next request at once

    def fail_all(self, error: OutriderError) -> None:
        """Answer every request the engine holds (the instance is being replaced)."""
        for seq in list(self.active):
            if seq.request is not None:
                seq.request.fail(error)
            self._release(seq)
        while self.waiting:
            self.waiting.popleft().fail(error)


class GenerationScheduler(Scheduler):
    """Feeds the engine from the model's queue and runs steps while it has work."""

    def serve(self, instance: Any, queue: RequestQueue) -> None:
        engine: GenerationEngine = instance.backend.engine
        if engine.busy():
            new = queue.take_more(engine.capacity())
        else:
            request = queue.take(timeout=0.25)
            if request is None:
                return
            new = [request] + queue.take_more(engine.capacity() - 1)
        engine.admit(new)
        instance.current = engine.requests()  # what a hang or crash must answer
        instance.busy_since = time.monotonic()
        try:
            engine.step()
        except OutriderError as exc:
            engine.fail_all(exc)
        except Exception as exc:  # answer everyone, keep the instance: the next step starts clean
            log.exception("generation step failed")
            engine.fail_all(ExecutionError(f"generation step failed: {type(exc).__name__}: {exc}"))
        finally:
            instance.busy_since = None
            instance.current = []
