"""Reading a generate request: its sampling parameters, prompt tokens and token rules.

All of it is checked before the request takes a slot, so a bad request costs only its own answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from outrider.errors import BadRequestError, ExecutionError, OutriderError
from outrider.serving.request import PendingRequest

from .constraints import TokenRules, parse_logit_bias
from .reasoning import ReasoningText, ThinkTags, first_phase, think_tags
from .sampling import SamplingParams, parse_prompt, parse_sampling, parse_template_kwargs
from .text import IncrementalText


@dataclass
class ReadRequest:
    """What a sequence starts from: its parameters, prompt ids, token rules and output text."""

    params: SamplingParams
    prompt_ids: list[int]
    rules: Optional[TokenRules]
    text: Union[IncrementalText, ReasoningText]
    ending: frozenset[int]  # the tokens that end it: EOS unless ignored, and stop_token_ids


class RequestReader:
    """Turns a generate request into what its sequence starts from, or raises that request's error."""

    def __init__(self, model: Any, tokenizer: Any, max_length: int, eos: set[int]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.eos = eos
        self._grammars: Any = None  # grammar.GrammarCompiler, made on the first constrained request
        self.tags: Optional[ThinkTags] = think_tags(tokenizer)  # a thinking model's chats are split

    def read(self, request: PendingRequest) -> ReadRequest:
        """`request`'s sampling parameters (max_tokens cut to the context), prompt ids, rules and text."""
        if request.kind != "generate":
            raise BadRequestError(f"model {request.model!r} generates text; send generate, not {request.kind}")
        params = parse_sampling(request.parameters, self.max_length)
        prompt, messages = parse_prompt(request.parameters)
        template_kwargs = parse_template_kwargs(request.parameters)
        if template_kwargs and messages is None:
            raise BadRequestError("parameter 'chat_template_kwargs' needs 'messages' (a chat), not 'prompt'")
        if messages is not None:
            if not self.tokenizer.chat_template:
                raise BadRequestError(f"model {request.model!r} has no chat template; send 'prompt' instead of 'messages'")
            try:
                text = self.tokenizer.apply_chat_template(messages, **template_kwargs)
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
        ending = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos))
        if self.tags is not None and messages is not None:
            phase = first_phase(prompt_ids, self.tags)
            output: Union[IncrementalText, ReasoningText] = ReasoningText(
                self.tokenizer.decode, params.stop, params.min_tokens, self.tags, phase)
            return ReadRequest(params, prompt_ids, self.rules(params, ending, (self.tags, phase)), output, ending)
        return ReadRequest(params, prompt_ids, self.rules(params, ending),
                           IncrementalText(self.tokenizer.decode, params.stop, params.min_tokens), ending)

    def rules(self, params: SamplingParams, ending: frozenset[int],
              thinking: Optional[tuple[ThinkTags, str]] = None) -> Optional[TokenRules]:
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
        rules = TokenRules(vocab, bias, params.presence_penalty, params.frequency_penalty, grammar, frozenset(self.eos),
                           params.min_tokens, ending, thinking)
        return rules if rules.active else None
