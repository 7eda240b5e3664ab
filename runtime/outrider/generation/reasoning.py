"""Thinking kept apart from the answer, for models whose chat template thinks (Qwen3, DeepSeek-R1
distills: `<think> ... </think>` before the answer).

A model thinks when `<think>` and `</think>` are single tokens of its vocabulary and its chat
template writes `<think>`. Only chat requests (`messages`) are split, as vLLM's and llama.cpp's
servers split them: a raw `prompt` gets the model's text as it is.

Where the thinking starts is read off the tokens, not the text: it is open at the first
generated token when the rendered prompt's last `<think>` comes after its last `</think>` (a
template that opens it in the generation prompt, DeepSeek-R1's); otherwise it opens when the
first generated token is `<think>` (Qwen3's), and never later. `</think>` closes it; the rest is
the answer. With `enable_thinking: false` in `chat_template_kwargs`, Qwen3's template writes an
empty `<think></think>` into the prompt, so the model answers at once.

`ReasoningText` streams the two parts apart (stop strings and `min_tokens` apply to the answer,
counted in generated tokens as vLLM counts them); `walk` is the same reading for the
token rules, so a grammar constrains the answer alone (constraints.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .text import IncrementalText

#: where a sequence's next token stands: before its first token ("maybe": `<think>` may open the
#: thinking), inside the thinking, or in the answer
MAYBE, THINKING, ANSWER = "maybe", "thinking", "answer"


@dataclass(frozen=True)
class ThinkTags:
    """The token ids of `<think>` and `</think>`."""

    open: int
    close: int


def think_tags(tokenizer: Any) -> Optional[ThinkTags]:
    """The tokenizer's think tags when its model thinks (see the module docstring), else None."""
    if "<think>" not in (tokenizer.chat_template or ""):
        return None
    try:
        # What encode adds to every text (a BOS) is what it gives for "": not part of a tag.
        lead = len(tokenizer.encode(""))
        opening, closing = tokenizer.encode("<think>")[lead:], tokenizer.encode("</think>")[lead:]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode them has no such tags
        return None
    if len(opening) != 1 or len(closing) != 1 or opening == closing:
        return None
    return ThinkTags(opening[0], closing[0])


def first_phase(prompt_ids: list[int], tags: ThinkTags) -> str:
    """The phase of the first generated token: THINKING when the prompt leaves `<think>` open."""
    last_open = max((i for i, t in enumerate(prompt_ids) if t == tags.open), default=-1)
    last_close = max((i for i, t in enumerate(prompt_ids) if t == tags.close), default=-1)
    return THINKING if last_open > last_close else MAYBE


def walk(phase: str, tokens: list[int], tags: ThinkTags) -> tuple[str, int]:
    """(the phase after `tokens`, the index in `tokens` where the answer starts; len(tokens) if it
    does not start within them). A think tag ends up in neither part."""
    for index, token in enumerate(tokens):
        if phase == MAYBE:
            if token == tags.open:
                phase = THINKING
                continue
            return ANSWER, index
        if phase == THINKING and token == tags.close:
            return ANSWER, index + 1
        if phase == ANSWER:
            return ANSWER, index
    return phase, len(tokens)


class ReasoningText:
    """IncrementalText's interface over a thinking model's tokens: `update` returns the answer's
    new text and leaves the thinking's in `reasoning_delta`; `text` and `reasoning` are the parts."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], min_tokens: int,
                 tags: ThinkTags, phase: str) -> None:
        self._decode, self._stop, self._min_tokens = decode, stop, min_tokens
        self.tags, self.start_phase = tags, phase
        self._thinking = IncrementalText(decode, [])
        self._answer: Optional[IncrementalText] = None
        self._answer_from = 0  # index in the generated tokens where the answer starts
        self.reasoning_delta = ""
        self._lead = {"reasoning": True, "answer": True}  # blanks after a tag are dropped

    @property
    def text(self) -> str:
        return self._answer.text.lstrip() if self._answer is not None else ""

    @property
    def reasoning(self) -> str:
        return self._thinking.text.lstrip()

    @property
    def stopped(self) -> bool:
        return self._answer is not None and self._answer.stopped

    @property
    def matched(self) -> Optional[str]:
        return self._answer.matched if self._answer is not None else None

    def update(self, token_ids: list[int], final: bool = False) -> str:
        phase, start = walk(self.start_phase, token_ids, self.tags)
        thinking_from = 1 if self.start_phase == MAYBE and token_ids[:1] == [self.tags.open] else 0
        thinking_to = start - 1 if phase == ANSWER and start > thinking_from else start  # the close tag out
        self.reasoning_delta = self._trim("reasoning", self._thinking.update(
            token_ids[thinking_from:thinking_to], final=final or phase == ANSWER))
        if phase != ANSWER:
            return ""
        if self._answer is None:
            self._answer_from = start
            self._answer = IncrementalText(self._decode, self._stop, max(0, self._min_tokens - start))
        return self._trim("answer", self._answer.update(token_ids[start:], final=final))

    def _trim(self, part: str, delta: str) -> str:
        # "<think>\n...\n</think>\n\n" wraps the parts in blank lines: drop those before each part's
        # first character, so that the streamed deltas concatenate to `reasoning` and `text`.
        if self._lead[part] and delta:
            delta = delta.lstrip()
            self._lead[part] = not delta
        return delta

    def tokens_to_stop(self, token_ids: list[int], before: int) -> int:
        """IncrementalText.tokens_to_stop over the answer's tokens (a stop string ends only the answer)."""
        start = self._answer_from
        return start + self._answer.tokens_to_stop(token_ids[start:], max(0, before - start))
