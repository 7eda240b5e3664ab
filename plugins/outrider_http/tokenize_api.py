"""vLLM's /tokenize and /detokenize, and how the HTTP front reaches a served model's tokenizer.

    POST /tokenize   {model, prompt | messages, add_special_tokens?, return_token_strs?}
                     -> {tokens, count, max_model_len, token_strs?}
    POST /detokenize {model, tokens, skip_special_tokens?} -> {prompt}

An embedding model's tokenizer is its task's (the `sentence-embedding` task of plugins/outrider_text),
built once in this process from the model's manifest (`ServedModel.make_task`), so the front can
tokenize without a round trip: /v1/embeddings tokenizes here too, counts what it sends, and sends
token ids. A generating model's is the `tokenizer` of a serving instance's backend (the core's
`GeneratingBackend` contract), the one its engine encodes prompts with; its tokens are those the
engine feeds for that prompt (no special tokens: a chat template writes its own).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import Any, Callable, Optional, Protocol, Sequence, TypeVar, Union, runtime_checkable

from pydantic import StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outrider.errors import BadRequestError, OutriderError, TooLargeError

from .dispatch import ClientGone, Dispatcher, off_loop as _off_loop
from .json_api import ApiError, bad_request, parse_body, Schema, served_model

log = logging.getLogger("outrider.http")
T = TypeVar("T")

#: characters a request may hold and still be tokenized on the event loop: a sentence takes tens
#: of microseconds there, less than the hop to a thread; more would stall every other connection
INLINE_CHARACTERS = 4096


@runtime_checkable
class EmbeddingTokenizer(Protocol):
    """What the front uses of an embedding model's task (plugins/outrider_text implements it)."""

    max_length: int
    max_chars: int
    vocab_size: int
    hidden_size: int
    truncate: bool
    matryoshka: bool
    dimensions: frozenset[int]

    def encode(self, texts: Sequence[Union[str, bytes]], truncate: bool = True,
               add_special_tokens: bool = True) -> list[list[int]]: ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def token_strings(self, ids: Sequence[int]) -> list[str]: ...


class ModelText:
    """One served model's tokenizer, as /tokenize and /detokenize use it."""

    #: the longest input the model takes, in tokens (vLLM's max_model_len)
    max_length: int
    #: token ids run from 0 to vocab_size - 1 (None: the tokenizer does not say)
    vocab_size: Optional[int]

    def tokenize(self, prompt: Optional[str], messages: Optional[list[dict]],
                 add_special_tokens: Optional[bool]) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        raise NotImplementedError

    def token_strings(self, ids: list[int]) -> list[str]:
        raise NotImplementedError


class EmbeddingText(ModelText):
    """An embedding model's: its text task; tokens as the model sees them ([CLS] ... [SEP])."""

    def __init__(self, task: EmbeddingTokenizer) -> None:
        self.task = task
        self.max_length, self.vocab_size = task.max_length, task.vocab_size

    def tokenize(self, prompt: Optional[str], messages: Optional[list[dict]],
                 add_special_tokens: Optional[bool]) -> list[int]:
        if messages is not None:
            raise bad_request("an embedding model has no chat template; send 'prompt'", "messages")
        return self.task.tokenize(prompt or "", add_special_tokens=add_special_tokens is not False)

    def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.task.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        return self.task.token_strings(ids)


class GenerationText(ModelText):
    """A generating model's: the tokenizer its engine encodes prompts with (ServedModel.text_tokenizer)."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.vocab_size = self.tokenizer.vocab_size

    def tokenize(self, prompt: Optional[str], messages: Optional[list[dict]],
                 add_special_tokens: Optional[bool]) -> list[int]:
        if add_special_tokens:
            raise bad_request("a generating model's prompt takes no special tokens (its chat template writes its "
                       "own); leave 'add_special_tokens' out or false", "add_special_tokens")
        if messages is not None:
            if not self.tokenizer.chat_template:
                raise bad_request("this model has no chat template; send 'prompt' instead of 'messages'", "messages")
            try:
                prompt = self.tokenizer.apply_chat_template(messages)
            except Exception as exc:  # the template's raise_exception: these messages do not fit it
                raise bad_request(f"could not render 'messages' with the chat template: {exc}", "messages") from None
        return list(self.tokenizer.encode(prompt or ""))

    def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.token_text(i) or "" for i in ids]


# Each embedding model's task, built here once (a tokenizer load: ~0.1 s), for as long as the
# served model lives.
_TASKS: "weakref.WeakKeyDictionary[Any, Optional[EmbeddingTokenizer]]" = weakref.WeakKeyDictionary()
_TASKS_LOCK = threading.Lock()


def embedding_tokenizer(model: Any) -> Optional[EmbeddingTokenizer]:
    """The task of an embedding model that tokenizes here (None: its task, if any, does not).

    Blocks for the first build: call it off the event loop (`embedding_tokenizer_async`)."""
    with _TASKS_LOCK:
        if model in _TASKS:
            return _TASKS[model]
        task = model.make_task()
        found = task if isinstance(task, EmbeddingTokenizer) else None
        _TASKS[model] = found
        return found


async def embedding_tokenizer_async(model: Any) -> Optional[EmbeddingTokenizer]:
    """`embedding_tokenizer` without blocking the event loop on its first build."""
    if model in _TASKS:
        return _TASKS[model]
    return await asyncio.to_thread(embedding_tokenizer, model)


async def model_text(model: Any) -> ModelText:
    """The tokenizer /tokenize and /detokenize use for `model` (a 400 naming `model` when it has none)."""
    if model.generates:
        return GenerationText(*model.text_tokenizer())
    task = await embedding_tokenizer_async(model)
    if task is None:
        raise bad_request(f"model '{model.name}' has no tokenizer", "model")
    return EmbeddingText(task)


async def off_loop(work: Callable[[], T], characters: int) -> T:
    """Run `work` (tokenizing) here when the request is small, else on a thread."""
    return await _off_loop(work, characters, INLINE_CHARACTERS)


class TextPart(Schema):
    type: str
    text: Optional[str] = None


class Message(Schema):
    role: str
    content: Union[str, list[TextPart]]


class TokenizeRequest(Schema):
    model: str
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    return_token_strs: bool = False


class DetokenizeRequest(Schema):
    model: str
    tokens: list[StrictInt]
    skip_special_tokens: bool = False


def routes(dispatch: Dispatcher) -> list[Route]:
    """/tokenize and /detokenize over the models of `dispatch`'s server."""
    server = dispatch.server
    limit = server.limits.max_message_bytes

    async def tokenize(request: Request) -> Response:
        try:
            body = await parse_body(request, TokenizeRequest, limit)
            model = served_model(server, body.model, load=False)
            if (body.prompt is None) == (body.messages is None):
                raise bad_request("give exactly one of 'prompt' (a string) or 'messages'", "prompt")
            if body.add_generation_prompt is False:
                raise bad_request("the chat routes always add the generation prompt; leave 'add_generation_prompt' out",
                           "add_generation_prompt")
            messages = None if body.messages is None else [_message(i, m) for i, m in enumerate(body.messages)]
            characters = len(body.prompt) if body.prompt is not None else sum(len(m["content"]) for m in messages)
            bound = model.manifest.limits.max_element_bytes
            if characters > bound:
                raise TooLargeError(f"the prompt holds {characters} characters; this model's limit is "
                                    f"limits.max_element_bytes = {bound}")
            text = await model_text(model)
            tokens = await off_loop(lambda: text.tokenize(body.prompt, messages, body.add_special_tokens), characters)
            out: dict[str, Any] = {"count": len(tokens), "max_model_len": text.max_length, "tokens": tokens}
            if body.return_token_strs:
                out["token_strs"] = text.token_strings(tokens)
            return JSONResponse(out)
        except Exception as exc:
            return _answer(exc, "prompt")

    async def detokenize(request: Request) -> Response:
        try:
            body = await parse_body(request, DetokenizeRequest, limit)
            model = served_model(server, body.model, load=False)
            text = await model_text(model)
            top = text.vocab_size
            bad = next((i for i, t in enumerate(body.tokens) if t < 0 or (top is not None and t >= top)), None)
            if bad is not None:
                raise bad_request(f"tokens[{bad}] = {body.tokens[bad]} is outside the vocabulary (0 to "
                           f"{'' if top is None else top - 1})", "tokens")
            try:
                prompt = await off_loop(lambda: text.detokenize(body.tokens, body.skip_special_tokens),
                                        len(body.tokens))
            except (IndexError, KeyError, OverflowError, ValueError) as exc:  # an id a tokenizer cannot decode
                raise bad_request(f"'tokens' cannot be decoded by this model's tokenizer: {exc}", "tokens") from None
            return JSONResponse({"prompt": prompt})
        except Exception as exc:
            return _answer(exc, "tokens")

    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]


def _message(index: int, message: Message) -> dict[str, str]:
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" for part in content):
            raise bad_request(f"messages[{index}].content: only text parts are supported", "messages")
        content = "".join(part.text or "" for part in content)
    return {"role": message.role, "content": content}


def _answer(exc: Exception, param: str) -> Response:
    if isinstance(exc, ClientGone):  # left mid-body: nobody reads the answer
        return Response(status_code=499)
    if isinstance(exc, BadRequestError):  # the tokenizer's own refusal: about the text it was given
        return ApiError.of(exc, param).response()
    if not isinstance(exc, (ApiError, OutriderError)):
        log.exception("HTTP tokenize/detokenize failed")
    return ApiError.of(exc).response()
