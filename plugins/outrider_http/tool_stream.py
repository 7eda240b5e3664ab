"""A constrained answer read as it streams: plain text, or a tool call whose arguments stream.

The grammar (`Tools.constraint`) makes an answer either text that does not start with "{" or
one call `{"name": ..., "arguments": {...}}` (named choice: the arguments alone). So the first
non-blank character decides the kind, the name is known once its string closes, and every
character of the arguments after that can be passed on at once, except the call's own closing
brace, held back until the stream ends. Each API turns the events into its own shapes
(Chat Completions' tool_calls deltas, Messages' input_json_delta, Responses'
function_call_arguments.delta).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from .openai_structured import Tools

# The call object up to its arguments' first character; the grammar writes "name" first (the
# schema's order), with JSON's optional blanks.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass
class StreamEvent:
    """kind: "text" (text), "call" (a call starts: name), "arguments" (text of its arguments); the
    fronts add "thinking" (a thinking model's reasoning text) to the same stream."""

    kind: str
    text: str = ""
    name: str = ""


class ToolCallStream:
    """Feed an answer's text deltas; get the events of the text or the call they make up."""

    def __init__(self, tools: Optional[Tools]) -> None:
        self.tools = tools if tools is not None and tools.active else None
        self.kind: Optional[str] = None if self.tools is not None else "text"  # "text" | "call"
        self.pending = ""  # text read but not yet passed on
        self.name: Optional[str] = None
        self.arguments = ""  # the call's arguments as passed on so far

    def feed(self, delta: str) -> list[StreamEvent]:
        if not delta:
            return []
        if self.kind == "text":
            return [StreamEvent("text", delta)]
        self.pending += delta
        events: list[StreamEvent] = []
        if self.kind is None:
            if self.tools.named:
                self.kind, self.name = "call", self.tools.named
                events.append(StreamEvent("call", name=self.name))
            elif not self.pending.strip():
                return []
            elif self.pending.lstrip().startswith("{"):
                self.kind = "call"
            else:
                self.kind, text, self.pending = "text", self.pending, ""
                return [StreamEvent("text", text)]
        if self.name is None:
            head = _CALL_HEAD.match(self.pending)
            if head is None:
                return events
            self.name = json.loads(head.group(1))
            self.pending = self.pending[head.end():]
            events.append(StreamEvent("call", name=self.name))
        return events + self._arguments(final=False)

    def finish(self) -> list[StreamEvent]:
        """The events left once the answer is complete (the held-back tail)."""
        if self.kind is None:  # only blanks came: an empty text answer
            self.kind = "text"
            return [StreamEvent("text", self.pending)] if self.pending else []
        if self.kind == "call" and self.name is None:  # a cut-off call (max_tokens): what came, as text
            self.kind, text, self.pending = "text", self.pending, ""
            return [StreamEvent("text", text)] if text else []
        return self._arguments(final=True) if self.kind == "call" else []

    def _arguments(self, final: bool) -> list[StreamEvent]:
        text = self.pending
        if not self.tools.named:
            # Hold back a trailing run of "}" and blanks: its last brace closes the call, not the arguments.
            tail = len(text) - len(text.rstrip("} \t\r\n"))
            if final:
                stripped = text.rstrip()
                text = stripped[:-1] if stripped.endswith("}") else stripped
                self.pending = ""
            else:
                text, self.pending = text[:len(text) - tail], text[len(text) - tail:]
        else:
            self.pending = ""
        self.arguments += text
        return [StreamEvent("arguments", text)] if text else []
