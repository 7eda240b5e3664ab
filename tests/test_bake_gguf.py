"""`outrider bake` of a GGUF (issue 42): the native runtime's packed tiles written into the model
directory, a draft model's into draft/, so that a start with an empty artifact cache, and without the
GGUF files, converts nothing and answers as the GGUF did; what cannot be baked is refused with why.

Tiny random Llama GGUFs (tests/gguf_models.py) on the real CLI and a real server process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "gguf")),
    reason="needs torch, transformers and gguf (to write the tiny GGUFs and convert their tokenizers)",
)

from outrider import entry_index  # noqa: E402

from conftest import start_server, write_manifest  # noqa: E402
from gguf_models import write_tiny_gguf  # noqa: E402

MANIFEST = """name: tiny
backend: llm
model:
  path: target.gguf
options:
  max_sequences: 2
  max_length: 128
  threads: 1
speculative:
  drafters: [model]
  cost_gate: false
  model: {path: draft.gguf}
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A manifest beside its target (Q8_0) and draft (the same weights in Q4_0: it agrees often)."""
    from outrider_llm import native_c

    if not native_c.library()[0]:
        pytest.skip(f"native C library not loaded: {native_c.library()[1]}")
    folder = tmp_path_factory.mktemp("source")
    for name, kind in (("target", "Q8_0"), ("draft", "Q4_0")):
        written, _ = write_tiny_gguf(tmp_path_factory.mktemp(name), "llama", seed=5, matrix_type=kind)
        shutil.copy(written, folder / f"{name}.gguf")
    return write_manifest(folder, MANIFEST)


def _bake(manifest: Path, out: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "outrider.cli", "bake", str(manifest), str(out),
                           "--plugin", "outrider_llm", "--plugin", "outrider_speculative"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OUTRIDER_CACHE_DIR": str(cache)})


def _greedy(server) -> tuple[list[int], list[int], dict]:
    with server.client(timeout=120) as client:
        plain = client.generate("tiny", prompt="the cat sat", max_tokens=24, temperature=0.0, speculative=False)
        spec = client.generate("tiny", prompt="the cat sat", max_tokens=24, temperature=0.0)
    return plain.token_ids, spec.token_ids, spec.stats


def test_a_baked_gguf_serves_from_an_empty_cache_without_its_files(source: Path, tmp_path: Path) -> None:
    baked_dir = tmp_path / "models" / "tiny"
    made = _bake(source, baked_dir, tmp_path / "bake-cache")
    assert made.returncode == 0, made.stderr
    baked = yaml.safe_load((baked_dir / "manifest.yaml").read_text())
    assert baked["model"] == {"path": "."} and baked["speculative"]["model"] == {"path": "draft"}
    for folder in (baked_dir, baked_dir / "draft"):
        assert {"tiles.bin", "tiles.json", "meta.json", "tokenizer.json", "provenance.json"} <= {
            p.name for p in folder.iterdir()}
    assert not list(baked_dir.rglob("*.gguf"))

    reference = start_server(tmp_path, [source], ["outrider_llm", "outrider_speculative"],
                             env={"OUTRIDER_CACHE_DIR": str(tmp_path / "bake-cache")})
    try:
        reference.wait_ready(timeout=180)
        expected = _greedy(reference)
    finally:
        reference.stop()

    # The GGUFs gone, the cache empty: the baked directory alone serves.
    moved = tmp_path / "elsewhere"
    shutil.move(str(source.parent), moved)
    fresh_cache = tmp_path / "fresh-cache"
    fresh_cache.mkdir()
    server = start_server(tmp_path, [baked_dir / "manifest.yaml"], ["outrider_llm", "outrider_speculative"],
                          env={"OUTRIDER_CACHE_DIR": str(fresh_cache)})
    try:
        server.wait_ready(timeout=180)
        plain, spec, stats = _greedy(server)
        log = server.log()
    finally:
        server.stop()
        shutil.move(str(moved), source.parent)
    assert plain == spec == expected[0] == expected[1]
    assert stats["accepted_tokens"] > 0, "the baked draft model drafted nothing that was kept"
    assert "torch-free native runtime" in log and "building" not in log
    built = [p for p in fresh_cache.rglob("*") if p.is_file() and p.parent.name != "sha256"
             and p.name != entry_index.INDEX_FILE]
    assert not built, f"serving the baked directory built {built}"


def test_what_cannot_be_baked_is_refused_with_why(source: Path, tmp_path: Path) -> None:
    """A quantize section (built and gated at start) and a manifest on the torch runtime are refused
    before anything is written."""
    text = MANIFEST.replace("model: {path: draft.gguf}", "model: {path: draft.gguf}\nquantize: {mode: int4}")
    cases = ((text, "has a 'quantize' section"),
             (MANIFEST.replace("threads: 1", "threads: 1\n  runtime: torch"),
              r"only the torch-free native runtime's tiles can be baked.*options.runtime: torch"),
             (MANIFEST.replace("draft.gguf", "missing.gguf"), r"speculative.model.path.*missing.gguf does not exist"))
    for index, (manifest, why) in enumerate(cases):
        path = write_manifest(source.parent, manifest, name=f"refused-{index}.yaml")
        made = _bake(path, tmp_path / f"out-{index}", tmp_path / "cache")
        assert made.returncode != 0
        assert re.search(why, made.stderr), made.stderr
        assert not (tmp_path / f"out-{index}").exists()


def test_a_baked_directory_from_another_format_is_refused(source: Path, tmp_path: Path) -> None:
    """Tiles this version does not read fail the load once, saying to bake again; a directory that
    is no baked model says so too."""
    from outrider_llm.artifact import GGUFError
    from outrider_llm.gguf_tiles import load_gguf_tiles

    baked_dir = tmp_path / "baked"
    assert _bake(source, baked_dir, tmp_path / "cache").returncode == 0
    assert load_gguf_tiles(baked_dir).path == baked_dir
    provenance = json.loads((baked_dir / "provenance.json").read_text())
    provenance["options"]["format"] = -1
    (baked_dir / "provenance.json").write_text(json.dumps(provenance))
    with pytest.raises(GGUFError, match="bake it again with this version"):
        load_gguf_tiles(baked_dir)
    with pytest.raises(GGUFError, match="not a model baked by `outrider bake`"):
        load_gguf_tiles(tmp_path)
