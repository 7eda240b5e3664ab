"""Incremental detokenization with stop strings: stream text that never splits a UTF-8
character and never shows a piece of a stop string."""

from __future__ import annotations

from typing import Callable


class IncrementalText:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self._decode = decode
        self.stop = stop
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
        if self.stop:
            start = max(0, self.emitted - self._holdback)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                self.stopped = True
                final = True
        self.text = text
        safe = len(text) if final else max(self.emitted, len(text) - self._holdback)
        delta = text[self.emitted : safe]
        self.emitted = safe
        return delta
