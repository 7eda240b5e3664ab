"""Every architecture the `llm` backend claims, from a GGUF file, against transformers loading the
same file (`from_pretrained(..., gguf_file=...)`, which dequantizes): tiny random models written
here (tests/gguf_models.py) as llama.cpp writes them. fp32 matrices within float rounding; the
file's own block types (served natively) within the int8 activations' error, and exact between a
prefill and one-token steps; Llama 3's rope_freqs; a clear refusal of what is not claimed."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "gguf")),
    reason="needs torch, transformers and gguf",
)

from gguf_models import ARCHITECTURES, one_token_logits, write_tiny_gguf  # noqa: E402

TEXT = "hello there, the cat sat on the mat"


def _ours(path, tmp_path, native: bool):
    from outrider.artifacts import ArtifactCache
    from outrider_llm.loading import model_from_artifact
    from outrider_llm.conversion import load_native_artifact, load_weights_artifact

    cache = ArtifactCache(tmp_path / "cache")
    artifact = load_native_artifact(path, cache) if native else load_weights_artifact(path, cache)
    return model_from_artifact(artifact)


def _logits(model, ids):
    import torch

    from outrider.generation.contract import Chunk

    return model.forward(model.new_cache(1, 128), [Chunk(0, torch.tensor(ids), torch.arange(len(ids)))]).logits


def _reference(path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    with torch.no_grad():
        _reference.model = model  # for tests that compare weights too
        return model(torch.tensor([ids])).logits[0], ids, tokenizer


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_float_gguf_matches_transformers(arch, tmp_path):
    path, _ = write_tiny_gguf(tmp_path, arch, seed=1)
    want, ids, hf_tokenizer = _reference(path)
    model, tokenizer = _ours(path, tmp_path, native=False)
    assert model.config.architecture == ("llama" if arch == "mistral" else arch)
    assert tokenizer.encode(TEXT) == ids  # the file's tokenizer
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)  # the file's chat template
    got = _logits(model, ids)
    assert float((got - want).abs().max()) < 1e-4
    # `weights: file` on a file without quantized matrices is the same float model.
    import torch

    assert torch.equal(_logits(_ours(path, tmp_path, native=True)[0], ids), got)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_quantized_gguf_served_in_its_blocks_matches_transformers(arch, kind, tmp_path):
    import torch

    from outrider_llm import native

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    path, _ = write_tiny_gguf(tmp_path, arch, seed=2, matrix_type=kind)
    want, ids, _ = _reference(path)
    model, _ = _ours(path, tmp_path, native=True)
    assert model.native_attention
    # qwen2's biases and qwen3's q/k norms are not in the fused native stack: per operation there.
    assert (model._fast_layers is not None) == (arch in ("llama", "mistral", "phi3") and kind == "Q4_0")
    got = _logits(model, ids)
    assert float((got - want).norm() / want.norm()) < 0.06  # the int8 activations, not the weights
    # The head's rows (a draft head's vocabulary; tied: the embeddings) are the file's, exactly.
    rows = torch.tensor([0, 7, 100, 266])
    assert torch.equal(model.lm_head_rows(rows), _reference.model.lm_head.weight.detach()[rows])
    assert torch.equal(one_token_logits(model, ids), got)  # a prefill is one-token steps, bit for bit


def test_llama3_rope_freqs_match_transformers_llama3_rope(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path, hf_model = write_tiny_gguf(tmp_path, "llama", seed=3, rope_parameters=rope)
    model, tokenizer = _ours(path, tmp_path, native=False)
    factors = np.array(model.config.rope_freq_factors)
    assert factors.min() == 1.0 and factors.max() == 8.0 and len(factors) == 16  # every band present
    import torch

    ids = tokenizer.encode(TEXT * 3)  # long enough for the low frequencies to matter
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0]
    assert float((_logits(model, ids) - want).abs().max()) < 1e-4


def test_an_architecture_not_claimed_is_refused_naming_what_it_needs(tmp_path):
    import gguf

    from outrider_llm.conversion import load_weights_artifact

    path = tmp_path / "tiny-qwen3moe.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from outrider.artifacts import ArtifactCache

    with pytest.raises(Exception) as info:
        load_weights_artifact(path, ArtifactCache(tmp_path / "cache"))
    message = str(info.value)
    assert "'qwen3moe' is not supported" in message and "gemma3" in message and "mixture-of-experts" in message


def test_ngram_speculation_is_exact_on_another_architecture(tmp_path):
    """Speculation serves any model: n-gram drafts on a tiny qwen3 in its own Q8_0 blocks give the
    plain greedy tokens."""
    from outrider_llm import native
    from test_generate import _engine, _run

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    path, _ = write_tiny_gguf(tmp_path, "qwen3", seed=4, matrix_type="Q8_0")
    model, tokenizer = _ours(path, tmp_path, native=True)
    params = [{"prompt": p, "max_tokens": 24} for p in ("the the the the the", "abcabcabcabc", "hello hello")]
    plain = _run(_engine(model, tokenizer, speculative=False), params)
    spec = _run(_engine(model, tokenizer, speculative=True), params)
    for i in range(len(params)):
        assert spec.final[i]["token_ids"] == plain.final[i]["token_ids"]


def test_train_draft_trains_a_head_for_another_model_and_the_head_serves_only_it(tmp_path, monkeypatch):
    """The trainer behind `tools/train_draft.py --gguf FILE`: a draft head for a tiny qwen2 (a short
    budget), which its model then drafts with (greedy output unchanged) and another model refuses,
    by fingerprint."""
    import time

    from outrider.errors import ManifestError
    from outrider_llm.loading import load_model
    from outrider_draft_training import cli
    from outrider_speculative.eagle import make_eagle_drafter
    from test_generate import _engine, _run

    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path / "cache"))  # the trainer's loads stay out of the suite's cache
    path, _ = write_tiny_gguf(tmp_path, "qwen2", seed=6)
    out = tmp_path / "head.safetensors"
    args = cli.build_parser().parse_args([
        "--gguf", str(path), "--minutes", "0.6", "--gen-minutes", "0.05", "--text-minutes", "0.03", "--out", str(out),
        "--batch-sequences", "8", "--draft-vocab", "128", "--intermediate", "64", "--blocks", "1"])
    run_start = time.monotonic()
    target, target_tokenizer = load_model(path)  # as the tool loads it
    assert cli.run(args, target, target_tokenizer, f"{path.stem} ({path.name})", run_start) == 0
    model, tokenizer = _ours(path, tmp_path, native=False)
    make_eagle_drafter(model, {"weights": str(out)})  # its own model takes it
    params = [{"prompt": p, "max_tokens": 24} for p in ("the cat", "hello there")]
    plain = _run(_engine(model, tokenizer, speculative=False), params)
    spec = _run(_engine(model, tokenizer, speculative=True, drafters=["eagle"], eagle={"weights": str(out)}), params)
    assert [spec.final[i]["token_ids"] for i in range(2)] == [plain.final[i]["token_ids"] for i in range(2)]
    (tmp_path / "other").mkdir()
    other_path, _ = write_tiny_gguf(tmp_path / "other", "llama", seed=7)
    other, _ = _ours(other_path, tmp_path, native=False)
    with pytest.raises(ManifestError) as info:
        make_eagle_drafter(other, {"weights": str(out)})
    assert "trained for other target weights" in str(info.value)


def test_a_type_without_native_kernels_is_converted_once_and_said(tmp_path, caplog):
    """Q3_K (no affine form) is requantized once to Q4_1 at conversion, with a warning naming the
    matrices; the model stays close to the file's (transformers' dequantization of it)."""
    import logging

    from outrider_llm import native
    from outrider_llm.artifact import read_artifact_meta

    if not native.w4a8_kernel()[0]:
        pytest.skip(f"native kernels not loaded: {native.w4a8_kernel()[1]}")
    path, _ = write_tiny_gguf(tmp_path, "llama", seed=11, matrix_type="Q8_0", types={"attn_v.weight": "Q3_K"},
                              hidden_size=256, intermediate_size=512)
    want, ids, _ = _reference(path)
    with caplog.at_level(logging.WARNING, logger="outrider.llm"):
        model, _ = _ours(path, tmp_path, native=True)
    from outrider.artifacts import ArtifactCache
    from outrider_llm.conversion import load_native_artifact

    meta = read_artifact_meta(load_native_artifact(path, ArtifactCache(tmp_path / "cache")))
    assert meta["converted"] == {"Q3_K -> Q4_1": ["blk.0.attn_v.weight", "blk.1.attn_v.weight"]}
    assert meta["block_types"] == {"Q8_0": 13, "Q3_K->Q4_1": 2}
    assert any("Q3_K -> Q4_1" in r.getMessage() and "blk.0.attn_v.weight" in r.getMessage() for r in caplog.records)
    got = _logits(model, ids)
    assert float((got - want).norm() / want.norm()) < 0.1  # Q4_1's rounding of the Q3_K weights on top


def test_files_the_backend_cannot_serve_fail_once_with_what_is_wrong(tmp_path, server_factory):
    """A mixture of experts, or a layer tensor no claimed architecture has: a GGUFError (an
    ArtifactError: deterministic), so a server marks the model failed with the reason, no restarts."""
    import time

    import gguf

    from conftest import write_manifest
    from outrider.artifacts import ArtifactCache
    from outrider.errors import ArtifactError
    from outrider_llm.conversion import load_weights_artifact

    moe = tmp_path / "moe" / "tiny-moe.gguf"
    moe.parent.mkdir()
    writer = gguf.GGUFWriter(str(moe), "llama")
    writer.add_block_count(1)
    writer.add_expert_count(8)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ArtifactError, match="mixture of experts .*expert_count = 8"):
        load_weights_artifact(moe, ArtifactCache(tmp_path / "cache"))
    extra = tmp_path / "extra"
    extra.mkdir()
    path2, _ = write_tiny_gguf(extra, "llama", seed=12)
    data = path2.read_bytes()
    path2.write_bytes(data.replace(b"blk.1.ffn_down.weight", b"blk.1.ffn_dowX.weight"))  # same length
    with pytest.raises(ArtifactError, match="'blk.1.ffn_dowX.weight' is not part of a llama layer"):
        load_weights_artifact(path2, ArtifactCache(tmp_path / "cache"))
    manifest = write_manifest(tmp_path, f"name: moe\nbackend: llm\nmodel: {{path: {moe}}}\n", "moe.yaml")
    server = server_factory([manifest], ["outrider_llm"], wait=False)
    with server.client(timeout=10) as client:
        for _ in range(300):
            model = client.health()["models"]["moe"]
            if model["state"] == "failed":
                break
            time.sleep(0.1)
        assert model["state"] == "failed" and "mixture of experts" in str(model), model
        time.sleep(2.5)  # past the back-off of the first restarts (0 s, then 1 s): none may come
        model = client.health()["models"]["moe"]
        assert "not retried" in model["reason"] and "bad_artifact" in model["reason"], model
        assert model["stats"]["instance_restarts"] == 0 and model["instances"][0]["generation"] == 0
    assert server.log().count("moe instance 0: load failed, not retried") == 1, server.log()[-3000:]


def test_a_sliding_window_caps_the_context_where_attention_is_exact(tmp_path, server_factory):
    """phi3 with a 24-token sliding window: the forward attends over the whole context, which is
    the model's own attention only within the window, so the server caps max_length there (said
    in metadata and the log), refuses a longer prompt clearly, and generates within it."""
    from conftest import write_manifest
    from outrider import OutriderError

    path, _ = write_tiny_gguf(tmp_path, "phi3", seed=13, sliding_window=24)
    manifest = write_manifest(tmp_path, f"name: sw\nbackend: llm\nmodel: {{path: {path}}}\n"
                                        f"options: {{max_length: 2048, max_sequences: 2}}\n", "sw.yaml")
    server = server_factory([manifest], ["outrider_llm"])
    with server.client(timeout=60) as client:
        described = next(m for m in client.models() if m["name"] == "sw")
        assert described["metadata"]["max_length"] == 24, described
        out = client.generate("sw", prompt="ab", max_tokens=20)
        assert 0 < len(out.token_ids) <= 20
        with pytest.raises(OutriderError, match="context holds 24"):
            client.generate("sw", prompt="abcd " * 12, max_tokens=4)
    assert "max_length 2048 capped at 24" in server.log()


def test_a_conversion_in_a_child_process_writes_what_one_in_process_writes(tmp_path):
    """A server converts a GGUF in a child process (its heap leaves with it): the artifact is the
    same, byte for byte, and a file it cannot serve is still a GGUFError (failed once, not retried)."""
    from outrider_llm.conversion import convert, convert_in_child
    from outrider_llm.artifact import GGUFError

    path, _ = write_tiny_gguf(tmp_path, "qwen2", seed=21)
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    assert convert("native", path, here) == convert_in_child("native", path, there)
    for name in ("weights.safetensors", "tokenizer.json", "meta.json"):
        assert (here / name).read_bytes() == (there / name).read_bytes(), name
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes().replace(b"blk.0.ffn_down.weight", b"blk.0.ffn_dowX.weight"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(GGUFError, match="'blk.0.ffn_dowX.weight' is not part of a qwen2 layer"):
        convert_in_child("native", broken, tmp_path / "empty")
