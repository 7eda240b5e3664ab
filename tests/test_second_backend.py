"""The generation engine and speculative decoding are not tied to one model class.

`tests/plugins/outrider_test_hf_llama.py` is a second generating backend (transformers' Llama on a
tiny random config, its own naive KV cache); it is served by a real server with the same
`speculative` accelerator, and greedy output is identical with and without speculation.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import sys  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402

from conftest import TEST_PLUGINS, write_manifest  # noqa: E402
from outrider.generation.contract import Chunk, DraftTree  # noqa: E402

sys.path.insert(0, str(TEST_PLUGINS))
from outrider_test_hf_llama import HFLlama  # noqa: E402


def test_tree_forward_matches_one_token_forwards():
    """The contract's tree semantics on transformers' model: each node sees only its ancestors."""
    model = HFLlama(seed=1)
    cache = model.new_cache(1, 64)
    prompt = torch.tensor([3, 1, 4, 1, 5])
    model.forward(cache, [Chunk(0, prompt, torch.arange(5))])
    cache.commit(0, list(range(5)))
    tree = DraftTree(tokens=[9, 2, 6], parents=[-1, -1, 1], probs=[1.0] * 3)  # two branches, one deeper
    fed = torch.tensor([7, *tree.tokens])
    out = model.forward(cache, [Chunk(0, fed, 5 + torch.tensor([0, *tree.depths()]), tree.mask())])
    for row, path in [(0, [7]), (1, [7, 9]), (2, [7, 2]), (3, [7, 2, 6])]:
        alone = model.new_cache(1, 64)
        ids = torch.tensor([3, 1, 4, 1, 5, *path])
        ref = model.forward(alone, [Chunk(0, ids, torch.arange(len(ids)))])
        torch.testing.assert_close(out.logits[row], ref.logits[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("drafter", ["ngram", "period"])
def test_second_generating_backend_served_with_speculation(tmp_path, server_factory, drafter):
    """`period` is a drafter a test plugin registers: the core's drafter contract is all it needs."""
    manifest = write_manifest(tmp_path, yaml.safe_dump({
        "name": "hf", "backend": "hf-llama", "options": {"seed": 3},
        "speculative": {"drafters": [drafter], "max_draft_tokens": 8, "cost_gate": False},  # drafts counted
    }), "hf.yaml")
    server = server_factory([manifest], ["outrider_test_hf_llama", "outrider_speculative"])
    prompts = ["abc abc abc abc abc", "the cat sat. the cat sat. the", "0123 0123 0123 01"]
    accepted = 0
    with server.client(timeout=60) as client:
        for prompt in prompts:
            plain = client.generate("hf", prompt=prompt, max_tokens=40, speculative=False)
            spec = client.generate("hf", prompt=prompt, max_tokens=40)
            assert spec.token_ids == plain.token_ids
            assert plain.stats["draft_tokens"] == 0
            accepted += spec.stats["accepted_tokens"]
    assert accepted > 0, f"speculation never accepted a {drafter} draft: it did not run on this backend"


@pytest.mark.parametrize("drafter", ["ngram", "period"])
def test_drafters_pass_the_conformance_kit_on_the_second_backend(drafter):
    """outrider.testing.check_drafter: a drafter a plugin registers, checked against the contract alone."""
    from outrider.plugins import create_registry
    from outrider.testing import check_drafter
    from outrider_test_hf_llama import CharTokenizer

    registry = create_registry(["outrider_test_hf_llama", "outrider_speculative"], load_entry_points=False)
    tokenizer = CharTokenizer()
    counts = check_drafter(registry, drafter, HFLlama(seed=3), tokenizer, tokenizer.encode("abc abc abc abc abc"))
    assert counts["proposals"] == 24 and counts["nodes"] > 0 and counts["engine_draft_tokens"] > 0
