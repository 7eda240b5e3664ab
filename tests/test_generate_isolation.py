"""One generation's failure costs that generation only (served for real, on tiny models).

A greedy stream runs while a request that fails is admitted next to it: a chat template that
raises, `messages` for a model without a template, a drafter whose `start` or `extend` raises.
The stream must finish as if alone, the failing request gets its own clear error, and every
KV-cache slot comes back. A failure of the forward pass all sequences share fails the step's
sequences, and the engine keeps serving. Also: `infer` sent to a generating model, and a
generating backend asked to run in a worker process.

The model is `tests/plugins/outrider_test_hf_llama.py` (transformers' Llama, tiny and random,
through the core engine); it misbehaves on the prompts and options its docstring lists.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from conftest import MANIFESTS, write_manifest  # noqa: E402
from outrider import BadRequestError, OutriderError  # noqa: E402

HF_PLUGINS = ["outrider_test_hf_llama", "outrider_speculative"]
HEALTHY = "the quick brown fox jumps over the lazy dog"
LONG = 200  # tokens of the healthy stream: hundreds of steps, so the bad request lands mid-stream

# Refuses a system message, as some models' templates do ("System role not supported").
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{{ m['content'] }}\n{% endfor %}"
)


def _manifest(tmp_path, name: str, **extra) -> str:
    return write_manifest(tmp_path, yaml.safe_dump({"name": name, "backend": "hf-llama", **extra}), f"{name}.yaml")


def _alongside_a_stream(server, model: str, bad_calls):
    """Start a greedy stream on `model`; once its first chunk is in, run each of `bad_calls`
    (callables taking a client) from another client. Returns (the stream's chunks and final
    result or error, what each bad call raised or returned)."""
    outcome: list = []
    with server.client(timeout=60) as a, server.client(timeout=60) as b:
        stream = a.generate(model, prompt=HEALTHY, max_tokens=LONG, stream=True)
        chunks = [next(stream)]  # prefilled and decoding
        results = []
        for call in bad_calls:
            try:
                results.append(call(b))
            except OutriderError as exc:
                results.append(exc)
        try:
            chunks.extend(stream)
            outcome = chunks
        except OutriderError as exc:
            outcome = exc
    return outcome, results


def _wait_all_slots_free(server, model: str, slots: int = 4) -> dict:
    end = time.monotonic() + 10
    while True:
        with server.client(timeout=10) as client:
            backend = client.health()["models"][model]["instances"][0]["backend"]
        if backend["free_slots"] == slots and not backend["active_sequences"] or time.monotonic() > end:
            assert backend["free_slots"] == slots and not backend["active_sequences"], backend
            return backend
        time.sleep(0.02)


def _check_unaffected(server, model: str, outcome) -> None:
    assert not isinstance(outcome, Exception), f"the healthy stream failed: {outcome}"
    final = outcome[-1]
    assert final.finish_reason == "length" and len(final.token_ids) == LONG
    assert "".join(c.text for c in outcome[:-1]) == final.text
    with server.client(timeout=60) as client:
        alone = client.generate(model, prompt=HEALTHY, max_tokens=LONG)
    assert final.token_ids == alone.token_ids, "the stream's tokens changed because of its neighbour"


def test_failing_chat_template_and_missing_template_fail_alone(tmp_path, server_factory):
    strict = _manifest(tmp_path, "strict", options={"chat_template": STRICT_TEMPLATE})
    bare = _manifest(tmp_path, "bare", options={"chat_template": None})
    server = server_factory([strict, bare], HF_PLUGINS)
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    user = [{"role": "user", "content": "hi"}]
    outcome, (refused, rendered) = _alongside_a_stream(server, "strict", [
        lambda c: c.generate("strict", messages=system, max_tokens=4),
        lambda c: c.generate("strict", messages=user, max_tokens=4),
    ])
    assert isinstance(refused, BadRequestError), refused
    assert "chat template" in refused.message and "System role not supported" in refused.message
    assert len(rendered.token_ids) == 4  # the template itself works
    _check_unaffected(server, "strict", outcome)
    _wait_all_slots_free(server, "strict")

    outcome, (missing,) = _alongside_a_stream(server, "bare", [lambda c: c.generate("bare", messages=user)])
    assert isinstance(missing, BadRequestError), missing
    assert "no chat template" in missing.message and "'prompt'" in missing.message
    _check_unaffected(server, "bare", outcome)
    _wait_all_slots_free(server, "bare")


def test_drafter_failing_in_start_or_observe_fails_its_request_alone(tmp_path, server_factory):
    manifest = _manifest(tmp_path, "spec", speculative={"drafters": ["ngram", "exploding"]})
    server = server_factory([manifest], HF_PLUGINS)
    outcome, (at_start, at_observe) = _alongside_a_stream(server, "spec", [
        lambda c: c.generate("spec", prompt="boom start", max_tokens=8),
        lambda c: c.generate("spec", prompt="boom observe", max_tokens=8),
    ])
    for error, where in ((at_start, "start"), (at_observe, "observe")):
        assert isinstance(error, OutriderError) and error.code == "execution_error", error
        assert f"drafter {where} exploded on purpose" in error.message
    _check_unaffected(server, "spec", outcome)
    _wait_all_slots_free(server, "spec")


def test_failing_shared_forward_fails_its_step_and_the_engine_keeps_serving(tmp_path, server_factory):
    server = server_factory([_manifest(tmp_path, "hf")], HF_PLUGINS)
    outcome, (crashed,) = _alongside_a_stream(server, "hf", [lambda c: c.generate("hf", prompt="crash", max_tokens=4)])
    for error in (outcome, crashed):  # both were in the forward that failed
        assert isinstance(error, OutriderError) and error.code == "execution_error", error
        assert "forward crashed on purpose" in error.message
    _wait_all_slots_free(server, "hf")
    results = []

    def generate(prompt: str) -> None:
        with server.client(timeout=60) as client:
            results.append(client.generate("hf", prompt=prompt, max_tokens=20))

    threads = [threading.Thread(target=generate, args=(f"request {i}",)) for i in range(6)]  # more than the 4 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 6 and all(len(r.token_ids) == 20 for r in results)
    _wait_all_slots_free(server, "hf")


def test_infer_sent_to_a_generating_model_is_refused(tmp_path, server_factory):
    server = server_factory([_manifest(tmp_path, "hf")], HF_PLUGINS)
    with server.client(timeout=60) as client:
        for inputs, params in (({}, {"prompt": "abc", "max_tokens": 3}), ({"x": np.zeros(2, np.float32)}, {})):
            with pytest.raises(BadRequestError, match="model 'hf' generates text; send generate"):
                client.infer("hf", inputs, **params)
        assert client.generate("hf", prompt="abc", max_tokens=3).token_ids  # still serving


def test_generating_backend_in_a_worker_process_fails_at_start(tmp_path, server_factory):
    server = server_factory([MANIFESTS / "smollm2.yaml"], ["outrider_llm", "outrider_speculative"],
                            args=["--set", "scheduling.instance_kind=process"], wait=False)
    assert server.proc.wait(60) != 0
    log = server.log()
    assert "field 'scheduling.instance_kind'" in log and "thread" in log, log
