"""Structured output: a request's constraint compiled by llguidance into a token mask per step.

Why llguidance (tools/bench_grammar.py measured the three engines on SmolLM2's 49k vocabulary):
its masks cost tens of microseconds per token on a JSON schema, it compiles a schema in
milliseconds without a per-vocabulary precompute, it needs neither torch nor a GPU (it is a Rust
library with a small wheel for x86-64 and ARM alike), it rolls back tokens (what a draft tree
needs), and llama.cpp ships it.

The constraint (ZeroMQ `generate` parameter `constraint`, one key):
    {"json_schema": {...}}   a JSON schema            {"json_object": true}   any JSON object
    {"regex": "..."}         a regular expression     {"choice": ["a", ...]}  one of these strings
    {"lark": "..."}          a Lark grammar (llguidance's dialect)
JSON comes out laid out as `json.dumps` writes it (JSON_LAYOUT). A constraint that does not
compile is a BadRequestError naming it. llguidance is imported only
when a request carries a constraint.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

from outrider.errors import BadRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_CHOICES, MAX_CHOICE_CHARS = 256, 512
COMPILED_CACHE = 64  # grammars kept compiled, by their text
# JSON as `json.dumps` writes it: one space after "," and ":", no other whitespace. A small model
# given free whitespace can spend its whole budget on newlines; a schema that wants it says
# "x-guidance": {"whitespace_flexible": true} (llguidance reads that key over these defaults).
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def parse_constraint(value: Any) -> Optional[tuple[str, Any]]:
    """(kind, value) of a `constraint` parameter, bounded; None when absent."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in KINDS:
        raise BadRequestError(f"parameter 'constraint' must be a map with one of {', '.join(KINDS)}, "
                              f"got {str(value)[:100]}")
    kind, spec = next(iter(value.items()))
    size = len(json.dumps(spec, default=str))
    if size > MAX_CONSTRAINT_BYTES:
        raise BadRequestError(f"parameter 'constraint.{kind}' is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}")
    if kind == "json_schema" and not isinstance(spec, (dict, bool)):
        raise BadRequestError("parameter 'constraint.json_schema' must be a JSON schema (an object)")
    if kind == "json_object" and spec is not True:
        raise BadRequestError("parameter 'constraint.json_object' must be true")
    if kind in ("regex", "lark") and (not isinstance(spec, str) or not spec):
        raise BadRequestError(f"parameter 'constraint.{kind}' must be a non-empty string")
    if kind == "choice" and (not isinstance(spec, list) or not 0 < len(spec) <= MAX_CHOICES or not all(
            isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in spec)):
        raise BadRequestError(f"parameter 'constraint.choice' must be a list of 1 to {MAX_CHOICES} non-empty "
                              f"strings of at most {MAX_CHOICE_CHARS} characters")
    return kind, spec


class GrammarCompiler:
    """Compiles constraints for one tokenizer (its llguidance view is built once, on first use)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        self._json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, sorted(eos_ids)
        self._tokenizer: Any = None
        self._grammars: OrderedDict[str, str] = OrderedDict()  # constraint text -> validated grammar
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                try:
                    import llguidance
                except ImportError:
                    raise BadRequestError("structured output needs the llguidance package, which this server lacks "
                                          "(pip install 'outrider[llm]')") from None
                # ~1 s for a 49k vocabulary: once per model, on its first constrained request.
                self._tokenizer = llguidance.LLTokenizer(self._json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_ids or None)
            return self._tokenizer

    def grammar(self, kind: str, spec: Any) -> str:
        """llguidance's grammar for a parsed constraint, checked; BadRequestError names what failed."""
        from llguidance import LLMatcher

        if kind == "json_object":
            kind, spec = "json_schema", {"type": "object"}
        key = kind + "\0" + json.dumps(spec, sort_keys=True)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        try:
            if kind == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(spec)
            elif kind == "choice":  # Lark string literals take JSON's escapes
                grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
            else:
                grammar = LLMatcher.grammar_from_lark(spec)
        except (ValueError, TypeError) as exc:
            raise BadRequestError(f"parameter 'constraint.{kind}' does not compile: {exc}") from None
        error = LLMatcher.validate_grammar(grammar, self._ll_tokenizer())
        if error:
            raise BadRequestError(f"parameter 'constraint.{kind}' does not compile: {error[:500]}")
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > COMPILED_CACHE:
                self._grammars.popitem(last=False)
        return grammar

    def state(self, kind: str, spec: Any) -> "GrammarState":
        """A fresh matcher for a parsed constraint."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll_tokenizer(), self.grammar(kind, spec), log_level=0)
        if matcher.is_error():
            raise BadRequestError(f"parameter 'constraint.{kind}' does not compile: {matcher.get_error()[:500]}")
        return GrammarState(matcher, self.vocab_size)


class GrammarState:
    """One sequence's matcher: its committed tokens, plus the tentative path a step is looking at."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.tentative: list[int] = []  # consumed beyond the committed tokens
        self.masks_computed = 0

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""

    @property
    def finished(self) -> bool:
        return not self.tentative and self.matcher.is_stopped()

    def _sync(self, path: list[int]) -> None:
        """Make the matcher's state that after the committed tokens plus `path`."""
        common = 0
        while common < min(len(path), len(self.tentative)) and path[common] == self.tentative[common]:
            common += 1
        if len(self.tentative) > common:
            self.matcher.rollback(len(self.tentative) - common)
            del self.tentative[common:]
        for token in path[common:]:
            if not self.matcher.consume_token(token):
                raise ValueError(f"the constraint refused token {token} after {self.tentative}: "
                                 f"{self.matcher.get_error()}")
            self.tentative.append(token)

    def allowed(self, path: list[int]) -> np.ndarray:
        """bool [vocab]: the tokens the constraint allows after `path`."""
        self._sync(path)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self.masks_computed += 1
        return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)

    def accepts(self, path: list[int], token: int) -> bool:
        """Whether the constraint allows `token` after `path` (without computing a whole mask)."""
        if token >= self.vocab_size:
            return False
        self._sync(path)
        return self.matcher.validate_tokens([token]) == 1

    def forced_tokens(self) -> list[int]:
        """Tokens the constraint forces after the committed ones (llguidance's fast-forward tokens)."""
        self._sync([])
        return list(self.matcher.compute_ff_tokens())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, after the committed ones, the constraint accepts."""
        self._sync([])
        return self.matcher.validate_tokens(tokens)

    def commit(self, tokens: list[int]) -> None:
        self._sync(tokens)
        self.tentative = []
