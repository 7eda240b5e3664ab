"""The conformance kits of outrider.testing run on the built-in generating backend and on the test
plugin's second one (transformers' Llama): what a third-party generating backend must pass."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import TEST_PLUGINS  # noqa: E402
from outrider.plugins import create_registry  # noqa: E402
from outrider.testing import check_generating_backend  # noqa: E402


def test_the_llm_backend_passes_on_a_tiny_gguf(tmp_path):
    pytest.importorskip("gguf")
    from gguf_models import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path, "qwen2", seed=2)
    registry = create_registry(["outrider_llm"], load_entry_points=False)
    manifest = {"name": "tiny", "backend": "llm", "model": {"path": str(path)}}
    result = check_generating_backend(registry.backends["llm"], manifest, registry=registry)
    assert result["available"] and result["generated_tokens"] > 0


def test_the_second_generating_backend_passes():
    sys.path.insert(0, str(TEST_PLUGINS))
    registry = create_registry(["outrider_test_hf_llama"], load_entry_points=False)
    manifest = {"name": "hf", "backend": "hf-llama", "options": {"seed": 3}}
    result = check_generating_backend(registry.backends["hf-llama"], manifest, prompt="abc abc", registry=registry)
    assert result["available"] and result["generated_tokens"] > 0


def test_the_kit_catches_a_backend_that_breaks_the_contract():
    # A generating backend whose tokenizer lacks part of the Tokenizer protocol: the kit names it.
    sys.path.insert(0, str(TEST_PLUGINS))
    from outrider_test_hf_llama import HFLlamaBackend

    class Partial:
        def __init__(self, tokenizer) -> None:
            self.encode, self.decode, self.eos_token_ids = tokenizer.encode, tokenizer.decode, tokenizer.eos_token_ids

    class PartialTokenizer(HFLlamaBackend):
        name = "partial-tokenizer"

        def load(self) -> None:
            super().load()
            self.tokenizer = Partial(self.tokenizer)

    registry = create_registry(["outrider_test_hf_llama"], load_entry_points=False)
    with pytest.raises(TypeError, match="lacks vocab_size, chat_template, apply_chat_template, token_text, to_json"):
        check_generating_backend(PartialTokenizer, {"name": "p", "backend": "hf-llama", "options": {"seed": 3}},
                                 prompt="abc abc", registry=registry)


def test_the_http_front_passes_and_uses_only_the_submitter():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    from conftest import free_port
    from outrider.testing import check_front

    registry = create_registry(["outrider_echo", "outrider_http"], load_entry_points=False)
    front = registry.fronts["http"]
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}

    def roundtrip(address: str) -> None:
        answer = httpx.post(f"http://{address}/v2/models/echo/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [1.0, 2.0]

    result = check_front(front, roundtrip, f"127.0.0.1:{free_port()}", registry=registry)
    assert result["available"] and result["submitted"] == 1


def test_the_front_kit_catches_a_reach_past_the_submitter():
    from outrider.front import Front
    from outrider.testing import check_front

    class Nosy(Front):
        name = "nosy"

        def start(self) -> None:
            self.server.config  # noqa: B018 - what the kit must refuse

        def stop(self, timeout: float = 5.0) -> None:
            pass

    registry = create_registry(["outrider_echo"], load_entry_points=False)
    with pytest.raises(AttributeError, match="server.config, which is not part of outrider.front.Submitter"):
        check_front(Nosy, lambda address: None, "unused", registry=registry)


def test_every_causal_lm_passes_the_model_kit(tmp_path):
    """The torch model, the torch-free native model (a GGUF's own blocks) and the test plugin's
    transformers model: tree attention, partial commits and shapes as the engine relies on."""
    pytest.importorskip("gguf")
    from gguf_models import write_tiny_gguf
    from outrider.artifacts import ArtifactCache
    from outrider.testing import check_causal_lm
    from outrider_llm.conversion import load_native_artifact
    from outrider_llm.loading import tiny_random_llama
    from outrider_llm.native_model import NativeLlama

    torch_model, _ = tiny_random_llama(vocab_size=16, hidden_size=32, num_layers=2, seed=3), None
    path, _ = write_tiny_gguf(tmp_path, "llama", seed=4, matrix_type="Q8_0")
    native, tokenizer = NativeLlama.from_artifact(load_native_artifact(path, ArtifactCache(tmp_path / "cache")))
    sys.path.insert(0, str(TEST_PLUGINS))
    from outrider_test_hf_llama import HFLlama

    for model, prompt in ((torch_model, [3, 1, 4, 1, 5, 9]), (native, tokenizer.encode("the cat sat on the")),
                          (HFLlama(seed=1), [3, 1, 4, 1, 5])):
        assert check_causal_lm(model, prompt)["max_relative_difference"] <= 1e-3


def test_the_model_kit_catches_attention_past_the_tree():
    """A model whose tree rows see their siblings (the mask ignored) is refused, row named."""
    from outrider.generation.contract import Chunk
    from outrider.testing import check_causal_lm
    from outrider_llm.loading import tiny_random_llama

    model = tiny_random_llama(vocab_size=16, hidden_size=32, num_layers=2, seed=3)
    forward = model.forward

    def causal_only(cache, chunks, logit_rows=None):  # drops the tree mask: every row sees the rows before it
        return forward(cache, [Chunk(c.slot, c.tokens, c.positions) for c in chunks], logit_rows)

    model.forward = causal_only
    with pytest.raises(AssertionError, match="tree row 2"):
        check_causal_lm(model, [3, 1, 4, 1, 5, 9])


def test_batch_policies_pass_the_policy_kit():
    """The batching accelerator and the core's one-request default, over MiniLM (ONNX Runtime):
    every request answered once, each as it is alone."""
    import numpy as np

    pytest.importorskip("onnxruntime")
    from conftest import MANIFESTS
    from outrider.manifest import load_manifest
    from outrider.testing import check_batch_policy

    registry = create_registry(["outrider_text", "outrider_onnxruntime", "outrider_batching"], load_entry_points=False)
    manifest = load_manifest(MANIFESTS / "minilm.yaml")
    choice = registry.choose_backend(manifest)
    backend = choice.backend(manifest, choice.device, registry.make_task(manifest))
    backend.prepare_artifact()
    backend.load()
    sentences = ["a short one", "a somewhat longer sentence about the weather today", "x", "the cat sat on the mat"]
    requests = [{"text": np.array([s], dtype=object)} for s in sentences * 3]
    batched = check_batch_policy(registry, manifest, backend, requests)
    assert max(batched["batch_sizes"]) > 1  # the policy did batch: the kit checked rows against neighbours
    backend.unload()
    echo_registry = create_registry(["outrider_echo"], load_entry_points=False)
    echo = echo_registry.backends["echo"](_manifest({"name": "echo", "backend": "echo"}), "cpu", None)
    echo.load()
    single = check_batch_policy(echo_registry, {"name": "echo", "backend": "echo"}, echo,
                                [{"x": np.full((1, 2), float(i), np.float32)} for i in range(3)])
    assert single["batch_sizes"] == [1, 1, 1]  # the core's default policy: one request per execute


def _manifest(data: dict):
    from outrider.manifest import validate_manifest

    return validate_manifest(data, "<test>")


def test_speculative_decoding_passes_the_strategy_kit():
    from outrider.testing import check_decode_strategy
    from outrider_llm.loading import tiny_random_llama

    from test_generate import CharTokenizer

    registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)
    model = tiny_random_llama(vocab_size=16, hidden_size=32, num_layers=2, seed=3)
    manifest = {"name": "t", "backend": "llm", "speculative": {"drafters": ["ngram"], "cost_gate": False}}
    counts = check_decode_strategy(registry, manifest, model, CharTokenizer(16),
                                   ["abcabcabcabc", "hellohellohello", "ababcdcdababcd"])
    assert counts["draft_tokens"] > 0
