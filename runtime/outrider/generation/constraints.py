"""What a request adds to the target's logits: logit_bias, presence/frequency penalties, min_tokens
and a grammar.

These are part of the target distribution (`TokenRules.apply`), applied to every row the target
samples from or verifies, for the path of tokens that reaches it: a tree row at depth d sees the
penalties and the grammar state after the d tokens above it. Plain decoding samples from
`apply(row, [])`; speculative verification (`verify.verify(..., adjust=rules.apply)`) from the
same function on each row it reaches, so speculation stays exact under the same rules. Draft
nodes a grammar refuses are pruned before the forward (`allowed_prefix`): a draft-side heuristic
that changes what is verified, never what is accepted.

Log-probabilities (`token_logprobs`) are read off the distribution the token was drawn from:
log softmax of the adjusted row when greedy, the log of `target_distribution` (temperature,
top-k, top-p) when sampling.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from outrider.errors import BadRequestError, ExecutionError

from .reasoning import ANSWER, MAYBE, THINKING, ThinkTags, walk
from .sampling import host_array, is_greedy, target_distribution

MAX_LOGIT_BIAS = 1024  # entries
MAX_TOP_LOGPROBS = 20  # as OpenAI's


def parse_logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """{token id: bias in [-100, 100]} from OpenAI's {"id": bias} map (ids as strings or ints)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise BadRequestError(f"parameter 'logit_bias' must be a map of at most {MAX_LOGIT_BIAS} token ids to "
                              f"numbers between -100 and 100")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequestError(f"parameter 'logit_bias': key {str(key)[:32]!r} is not a token id") from None
        if not 0 <= token < vocab_size:
            raise BadRequestError(f"parameter 'logit_bias': token id {token} is outside the vocabulary "
                                  f"(0 .. {vocab_size - 1})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -100 <= bias <= 100:
            raise BadRequestError(f"parameter 'logit_bias': the bias of token {token} must be a number between "
                                  f"-100 and 100, got {bias!r}")
        out[token] = float(bias)
    return out


class TokenRules:
    """One sequence's adjustments of the target's logits (see the module docstring)."""

    def __init__(self, vocab_size: int, logit_bias: Optional[dict[int, float]] = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 grammar: Any = None, eos_ids: frozenset[int] = frozenset(),
                 min_tokens: int = 0, ending_ids: frozenset[int] = frozenset(),
                 thinking: Optional[tuple[ThinkTags, str]] = None) -> None:
        self.vocab_size = vocab_size
        self.bias: Optional[tuple[np.ndarray, np.ndarray]] = None
        if logit_bias:
            ids = np.array(sorted(logit_bias), dtype=np.int64)
            self.bias = ids, np.array([logit_bias[int(i)] for i in ids], dtype=np.float32)
        self.presence, self.frequency = float(presence_penalty), float(frequency_penalty)
        self.grammar = grammar  # grammar.GrammarState, or None
        self.eos_ids = eos_ids
        self.counts: dict[int, int] = {}  # generated tokens so far (what the penalties count)
        # min_tokens: the tokens that would end the sequence (EOS, stop_token_ids) are impossible
        # until that many are generated, as vLLM's MinTokensLogitsProcessor makes them.
        self.min_tokens = int(min_tokens)
        self.ending = np.array(sorted(t for t in ending_ids if 0 <= t < vocab_size), dtype=np.int64)
        self.generated = 0
        # A thinking model's grammar constrains the answer alone (reasoning.py): (tags, phase now).
        self.tags, self.phase = thinking if thinking is not None else (None, ANSWER)

    @property
    def active(self) -> bool:
        return bool(self.bias is not None or self.presence or self.frequency or self.grammar is not None
                    or (self.min_tokens > 0 and len(self.ending)))

    def apply(self, row: np.ndarray, path: list[int], argmax_only: bool = False) -> np.ndarray:
        """`row` (fp32 [vocab], not modified) as the request's target sees it after `path`.

        With `argmax_only` (greedy, no logprobs asked), a row whose argmax is the target's: the
        grammar's mask (~100-250 µs for a 49k vocabulary) is computed only when the unmasked
        argmax is a token the grammar refuses. Exact: if the best token is allowed, masking the
        others cannot change the first maximum."""
        out = np.array(host_array(row), dtype=np.float32)  # a copy
        if self.bias is not None:
            ids, values = self.bias
            out[ids] += values
        if self.presence or self.frequency:
            counts = dict(self.counts)
            for token in path:
                counts[token] = counts.get(token, 0) + 1
            if counts:
                ids = np.fromiter(counts, dtype=np.int64, count=len(counts))
                n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
                out[ids] -= np.float32(self.frequency) * n + np.float32(self.presence)
        if self.generated + len(path) < self.min_tokens and len(self.ending):
            out[self.ending[self.ending < out.shape[-1]]] = -np.inf
        phase, answer = self._answer_part(path)
        if self.grammar is not None and phase != THINKING and not any(t in self.eos_ids for t in answer):
            opens = phase == MAYBE  # the first token: `<think>`, or the answer's first token
            if argmax_only:
                best = int(np.argmax(out))
                if (opens and best == self.tags.open) or self.grammar.accepts(answer, best):
                    return out
            allowed = self.grammar.allowed(answer)  # bool [tokenizer vocab]
            width = min(out.shape[-1], allowed.shape[-1])
            keep = out[self.tags.open] if opens else None
            out[:width][~allowed[:width]] = -np.inf
            out[width:] = -np.inf  # ids past the tokenizer's vocabulary (padded heads) never fit
            if opens:
                out[self.tags.open] = keep
        return out

    def _answer_part(self, path: list[int]) -> tuple[str, list[int]]:
        """(the phase after the committed tokens and `path`, the answer's tokens in `path`)."""
        if self.tags is None:
            return ANSWER, path
        phase, start = walk(self.phase, list(path), self.tags)
        return phase, list(path[start:])

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (none without a grammar), at most `limit`."""
        return self.grammar.forced_tokens()[:limit] if self.grammar is not None and self.phase == ANSWER else []

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (a draft path after the committed ones) the grammar accepts."""
        if self.grammar is None:
            return len(tokens)
        phase, answer = self._answer_part(tokens)
        return len(tokens) - len(answer) + self.grammar.valid_prefix(answer)

    def commit(self, tokens: list[int]) -> None:
        """`tokens` were emitted (EOS excluded unless the request ignores it)."""
        self.generated += len(tokens)
        for token in tokens:
            self.counts[token] = self.counts.get(token, 0) + 1
        phase, answer = self._answer_part(tokens)
        self.phase = phase
        if self.grammar is not None and answer:
            self.grammar.commit(answer)

    @property
    def finished(self) -> bool:
        """The grammar allows nothing but the end: the sequence is complete."""
        return self.grammar is not None and self.phase == ANSWER and self.grammar.finished


def token_logprobs(row: np.ndarray, token: int, params: Any, top: int,
                   decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """{"token_id", "token", "logprob", "top": [{"token_id", "token", "logprob"}, ...]} of `token`
    under the distribution it was drawn from (`row` already adjusted by the request's rules)."""
    row = host_array(row)
    if is_greedy(params.temperature):
        shifted = row - row.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
    else:
        with np.errstate(divide="ignore"):
            logprobs = np.log(target_distribution(row, params.temperature, params.top_k, params.top_p))

    def one(i: int, value: float) -> dict[str, Any]:
        return {"token_id": i, "token": decode([i]), "logprob": _finite(value)}

    entry = one(int(token), float(logprobs[token]))
    if top:
        k = min(top, logprobs.shape[-1])
        ids = np.argpartition(-logprobs, k - 1)[:k]
        ids = ids[np.lexsort((ids, -logprobs[ids]))]  # best first; ties by id
        entry["top"] = [one(int(i), float(logprobs[i])) for i in ids if logprobs[i] > -np.inf]
    return entry


def _finite(value: float) -> float:
    # -inf is not JSON; a token the rules made impossible is never drawn, but its top list may reach one.
    return value if math.isfinite(value) else -9999.0


def check_grammar_state(grammar: Any) -> None:
    """Raise if the grammar engine entered its error state (a token it refused was consumed)."""
    if grammar is not None and grammar.error:
        raise ExecutionError(f"the output constraint failed: {grammar.error}")
