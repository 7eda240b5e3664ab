"""Incremental detokenization with stop strings: stream text that never splits a UTF-8
character and never shows a piece of a stop string."""

from __future__ import annotations

from typing import Callable, Optional


class IncrementalText:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], min_tokens: int = 0) -> None:
        self._decode = decode
        self.stop = stop
        self.min_tokens = min_tokens  # stop strings end nothing before this many tokens (vLLM's rule)
        self.matched: Optional[str] = None  # the stop string that ended the text
        self.matched_at = -1  # the character where it starts
        self._floor: Optional[int] = None  # characters a stop string must end past (min_tokens)
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # stable text so far (stop string removed once found)
        self.emitted = 0  # characters of `text` already streamed
        self.stopped = False

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """Feed all generated tokens so far; returns the new text that is safe to stream."""
        text = self._decode(token_ids)
        if not final:
            # A byte-level tokenizer shows half a UTF-8 character as U+FFFD until the rest arrives.
            text = text.rstrip("\ufffd")
        if self.stop and len(token_ids) >= self.min_tokens:
            if self._floor is None:
                # A match must end past the text of the first min_tokens - 1 tokens, however many
                # tokens a step adds (speculation adds several): the same text stops either way.
                self._floor = len(self._decode(token_ids[:self.min_tokens - 1])) if self.min_tokens > 1 else 0
            start = max(0, self.emitted - self._holdback)
            hits = [(i, s) for i, s in ((text.find(s, max(start, self._floor - len(s) + 1)), s) for s in self.stop)
                    if i >= 0]
            if hits:
                at, self.matched = min(hits)
                self.matched_at = at
                text = text[:at]
                self.stopped = True
                final = True
        self.text = text
        safe = len(text) if final else max(self.emitted, len(text) - self._holdback)
        delta = text[self.emitted : safe]
        self.emitted = safe
        return delta

    def tokens_to_stop(self, token_ids: list[int], before: int) -> int:
        """After `update` found a stop string: how many of `token_ids` one-token steps would have
        emitted, the fewest (more than `before`) whose text already holds it. A step that added
        several tokens (speculation) keeps the same tokens as plain decoding so."""
        end = self.matched_at + len(self.matched or "")
        for count in range(before + 1, len(token_ids)):
            if self._decode(token_ids[:count])[self.matched_at:end] == self.matched:
                return count
        return len(token_ids)
