"""Large OIP JSON bodies parsed in a worker process, so their parsing never holds the server's GIL.

`json.loads` is one C call: on a thread it still holds the interpreter for its whole length (84 ms
for a million-element BYTES body), and every other client's request waits behind it; a flood of
such bodies made an innocent client's p99 15x its idle value. A JSON body over
WORKER_BYTES goes to a child process instead, in two steps with the parent's check between them:

    parent -> worker   {"op": "parse"} + the JSON text        (frames: 4-byte little-endian length + bytes)
    worker -> parent   {"ok": true, "document": {... inputs without their data}, "inputs": [descriptions]}
    parent             checks the shapes against the model's contract and limits (backend.check_shapes)
    parent -> worker   {"op": "pack"} or {"op": "drop"}
    worker -> parent   {"ok": true, "sizes": [...]} + the packed buffers, one frame

Only JSON and raw bytes cross the pipe (no pickle). Errors come back as {"ok": false, "error":
CLASS, "message": ...} and are raised again as that OutriderError. One worker serves one request
at a time (an asyncio lock): a second large body waits for the first, while small bodies are
parsed inline as before. A worker that dies is started again for the next request.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
from typing import Any, Callable, Optional

from outrider import errors

WORKER_BYTES = 1 << 20  # JSON text above this is parsed by the worker


def _frame(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


class JsonWorker:
    """The parent's side: one child process, started on first use."""

    def __init__(self) -> None:
        self._proc: Optional[asyncio.subprocess.Process] = None
        self._lock = asyncio.Lock()

    async def _start(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "outrider_http.json_worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, limit=1 << 20)
        return self._proc

    async def _send(self, proc: Any, *parts: bytes) -> None:
        proc.stdin.write(b"".join(_frame(p) for p in parts))
        await proc.stdin.drain()

    async def _receive(self, proc: Any) -> bytes:
        size = struct.unpack("<I", await proc.stdout.readexactly(4))[0]
        return await proc.stdout.readexactly(size)

    async def parse(self, text: bytes, max_elements: int,
                    check: Callable[[dict], None]) -> tuple[dict, list[dict], list[bytes]]:
        """(document, input descriptions, packed buffers) of an OIP JSON body, as kserve parses it."""
        async with self._lock:
            proc = await self._start()
            try:
                await self._send(proc, json.dumps({"op": "parse", "max_elements": max_elements}).encode(), text)
                answer = _raise_if_failed(json.loads(await self._receive(proc)))
                try:
                    check({d["name"]: (d["datatype"], tuple(d["shape"])) for d in answer["inputs"]})
                except BaseException:
                    await self._send(proc, b'{"op": "drop"}')
                    _raise_if_failed(json.loads(await self._receive(proc)))
                    raise
                await self._send(proc, b'{"op": "pack"}')
                sizes = _raise_if_failed(json.loads(await self._receive(proc)))["sizes"]
                packed = await self._receive(proc)
            except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError):
                self._proc = None
                raise errors.InternalError("the JSON parsing process died; retry") from None
            except asyncio.CancelledError:  # a client gone mid-parse: the worker's state is unknown
                proc.kill()
                self._proc = None
                raise
        buffers, offset = [], 0
        for size in sizes:
            buffers.append(packed[offset:offset + size])
            offset += size
        return answer["document"], answer["inputs"], buffers

    def close(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()


def _raise_if_failed(answer: dict) -> dict:
    if not answer.get("ok"):
        cls = getattr(errors, str(answer.get("error")), None)
        if not (isinstance(cls, type) and issubclass(cls, errors.OutriderError)):
            cls = errors.InternalError
        raise cls(answer.get("message", ""))
    return answer


def main() -> None:
    """The worker: parse, then pack or drop, one request at a time, until stdin closes."""
    from outrider.protocol import Limits

    from .infer_request import pack_inputs, parse_document

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def read() -> Optional[bytes]:
        head = stdin.read(4)
        if len(head) < 4:
            return None
        return stdin.read(struct.unpack("<I", head)[0])

    def write(*parts: bytes) -> None:
        stdout.write(b"".join(_frame(p) for p in parts))
        stdout.flush()

    def failed(exc: Exception) -> bytes:
        name = type(exc).__name__ if isinstance(exc, errors.OutriderError) else "ProtocolError"
        return json.dumps({"ok": False, "error": name, "message": str(exc)[:2000]}).encode()

    while True:
        request = read()
        if request is None:
            return
        order, text = json.loads(request), read() or b""
        try:
            document, specs = parse_document(text, Limits(max_tensor_elements=order["max_elements"]))
            described = [{"name": s["name"], "datatype": s.get("datatype"), "shape": s["shape"]} for s in specs]
            slim = {k: v for k, v in document.items() if k != "inputs"}
            write(json.dumps({"ok": True, "document": slim, "inputs": described}).encode())
        except Exception as exc:  # noqa: BLE001 - every failure is this request's answer
            write(failed(exc))
            continue
        step = json.loads(read() or b"{}")
        if step.get("op") != "pack":
            write(b'{"ok": true}')
            continue
        try:
            buffers = pack_inputs(specs, memoryview(b""))
            write(json.dumps({"ok": True, "sizes": [len(b) for b in buffers]}).encode(), b"".join(buffers))
        except Exception as exc:  # noqa: BLE001
            write(failed(exc))


if __name__ == "__main__":
    main()
