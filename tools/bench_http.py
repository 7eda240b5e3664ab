#!/usr/bin/env python3
"""The HTTP front against the ZeroMQ path, in one run, from one server process, interleaved.

  python tools/bench_http.py               MiniLM batch 1 and SmolLM2 streaming
  python tools/bench_http.py --skip-llm    MiniLM only

One `outrider serve manifests/minilm.yaml manifests/smollm2.yaml --http ...` process serves both
fronts. The paths take turns request by request, so that load from elsewhere on the machine falls
on all of them alike; on a shared machine read the medians (p50, and the ratio taken from them),
which one stall does not move. Each path is measured as its users would call it, client library
included:

- MiniLM, one sentence per request, one closed-loop client: Outrider's `Client.infer` (ZeroMQ),
  OIP v2 infer with JSON tensors (httpx, keep-alive), OIP v2 with binary tensor data
  (tritonclient.http), and OpenAI `/v1/embeddings` (openai client). Requests/s, p50, p99.
- SmolLM2, greedy chat, streamed: `Client.generate(stream=True)` against the openai client's
  streaming chat completion, the anthropic client's `messages.stream` (/v1/messages) and the
  openai client's streamed `responses.create` (/v1/responses). Time to first token (first
  non-empty text), tokens/s over the whole request; the same tokens on every path (greedy), so
  the figures compare the paths, not the text.

Absolute numbers differ between machines; read the ratios.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SENTENCE = "Outrider serves models beside your application."
PROMPTS = [
    "Write a Python function that returns the sum of a list.",
    "Explain what a hash map is in two sentences.",
    "List three colours of the rainbow.",
    "def fibonacci(n):",
]


def free_port() -> int:
    from outrider.harness import free_port as find

    return find()


def start_server(manifests: list[str], address: str, http: str) -> subprocess.Popen:
    from outrider.harness import ServerProcess

    return ServerProcess.start(manifests, address, args=["--http", http], cwd=ROOT).proc


def wait_ready(address: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    from outrider import Client, OutriderError

    with Client(address, timeout=1.0) as client:
        try:
            client.wait_ready(timeout, interval=0.1, process=proc)
        except OutriderError as exc:
            raise SystemExit(exc.message) from None


def minilm_paths(address: str, url: str, port: int) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """name -> (one request, close)."""
    import httpx
    import openai
    import tritonclient.http as triton

    from outrider import Client

    zmq_client = Client(address, timeout=30)
    text = np.array([SENTENCE], dtype=object)

    def zmq_call() -> None:
        out = zmq_client.infer("minilm", {"text": text})["embedding"]
        assert out.shape == (1, 384)

    http = httpx.Client(base_url=url, timeout=30)
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [SENTENCE]}]}

    def v2_json() -> None:
        response = http.post("/v2/models/minilm/infer", json=body)
        assert len(response.json()["outputs"][0]["data"]) == 384

    tc = triton.InferenceServerClient(url=f"127.0.0.1:{port}")
    tensor = triton.InferInput("text", [1], "BYTES")
    tensor.set_data_from_numpy(text)

    def v2_binary() -> None:
        assert tc.infer("minilm", [tensor]).as_numpy("embedding").shape == (1, 384)

    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def embeddings() -> None:
        assert len(oa.embeddings.create(model="minilm", input=SENTENCE).data[0].embedding) == 384

    return {
        "ZeroMQ Client.infer": (zmq_call, zmq_client.close),
        "HTTP v2 JSON (httpx)": (v2_json, http.close),
        "HTTP v2 binary (tritonclient)": (v2_binary, tc.close),
        "HTTP /v1/embeddings (openai)": (embeddings, oa.close),
    }


def bench_minilm(address: str, url: str, port: int, requests: int) -> list[tuple]:
    """(path, requests/s, p50 ms, p99 ms, req/s ratio, p50 ratio) per path; paths alternate per request."""
    paths = minilm_paths(address, url, port)
    latencies: dict[str, list[float]] = {name: [] for name in paths}
    for call, _ in paths.values():  # warm up connections and code paths
        for _ in range(20):
            call()
    names = list(paths)
    for index in range(requests):
        for name in names[index % len(names):] + names[:index % len(names)]:  # rotate who goes first
            t0 = time.perf_counter()
            paths[name][0]()
            latencies[name].append(time.perf_counter() - t0)
    for _, close in paths.values():
        close()
    rows = []
    zmq = np.array(latencies[names[0]])
    for name, samples in latencies.items():
        ms = np.array(samples) * 1000
        rate = len(samples) / float(np.sum(samples))
        rows.append((name, rate, float(np.percentile(ms, 50)), float(np.percentile(ms, 99)),
                     rate / (len(zmq) / float(zmq.sum())), float(np.median(zmq)) * 1000 / float(np.percentile(ms, 50))))
    return rows


def bench_smollm2(address: str, url: str, max_tokens: int, rounds: int) -> list[tuple]:
    import openai

    from outrider import Client
    from outrider.client import GenerateChunk

    zmq_client = Client(address, timeout=300)
    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def zmq_stream(prompt: str) -> tuple[float, int, str]:
        start, first, text = time.perf_counter(), None, []
        result = None
        for item in zmq_client.generate("smollm2", messages=[{"role": "user", "content": prompt}],
                                        max_tokens=max_tokens, stream=True):
            if isinstance(item, GenerateChunk):
                if item.text and first is None:
                    first = time.perf_counter() - start
                text.append(item.text)
            else:
                result = item
        return first or 0.0, result.stats["new_tokens"], "".join(text)

    def http_stream(prompt: str) -> tuple[float, int, str]:
        start, first, text, tokens = time.perf_counter(), None, [], 0
        for chunk in oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first or 0.0, tokens, "".join(text)

    def messages_stream(prompt: str) -> tuple[float, int, str]:
        start, first, text = time.perf_counter(), None, []
        with claude.messages.stream(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                    max_tokens=max_tokens) as stream:
            for piece in stream.text_stream:
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece)
            tokens = stream.get_final_message().usage.output_tokens
        return first or 0.0, tokens, "".join(text)

    def responses_stream(prompt: str) -> tuple[float, int, str]:
        start, first, text, tokens = time.perf_counter(), None, [], 0
        for event in oa.responses.create(model="smollm2", input=prompt, max_output_tokens=max_tokens, temperature=0,
                                         stream=True):
            if event.type == "response.output_text.delta" and event.delta:
                if first is None:
                    first = time.perf_counter() - start
                text.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                tokens = event.response.usage.output_tokens
        return first or 0.0, tokens, "".join(text)

    paths = {"ZeroMQ generate(stream)": zmq_stream, "HTTP chat SSE (openai)": http_stream}
    try:
        import anthropic

        claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)
        paths["HTTP Messages SSE (anthropic)"] = messages_stream
    except ImportError:  # the anthropic SDK is a dev dependency
        pass
    paths["HTTP Responses SSE (openai)"] = responses_stream
    for run in paths.values():
        run(PROMPTS[0])  # warm up
    ttft: dict[str, list[float]] = {name: [] for name in paths}
    tokens: dict[str, int] = {name: 0 for name in paths}
    seconds: dict[str, float] = {name: 0.0 for name in paths}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    texts: dict[str, list[str]] = {name: [] for name in paths}
    for round_index in range(rounds):
        for prompt_index, prompt in enumerate(PROMPTS):
            shift = (round_index + prompt_index) % len(paths)  # each path goes first as often as the others
            order = list(paths)[shift:] + list(paths)[:shift]
            for name in order:
                start = time.perf_counter()
                first, n, text = paths[name](prompt)
                took = time.perf_counter() - start
                seconds[name] += took
                rates[name].append(n / took)
                ttft[name].append(first)
                tokens[name] += n
                texts[name].append(text)
    zmq_client.close()
    oa.close()
    same = all(texts[name] == texts["ZeroMQ generate(stream)"] for name in paths)
    rows = []
    base = float(np.median(rates["ZeroMQ generate(stream)"]))
    for name in paths:
        ms = np.array(ttft[name]) * 1000
        median = float(np.median(rates[name]))
        rows.append((name, tokens[name] / seconds[name], median, float(np.percentile(ms, 50)),
                     float(np.percentile(ms, 90)), median / base, tokens[name], same))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=800, help="MiniLM requests per path")
    parser.add_argument("--max-tokens", type=int, default=64, help="SmolLM2 tokens per request")
    parser.add_argument("--llm-rounds", type=int, default=3, help="SmolLM2 rounds over the prompts")
    parser.add_argument("--skip-llm", action="store_true", help="MiniLM only")
    args = parser.parse_args()

    manifests = [str(ROOT / "manifests/minilm.yaml")]
    if not args.skip_llm:
        manifests.append(str(ROOT / "manifests/smollm2.yaml"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/bench.sock"
        proc = start_server(manifests, address, f"127.0.0.1:{port}")
        try:
            wait_ready(address, proc)
            print(f"load before: {Path('/proc/loadavg').read_text().strip()}  ({os.cpu_count()} CPUs)")
            rows = bench_minilm(address, url, port, args.requests)
            print(f"\nMiniLM, one sentence per request, one closed-loop client, {args.requests} requests per path "
                  f"taking turns")
            print(f"{'path':32} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/s ratio':>12} {'p50 ratio':>10}")
            for name, rate, p50, p99, ratio, p50_ratio in rows:
                print(f"{name:32} {rate:8.1f} {p50:8.2f} {p99:8.2f} {ratio:11.2f}x {p50_ratio:9.2f}x")
            if not args.skip_llm:
                rows = bench_smollm2(address, url, args.max_tokens, args.llm_rounds)
                print(f"\nSmolLM2 (speculative decoding on), greedy chat streamed, {len(PROMPTS)} prompts x "
                      f"{args.llm_rounds} rounds, max_tokens {args.max_tokens}")
                print(f"{'path':32} {'tok/s':>6} {'median':>7} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} "
                      f"{'median ratio':>13} {'tokens':>7}")
                for name, rate, median, p50, p90, ratio, n, same in rows:
                    print(f"{name:32} {rate:6.1f} {median:7.1f} {p50:12.1f} {p90:12.1f} {ratio:12.2f}x {n:7d}")
                print(f"same text on every path: {rows[0][-1]}")
            print(f"\nload after: {Path('/proc/loadavg').read_text().strip()}")
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
