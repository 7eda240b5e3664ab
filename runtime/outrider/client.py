"""Python clients: `Client` (blocking) and `AsyncClient` (asyncio), both over a DEALER socket."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Optional, Union

import numpy as np
import zmq
import zmq.asyncio

from .errors import OutriderError, ProtocolError, RequestTimeoutError, UnavailableError, error_from_wire
from .protocol import REPLY_KINDS, decode_tensors, encode_message, parse_type_frame, unpack_header, Limits
from .transport import DEFAULT_ADDRESS, CurveClientKeys, client_socket, recv_blocking, send_frames

# Replies come from a server we chose to trust, but a client still bounds what it unpacks.
_CLIENT_LIMITS = Limits(max_message_bytes=1 << 31, max_header_bytes=16 << 20, max_header_depth=32,
                        max_tensors=4096, max_tensor_elements=1 << 31)


@dataclass
class GenerateResult:
    """A finished generation: text, token ids, why it stopped, and what speculation did."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    # With logprobs=True: per token {"token_id", "logprob", "top": [[id, logprob], ...]}.
    logprobs: Optional[list[dict]] = None
    # finish_reason "stop" not by EOS: the stop string or stop token id that ended it (vLLM's name).
    stop_reason: Optional[Union[str, int]] = None
    # A thinking model's chat (`<think>...</think>`): the thinking, kept out of `text`.
    reasoning: Optional[str] = None


@dataclass
class GenerateChunk:
    """Tokens accepted in one step (several when speculation accepted several)."""

    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict]] = None
    reasoning: str = ""  # a thinking model's chat: the thinking's new text (`text` is the answer's)


def chunk_of(header: dict) -> GenerateChunk:
    """The GenerateChunk of a streamed generate's chunk header."""
    return GenerateChunk(header.get("text", ""), list(header.get("token_ids", [])), header.get("logprobs"),
                         header.get("reasoning", ""))


def _parse(frames: list[Any]) -> tuple[str, dict, dict[str, np.ndarray]]:
    if len(frames) < 2:
        raise ProtocolError(f"reply has {len(frames)} frame(s); expected at least 2")
    kind = parse_type_frame(frames[0], REPLY_KINDS)
    header = unpack_header(frames[1].buffer if hasattr(frames[1], "buffer") else frames[1], _CLIENT_LIMITS)
    tensors = decode_tensors(header.get("outputs", []), frames[2:], _CLIENT_LIMITS) if len(frames) > 2 or header.get("outputs") else {}
    return kind, header, tensors


def _raise_if_error(header: dict) -> None:
    if not header.get("ok", True):
        raise error_from_wire(header.get("error") or {})


def generate_parameters(
    prompt: Optional[str], messages: Optional[list[dict]], max_tokens: int, temperature: float,
    top_p: float, top_k: int, seed: Optional[int], stop: Optional[Union[str, list[str]]],
    speculative: Optional[bool], stream: bool, extra: dict[str, Any],
) -> dict[str, Any]:
    """A generate request's parameters, as `Client.generate` sends them (other fronts' clients reuse it)."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt= or messages=")
    params: dict[str, Any] = {
        "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "stream": stream,
    }
    if prompt is not None:
        params["prompt"] = prompt
    if messages is not None:
        params["messages"] = messages
    if seed is not None:
        params["seed"] = seed
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if speculative is not None:
        params["speculative"] = speculative
    params.update(extra)
    return params


def result_of(header: dict) -> GenerateResult:
    """The GenerateResult of a generate request's final reply header."""
    return GenerateResult(
        text=header.get("text", ""),
        token_ids=list(header.get("token_ids", [])),
        finish_reason=header.get("finish_reason", ""),
        stats=dict(header.get("stats", {})),
        logprobs=header.get("logprobs"),
        stop_reason=header.get("stop_reason"),
        reasoning=header.get("reasoning"),
    )


class Client:
    """Blocking client. One request at a time per client; use several clients or AsyncClient for more.

    >>> with Client("tcp://127.0.0.1:5555") as c:
    ...     c.infer("minilm", {"text": np.array(["hello"], dtype=object)})["embedding"].shape
    (1, 384)
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float = 30.0,
                 curve: Optional[CurveClientKeys] = None) -> None:
        self.address = address
        self.timeout = timeout
        self._ctx = zmq.Context.instance()
        self._sock = client_socket(self._ctx, address, curve)
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        self._rcvtimeo = -1
        self._ids = itertools.count(1)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket; unsent requests are dropped."""
        self._sock.close(0)

    def _send(self, kind: str, header: dict, tensors: Optional[dict] = None, block: bool = True) -> int:
        request_id = next(self._ids)
        frames = encode_message(kind, {"id": request_id, **header}, tensors)
        try:
            send_frames(self._sock, frames, nonblock=not block)
        except zmq.Again:
            # No connection could take the message (server absent, or CURVE handshake refused).
            raise RequestTimeoutError(
                f"could not send {kind} to {self.address} within {self.timeout:g}s; "
                "is the server running, and do the CURVE keys match?"
            ) from None
        return request_id

    def _receive(self, request_id: int, deadline: float, what: str) -> tuple[str, dict, dict]:
        while True:
            left = deadline - time.monotonic()
            frames = None
            if left > 0:
                ms = max(1, int(left * 1000))
                if abs(ms - self._rcvtimeo) > self._rcvtimeo // 10:  # setsockopt only when it matters
                    self._sock.setsockopt(zmq.RCVTIMEO, ms)
                    self._rcvtimeo = ms
                frames = recv_blocking(self._sock)
            if frames is None:
                self._cancel_quietly(request_id)
                raise RequestTimeoutError(
                    f"no reply from {self.address} within {self.timeout:g}s for {what}; "
                    "is the server running and the address right?"
                )
            kind, header, tensors = _parse(frames)
            if header.get("id") == request_id:  # anything else is a late reply to a timed-out request
                return kind, header, tensors

    def _cancel_quietly(self, request_id: int) -> None:
        try:
            self._send("cancel", {"target": request_id}, block=False)
        except (zmq.ZMQError, RequestTimeoutError):
            pass

    def _call(self, kind: str, header: dict, tensors: Optional[dict], what: str,
              timeout: Optional[float]) -> tuple[dict, dict]:
        request_id = self._send(kind, header, tensors)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            reply_kind, reply, outputs = self._receive(request_id, deadline, what)
            if reply_kind == "reply":
                _raise_if_error(reply)
                return reply, outputs

    def infer(self, model: str, inputs: dict[str, np.ndarray], timeout: Optional[float] = None,
              **parameters: Any) -> dict[str, np.ndarray]:
        """Run `model` on `inputs`; returns its outputs by name (read-only arrays, no copy)."""
        _, outputs = self._call("infer", {"model": model, "parameters": parameters},
                                {k: np.asarray(v) for k, v in inputs.items()}, f"infer on {model!r}", timeout)
        return outputs

    def generate(self, model: str, prompt: Optional[str] = None, messages: Optional[list[dict]] = None,
                 max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: Optional[int] = None, stop: Optional[Union[str, list[str]]] = None,
                 speculative: Optional[bool] = None, stream: bool = False, timeout: Optional[float] = None,
                 **extra: Any) -> Union[GenerateResult, Iterator[Union[GenerateChunk, GenerateResult]]]:
        """Generate text. With stream=True, yields GenerateChunk items, then the GenerateResult."""
        params = generate_parameters(prompt, messages, max_tokens, temperature, top_p, top_k, seed,
                                      stop, speculative, stream, extra)
        if not stream:
            reply, _ = self._call("generate", {"model": model, "parameters": params}, None,
                                  f"generate on {model!r}", timeout)
            return result_of(reply)
        return self._stream(model, params, timeout)

    def _stream(self, model: str, params: dict, timeout: Optional[float]) -> Iterator[Union[GenerateChunk, GenerateResult]]:
        request_id = self._send("generate", {"model": model, "parameters": params})
        per_chunk = self.timeout if timeout is None else timeout
        finished = False
        try:
            while True:
                kind, header, _ = self._receive(request_id, time.monotonic() + per_chunk, f"generate on {model!r}")
                if kind == "chunk":
                    yield chunk_of(header)
                    continue
                finished = True
                _raise_if_error(header)
                yield result_of(header)
                return
        finally:
            if not finished:  # the caller stopped iterating: stop the server's work too
                self._cancel_quietly(request_id)

    def health(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """Server and per-model health; `ready` is True exactly when every model is ready."""
        reply, _ = self._call("health", {}, None, "health", timeout)
        reply.pop("id", None)
        reply.pop("ok", None)
        return reply

    def models(self, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """The served models with readiness, inputs and outputs."""
        reply, _ = self._call("models", {}, None, "models", timeout)
        return list(reply["models"])

    def repository(self, ready: bool = False, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """Every model the server may serve, loaded or not: name, version, state (available,
        loading, ready, unloading, failed) and reason; `ready=True` lists only the ready ones."""
        reply, _ = self._call("repository", {"ready": ready}, None, "repository", timeout)
        return list(reply["models"])

    def load(self, model: str, timeout: float = 600.0) -> dict[str, Any]:
        """Load `model` and wait until it is ready (warmed up), at most `timeout` seconds;
        returns its state and version. Raises the load's error (model_not_ready with the reason
        when it failed, insufficient_memory when it does not fit the server's budget)."""
        reply, _ = self._call("load", {"model": model, "timeout_s": timeout}, None, f"load {model!r}", timeout + 5.0)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def unload(self, model: str, cancel_streams: bool = False, timeout: Optional[float] = None) -> dict[str, Any]:
        """Unload `model` once what it took is answered (streams finish, or are cancelled with a
        reason when `cancel_streams`); returns when its memory is handed back."""
        reply, _ = self._call("unload", {"model": model, "cancel_streams": cancel_streams}, None,
                              f"unload {model!r}", 120.0 if timeout is None else timeout)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def wait_ready(self, timeout: float, interval: float = 0.02, process: Any = None) -> None:
        """Ask `health` until every model is ready (a server still starting, or not yet bound, is
        asked again every `interval` seconds). RequestTimeoutError after `timeout` seconds;
        UnavailableError as soon as `process` (a `subprocess.Popen` of the server) has exited, or a
        model the server was started with has failed for good (every instance `final`: a load that
        failed deterministically, which the supervisor does not restart), with the reasons."""
        end = time.monotonic() + timeout
        while True:
            if process is not None and process.poll() is not None:
                raise UnavailableError(f"the server process exited with {process.returncode} before it was ready")
            try:
                health = self.health(timeout=min(1.0, max(end - time.monotonic(), 0.01)))
            except OutriderError:
                health = {}
            if health.get("ready"):
                return
            failed = {name: model for name, model in (health.get("models") or {}).items()
                      if model.get("state") == "failed" and model.get("instances")
                      and all(i.get("final") for i in model["instances"])}
            if failed:
                reasons = "; ".join(f"{name}: {model.get('reason')}" for name, model in failed.items())
                raise UnavailableError(f"{self.address}: a model failed to load for good ({reasons})")
            if time.monotonic() >= end:
                raise RequestTimeoutError(f"{self.address}: not ready within {timeout:g}s")
            time.sleep(interval)


class AsyncClient:
    """asyncio client: many requests in flight on one socket, replies matched by id."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float = 30.0,
                 curve: Optional[CurveClientKeys] = None) -> None:
        self.address = address
        self.timeout = timeout
        self._sock = client_socket(zmq.asyncio.Context.instance(), address, curve)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Queue] = {}
        self._reader: Optional[asyncio.Task] = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the reader and close the socket."""
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self._sock.close(0)

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                kind, header, tensors = _parse(frames)
            except OutriderError:
                continue
            queue = self._waiting.get(header.get("id"))
            if queue is not None:
                queue.put_nowait((kind, header, tensors))

    async def _open(self, kind: str, header: dict, tensors: Optional[dict] = None) -> tuple[int, asyncio.Queue]:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        request_id = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting[request_id] = queue
        await self._sock.send_multipart(encode_message(kind, {"id": request_id, **header}, tensors), copy=False)
        return request_id, queue

    async def _next(self, request_id: int, queue: asyncio.Queue, timeout: Optional[float], what: str):
        try:
            return await asyncio.wait_for(queue.get(), self.timeout if timeout is None else timeout)
        except asyncio.TimeoutError:
            self._waiting.pop(request_id, None)
            await self._sock.send_multipart(encode_message("cancel", {"id": next(self._ids), "target": request_id}))
            raise RequestTimeoutError(f"no reply from {self.address} within {self.timeout:g}s for {what}") from None

    async def _call(self, kind: str, header: dict, tensors: Optional[dict], what: str,
                    timeout: Optional[float]) -> tuple[dict, dict]:
        request_id, queue = await self._open(kind, header, tensors)
        try:
            while True:
                reply_kind, reply, outputs = await self._next(request_id, queue, timeout, what)
                if reply_kind == "reply":
                    _raise_if_error(reply)
                    return reply, outputs
        finally:
            self._waiting.pop(request_id, None)

    async def infer(self, model: str, inputs: dict[str, np.ndarray], timeout: Optional[float] = None,
                    **parameters: Any) -> dict[str, np.ndarray]:
        """Run `model` on `inputs`; returns its outputs by name."""
        _, outputs = await self._call("infer", {"model": model, "parameters": parameters},
                                      {k: np.asarray(v) for k, v in inputs.items()}, f"infer on {model!r}", timeout)
        return outputs

    async def generate(self, model: str, prompt: Optional[str] = None, messages: Optional[list[dict]] = None,
                       max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                       seed: Optional[int] = None, stop: Optional[Union[str, list[str]]] = None,
                       speculative: Optional[bool] = None, timeout: Optional[float] = None,
                       **extra: Any) -> GenerateResult:
        """Generate text and return the finished result."""
        params = generate_parameters(prompt, messages, max_tokens, temperature, top_p, top_k, seed,
                                      stop, speculative, False, extra)
        reply, _ = await self._call("generate", {"model": model, "parameters": params}, None,
                                    f"generate on {model!r}", timeout)
        return result_of(reply)

    async def stream(self, model: str, prompt: Optional[str] = None, messages: Optional[list[dict]] = None,
                     max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     seed: Optional[int] = None, stop: Optional[Union[str, list[str]]] = None,
                     speculative: Optional[bool] = None, timeout: Optional[float] = None,
                     **extra: Any) -> AsyncIterator[Union[GenerateChunk, GenerateResult]]:
        """Generate with streaming: yields GenerateChunk items, then the GenerateResult."""
        params = generate_parameters(prompt, messages, max_tokens, temperature, top_p, top_k, seed,
                                      stop, speculative, True, extra)
        request_id, queue = await self._open("generate", {"model": model, "parameters": params})
        finished = False
        try:
            while True:
                kind, header, _ = await self._next(request_id, queue, timeout, f"generate on {model!r}")
                if kind == "chunk":
                    yield chunk_of(header)
                    continue
                finished = True
                _raise_if_error(header)
                yield result_of(header)
                return
        finally:
            if self._waiting.pop(request_id, None) is not None and not finished:
                await self._sock.send_multipart(encode_message("cancel", {"id": next(self._ids), "target": request_id}))

    async def health(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """Server and per-model health."""
        reply, _ = await self._call("health", {}, None, "health", timeout)
        reply.pop("id", None)
        reply.pop("ok", None)
        return reply

    async def models(self, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """The served models with readiness, inputs and outputs."""
        reply, _ = await self._call("models", {}, None, "models", timeout)
        return list(reply["models"])

    async def repository(self, ready: bool = False, timeout: Optional[float] = None) -> list[dict[str, Any]]:
        """As Client.repository."""
        reply, _ = await self._call("repository", {"ready": ready}, None, "repository", timeout)
        return list(reply["models"])

    async def load(self, model: str, timeout: float = 600.0) -> dict[str, Any]:
        """As Client.load."""
        reply, _ = await self._call("load", {"model": model, "timeout_s": timeout}, None, f"load {model!r}",
                                    timeout + 5.0)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def unload(self, model: str, cancel_streams: bool = False, timeout: Optional[float] = None) -> dict[str, Any]:
        """As Client.unload."""
        reply, _ = await self._call("unload", {"model": model, "cancel_streams": cancel_streams}, None,
                                    f"unload {model!r}", 120.0 if timeout is None else timeout)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}
