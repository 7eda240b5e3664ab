"""`Sequence`: the state of one generation in flight, as the engine steps it and drafters read it."""

from __future__ import annotations

import itertools
import time
from typing import Any, Optional, Union

from outrider.serving.request import PendingRequest

from .constraints import TokenRules
from .reasoning import ReasoningText
from .sampling import SamplingParams, new_generator
from .text import IncrementalText

_sequence_ids = itertools.count()


class Sequence:
    """One generation in flight. Also the `SequenceView` drafters read."""

    def __init__(self, request: Optional[PendingRequest], slot: int, prompt_ids: list[int],
                 params: SamplingParams, text: Union[IncrementalText, ReasoningText], speculate: bool,
                 ending: frozenset[int]) -> None:
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
        self.ending = ending
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
