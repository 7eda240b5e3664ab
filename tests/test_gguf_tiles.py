"""A GGUF's blocks packed straight into the native kernels' tiles (outrider_llm/gguf_tiles.py and
csrc/gguf_pack.cpp): every block type at the file's bytes, multiplied by exactly the file's weights
on every kernel set this CPU runs, loaded from the mapped file without a conversion heap, and served
by a plain manifest."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import write_manifest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs gguf (gguf-py)")

ALL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Bits a weight of each type in the file (block bytes x 8 / block elements).
FILE_BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q4_K": 4.5, "Q5_K": 5.5,
             "Q6_K": 6.5625}


def _native_c():
    from outrider_llm import native_c

    if not native_c.library()[0]:
        pytest.skip(f"the native C library is not built: {native_c.library()[1]}")
    return native_c


def _blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw blocks uint8 [rows, row bytes] of `kind` for random weights (gguf-py's quantizer where it
    has one, else random blocks with sane scales)."""
    import gguf
    from gguf_models import RANDOM_BLOCKS, random_blocks

    if kind in RANDOM_BLOCKS:
        return np.ascontiguousarray(random_blocks(kind, rows, cols, seed=seed))
    weights = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return np.ascontiguousarray(gguf.quants.quantize(weights, gguf.GGMLQuantizationType[kind]))


def _dequantized(kind: str, blocks: np.ndarray, rows: int, cols: int) -> np.ndarray:
    import gguf

    return np.asarray(gguf.dequantize(blocks, gguf.GGMLQuantizationType[kind]), dtype=np.float32).reshape(rows, cols)


def _on_every_kernel_set(native_c, compute) -> dict:
    """compute() on every kernel set this CPU runs, by name (the active set restored after)."""
    results = {}
    active = native_c.kernels()
    try:
        for name in native_c.kernel_sets():
            try:
                native_c.select(name)
            except ValueError:
                continue  # a set this CPU does not run
            results[name] = compute()
    finally:
        native_c.select(active)
    return results


def _served_bits(part, rows: int, cols: int) -> float:
    nbytes = part.w.nbytes + sum(0 if a is None else a.nbytes for a in (part.d, part.m))
    return nbytes * 8 / (rows * cols)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_every_type_is_served_at_the_files_bytes_and_multiplies_by_its_weights(kind):
    """Packed from the blocks as they lie in the file: within 3% of the file's bytes (the K types'
    6-bit sub-block scales take a byte each; the others exactly), the same bits on every kernel set
    this CPU runs, and x @ W.T of the file's own weights within the int8 activations' error."""
    native_c = _native_c()
    from outrider_llm import native_c_weights

    rows, cols = 48, 512  # 3 tiles; two K-type super-blocks a row
    blocks = _blocks(kind, rows, cols, seed=ALL_TYPES.index(kind))
    weights = _dequantized(kind, blocks, rows, cols)
    part = native_c_weights.pack_gguf(kind, blocks, cols)
    assert part.out == rows and part.inputs == cols
    bits = _served_bits(part, rows, cols)
    assert FILE_BITS[kind] <= bits <= FILE_BITS[kind] * 1.03, (kind, bits)
    x = np.random.default_rng(7).standard_normal((5, cols)).astype(np.float32)
    want = x.astype(np.float64) @ weights.T.astype(np.float64)
    results = _on_every_kernel_set(native_c, lambda: part.matmul(x))
    reference = results["scalar"]
    for name, got in results.items():
        assert np.array_equal(got, reference), f"{name} differs from the scalar reference on {kind}"
    # int8 activations per 32 (K types: per 256) inputs: about 1% of the output's scale
    assert np.abs(reference - want).max() < 0.03 * np.abs(want).max()
    if part.bits & native_c.SUPER_BLOCKS:  # row lookups (embeddings) give the file's weights exactly
        ids = np.array([0, 17, 47, 3])
        assert np.array_equal(native_c_weights.dequantize_super_rows(part, ids), weights[ids])


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_many_rows_walk_the_weights_in_chunks_and_get_each_rows_own_result(kind):
    """A prefill's rows go over the weights a chunk of tiles at a time (kTileChunkBytes), so the
    weights stay in cache: a matrix of many chunks times 21 rows equals each row multiplied alone
    (one row takes every tile in one pass), bit for bit, on every kernel set."""
    native_c = _native_c()
    from outrider_llm import native_c_weights

    rows, cols = 16 * 24, 4096  # 24 tiles of 24-70 KB: several chunks of 192 KB
    part = native_c_weights.pack_gguf(kind, _blocks(kind, rows, cols, seed=11), cols)
    x = np.random.default_rng(8).standard_normal((21, cols)).astype(np.float32)

    def both() -> tuple[np.ndarray, np.ndarray]:
        return part.matmul(x), np.vstack([part.matmul(x[i:i + 1]) for i in range(len(x))])

    for name, (together, alone) in _on_every_kernel_set(native_c, both).items():
        assert np.array_equal(together, alone), f"{name}: rows in chunks differ from rows alone on {kind}"


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("five_bit", [True, False])
def test_the_simple_types_group_blocks_compute_what_the_separate_tables_do(kind, five_bit):
    """The C packer's group blocks (each group's scales beside its values: one stream of bytes a tile)
    against the layout with separate d and m tables that the numpy conversion (gguf_blocks ->
    Part.from_affine) builds from the same blocks: the same products bit for bit on every kernel set,
    and the same rows looked up."""
    native_c = _native_c()
    from outrider_llm import gguf_blocks, native_c_weights
    from outrider_llm.gguf_blocks import AffineGroups
    from outrider_llm.native_model_weights import PartRows

    rows, cols = 32, 256
    blocks = _blocks(kind, rows, cols, seed=3)
    groups = gguf_blocks.to_affine(blocks, kind, (rows, cols))
    if groups.bits == 5 and not five_bit:
        groups = AffineGroups(8, groups.q, groups.d, groups.m, groups.group, groups.exact, groups.source)
    tables = native_c_weights.Part.from_affine(groups)
    packed = native_c_weights.pack_gguf(kind, blocks, cols, five_bit=five_bit)
    assert packed.bits == tables.bits | native_c.GROUP_BLOCKS and packed.d is None and packed.m is None
    x = np.random.default_rng(4).standard_normal((9, cols)).astype(np.float32)
    same = _on_every_kernel_set(native_c, lambda: np.array_equal(packed.matmul(x), tables.matmul(x)))
    assert same and all(same.values()), same
    ids = np.array([0, 31, 5, 17])
    assert np.array_equal(PartRows(packed, rows, cols)(ids), PartRows(tables, rows, cols)(ids))


def test_rows_are_taken_in_the_order_asked_and_padding_rows_are_zero():
    """row_map: llama's un-permuted Q/K rows and a vocabulary padded to whole tiles."""
    _native_c()
    from outrider_llm import native_c_weights

    rows, cols = 40, 256
    blocks = _blocks("Q4_K", rows, cols, seed=5)
    weights = _dequantized("Q4_K", blocks, rows, cols)
    order = np.concatenate([np.arange(rows)[::-1], [-1] * 8])
    part = native_c_weights.pack_gguf("Q4_K", blocks, cols, rows_out=48, row_map=order)
    got = native_c_weights.dequantize_super_rows(part, np.arange(48))
    assert np.array_equal(got[:rows], weights[::-1]) and not got[rows:].any()
    with pytest.raises(ValueError, match="multiple of 16"):
        native_c_weights.pack_gguf("Q4_K", blocks, cols, rows_out=40)
    with pytest.raises(ValueError, match="not one the kernels take"):
        native_c_weights.packed_shape("Q2_K", cols)


def _chunk(tokens):
    from outrider.generation.contract import Chunk

    tokens = np.asarray(tokens, dtype=np.int64)
    return Chunk(0, tokens, np.arange(len(tokens), dtype=np.int64))


@pytest.mark.parametrize("arch,kind", [("llama", "Q4_K"), ("qwen2", "Q5_K"), ("phi3", "Q6_K"), ("qwen3", "Q4_0"),
                                       ("llama", "Q8_0")])
def test_a_gguf_packed_straight_into_tiles_computes_the_converted_model(arch, kind, tmp_path):
    """load_gguf_tiles against the older way (the blocks artifact, then tiles): the same
    tokenizer, fingerprint and embedding rows; logits within the activations' quantization (the K
    types quantize activations per 256 here, per group there; q is scaled after its matmul here);
    built once, then mapped read-only."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _native_c()
    from gguf_models import write_tiny_gguf
    from outrider.artifacts import ArtifactCache
    from outrider_llm.gguf_tiles import KIND, load_gguf_tiles
    from outrider_llm.conversion import load_native_artifact
    from outrider_llm.native_model import NativeLlama, load_tiles

    shape = dict(hidden_size=256, intermediate_size=512) if kind.endswith("K") else {}
    path, _ = write_tiny_gguf(tmp_path, arch, seed=2, matrix_type=kind, **shape)
    cache = ArtifactCache(tmp_path / "cache")
    converted, tokenizer = NativeLlama.from_artifact(load_native_artifact(path, cache))
    model, packed_tokenizer = load_tiles(load_gguf_tiles(path, cache, in_child=False))
    built = sorted((tmp_path / "cache" / KIND).iterdir())
    again, _ = load_tiles(load_gguf_tiles(path, cache, in_child=False))
    assert sorted((tmp_path / "cache" / KIND).iterdir()) == built  # not rebuilt
    w = again.layers.layers[0].o
    w = w[0].w if isinstance(w, list) else w.w
    assert not w.flags.writeable and isinstance(w.base, np.memmap)
    ids = tokenizer.encode("hello there, the cat sat on the mat")
    assert packed_tokenizer.encode("hello there, the cat sat on the mat") == ids
    assert model.fingerprint() == converted.fingerprint()
    assert np.array_equal(model.embed(np.array(ids)), converted.embed(np.array(ids)))
    got = again.forward(again.new_cache(1, 64), [_chunk(ids)]).logits
    want = converted.forward(converted.new_cache(1, 64), [_chunk(ids)]).logits
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
    meta = json.loads((Path(load_gguf_tiles(path, cache).path) / "meta.json").read_text())
    assert meta["block_types"] == {kind: 7 * 2 + 1}  # 7 matrices a layer, 2 layers, the tied embeddings


def test_a_first_start_builds_the_tokenizer_while_it_hashes_and_packs(tmp_path):
    """A file this cache never hashed starts the tokenizer's child before the cache key is known:
    the entry holds what a build in this process writes, and no scratch folder stays behind;
    where the entry exists after all (its hash was forgotten), the early child is stopped."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _native_c()
    from gguf_models import write_tiny_gguf
    from outrider.artifacts import ArtifactCache, hash_remembered
    from outrider_llm.gguf_tiles import load_gguf_tiles

    path, _ = write_tiny_gguf(tmp_path, "llama", seed=3, matrix_type="Q8_0")
    here = load_gguf_tiles(path, ArtifactCache(tmp_path / "here"), in_child=False)
    root = tmp_path / "cache"
    assert not hash_remembered(path, root)
    first = load_gguf_tiles(path, ArtifactCache(root))
    assert hash_remembered(path, root)
    for name in ("tokenizer.json", "tiles.bin", "tiles.json"):
        assert (Path(first.path) / name).read_bytes() == (Path(here.path) / name).read_bytes(), name
    shutil.rmtree(root / "sha256")  # forgotten: the next start guesses a first start, wrongly
    again = load_gguf_tiles(path, ArtifactCache(root))
    assert again.path == first.path
    assert not list(root.glob(".tokenizer-*")), "a scratch folder of the early tokenizer stayed"


def test_a_file_with_a_type_it_does_not_take_is_named_and_goes_the_older_way(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _native_c()
    from gguf_models import write_tiny_gguf
    from outrider_llm.gguf_tiles import NotCovered, covered, load_gguf_tiles

    path, _ = write_tiny_gguf(tmp_path, "llama", seed=1, matrix_type="Q4_0", types={"ffn_down.weight": "F16"})
    assert covered(path) == "layer 0 down_proj (blk.0.ffn_down.weight) is F16, not a type the kernels take as it is"
    with pytest.raises(NotCovered, match="F16"):
        load_gguf_tiles(path)


# A child that packs a GGUF and reports its peak resident set (ru_maxrss, KB) before and after.
_PEAK = """
import json, resource, sys
from pathlib import Path
from outrider_llm import gguf_tiles, native_c
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
figures = gguf_tiles.build(Path(sys.argv[1]), Path(sys.argv[2]), native_c.five_bit_layout(native_c.kernels()))
print(json.dumps({"before": before, "after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, **figures}))
"""


def test_packing_holds_a_chunk_not_the_file(tmp_path):
    """A ~100 MB Q4_K_M-like file (random blocks at a real layout) packed in a child process: its
    peak resident set grows by well under the file's size (the packer keeps one chunk and drops the
    file's pages it has packed), and the tiles hold the file's bytes within 3%."""
    _native_c()
    from gguf_models import write_block_gguf

    path = write_block_gguf(tmp_path / "blocks.gguf", hidden=1024, layers=8, ffn=4096, vocab=16384,
                            types={"": "Q4_K", "ffn_down": "Q6_K", "attn_v": "Q6_K", "token_embd": "Q6_K"})
    size = path.stat().st_size
    out = tmp_path / "tiles"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", _PEAK, str(path), str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    grown = (figures["after"] - figures["before"]) * 1024
    assert grown < 0.45 * size, f"packing grew the resident set by {grown / 1e6:.0f} MB for a {size / 1e6:.0f} MB file"
    assert size * 0.98 < figures["weight_bytes"] < size * 1.03


def test_a_plain_manifest_serves_a_k_type_file_from_its_tiles(tmp_path, server_factory):
    """A GGUF of K types behind a plain manifest: packed at the first start into the tiles artifact,
    served by the torch-free runtime at the file's bytes, greedy output the same with speculation."""
    pytest.importorskip("transformers")
    _native_c()
    from gguf_models import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path, "llama", seed=3, matrix_type="Q4_K", types={"ffn_down.weight": "Q6_K"},
                              hidden_size=256, intermediate_size=512)
    manifest = write_manifest(tmp_path, f"""name: ktypes
backend: llm
model:
  path: {path}
options:
  max_sequences: 2
  max_length: 256
  threads: 2
speculative:
  drafters: [ngram]
""", "ktypes.yaml")
    server = server_factory([manifest], ["outrider_llm", "outrider_speculative"],
                            env={"OUTRIDER_CACHE_DIR": str(tmp_path / "cache")})
    with server.client(timeout=120) as client:
        instance = client.health()["models"]["ktypes"]["instances"][0]
        assert instance["backend"]["runtime"] == "native", instance
        assert instance["backend"]["kv_cache"]["dtype"] == "float16"  # the default, as llama.cpp's
        assert instance["backend"]["weights"]["bytes"] > 0
        # 2 layers: 6 matrices in Q4_K and ffn_down in Q6_K each, and the tied embeddings in Q4_K
        assert instance["backend"]["weights"]["block_types"] == {"Q4_K": 13, "Q6_K": 2}, instance
        assert (tmp_path / "cache" / "llama-gguf-tiles").is_dir()
        prompt = "the cat sat on the mat, the cat sat on the"
        plain = client.generate("ktypes", prompt=prompt, max_tokens=12, speculative=False)
        drafted = client.generate("ktypes", prompt=prompt, max_tokens=12, speculative=True)
        assert plain.token_ids == drafted.token_ids and len(plain.token_ids) > 0


@pytest.mark.parametrize("arch,kind", [("llama", "Q4_K"), ("qwen2", "Q8_0"), ("phi3", "F16")])
def test_the_fast_header_reader_reads_what_gguf_py_reads(arch, kind, tmp_path):
    """gguf_reading.GGUFFile (what the packing reads a file with) against gguf-py's GGUFReader: every
    metadata value, every tensor's type, shape, offset and bytes, and the config made of them."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gguf import GGUFReader
    from gguf_models import write_tiny_gguf
    from outrider_llm.gguf_reading import GGUFFile, config_from_gguf, gguf_field

    shape = dict(hidden_size=256, intermediate_size=512) if kind.endswith("K") else {}
    path, _ = write_tiny_gguf(tmp_path, arch, seed=1, matrix_type=kind, **shape)
    fast, reference = GGUFFile(path), GGUFReader(str(path))
    assert [t.name for t in fast.tensors] == [t.name for t in reference.tensors]
    for a, b in zip(fast.tensors, reference.tensors):
        assert (a.tensor_type, list(a.shape), a.data_offset, a.n_bytes) == \
            (b.tensor_type, [int(n) for n in b.shape], b.data_offset, b.n_bytes), a.name
        assert np.array_equal(np.asarray(a.data).reshape(-1).view(np.uint8),
                              np.asarray(b.data).reshape(-1).view(np.uint8)), a.name
    for key in reference.fields:
        if not key.startswith("GGUF."):
            assert gguf_field(fast, key) == gguf_field(reference, key), key
    assert config_from_gguf(fast, path) == config_from_gguf(reference, path)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(ValueError, match="runs past the end"):
        GGUFFile(truncated)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma3"])
def test_the_files_tokenizer_is_what_autotokenizer_builds(arch, tmp_path):
    """gguf_tokenizer calls transformers' GGUF tokenizer converter directly where it can, on the
    fields the fast reader gives: the same tokenizer, serialized, as AutoTokenizer.from_pretrained(
    gguf_file=...) gives (gemma3: SentencePiece with merges recovered from the scores)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from gguf_models import write_tiny_gemma3_gguf, write_tiny_gguf
    from outrider_llm.gguf_reading import gguf_tokenizer

    if arch == "gemma3":
        path, _ = write_tiny_gemma3_gguf(tmp_path, seed=1)
    else:
        path, _ = write_tiny_gguf(tmp_path, arch, seed=1, matrix_type="Q8_0")
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           local_files_only=True).backend_tokenizer
    ours, theirs = json.loads(gguf_tokenizer(path).to_str()), json.loads(reference.to_str())
    if arch == "gemma3":  # AutoTokenizer's post-processor adds BOS; ChatTokenizer adds it itself (add_bos)
        assert theirs.pop("post_processor")["single"][0]["SpecialToken"]["id"] == "<bos>"
        assert ours.pop("post_processor")["single"] == [{"Sequence": {"id": "A", "type_id": 0}}]
    assert ours == theirs
