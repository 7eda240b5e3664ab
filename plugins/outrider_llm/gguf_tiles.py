"""A quantized GGUF packed straight into the native model's tiles, from the mapped file, without torch.

The first start of a GGUF on the torch-free runtime (native_model.py) used to convert the whole file
in numpy into an artifact of its blocks, then pack that into tiles: two passes at 3.4-4x the file's
size in memory. Here the file is mapped (gguf_reading.GGUFFile) and each tensor goes from its blocks as
they lie in the file to its tiles through the C packer (csrc/gguf_pack.cpp), a bounded chunk of rows
at a time, written at its place in the tiles file; the file's pages a tensor used are dropped from
this process once it is packed. So a first start holds about one chunk besides what it maps, and
the artifact it writes ("llama-gguf-tiles": tiles.bin, tiles.json, meta.json, tokenizer.json) is
mapped as it is by every later start (NativeLlama.from_tiles).

What it covers (`plan`): the architectures native_model covers, with every matrix and the token
embeddings in a type the kernels take as it is (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; the
K types at the file's bytes, csrc/kernels.h kSuperBlocks). Anything else (an F16 matrix, Q2_K, the IQ
types) raises `NotCovered`, and the caller goes the older way (loading.py's conversion), which
converts those. The tokenizer comes from transformers' GGUF converter, in a child process
(conversion.py), so that its import and heap never enter the serving process.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from . import native_c, native_c_weights
from .artifact import CACHE_FORMAT, META_FILE, TILES_FILE, TILES_INDEX, TOKENIZER_FILE, GGUFError
from .chat_templates import BUILTIN_TEMPLATES
from .gguf_reading import (FUSED_TENSORS, LAYER_NAMES, PERMUTED_QK_ARCHS, TOP_NAMES, GEMMA_POST_NORMS, NATIVE_ONLY, GGUFFile,
                           config_from_gguf, gguf_field, fused_parts)

log = logging.getLogger("outrider.llm")

KIND = "llama-gguf-tiles"
FORMAT = 2  # part of the artifact's key: bumped when what `build` writes changes (2: add_bos, Gemma 3)
ALIGN = 64  # bytes: every array in tiles.bin starts on a cache line (as native_model's)
CHUNK_BYTES = 32 << 20  # packed bytes per write of a large tensor: what a first start holds besides the maps
_DENSE = ("F32", "F16", "BF16")


class NotCovered(ValueError):
    """The file holds something this packing does not take (the older conversion serves it)."""


@dataclass
class Piece:
    """Rows of one GGUF tensor that become (part of) a matrix: `rows` of the tensor in the order the
    model reads them (llama's Q/K rows un-permuted)."""

    tensor: Any
    rows: np.ndarray  # int64 source rows, in output order

    @property
    def type_name(self) -> str:
        return self.tensor.tensor_type.name


@dataclass
class Plan:
    """What the model is made of, tensor by tensor, checked to be packable."""

    config: Any
    layers: list[dict[str, Any]] = field(default_factory=list)  # name -> [Piece] (matrices) or tensor (dense)
    embed: Any = None
    head: Any = None  # None: tied to the embeddings
    final_norm: Any = None


def _matrix_rows(tensor: Any) -> tuple[int, int]:
    cols, rows = (int(n) for n in tensor.shape)  # GGUF lists ne0 (the row length) first
    return rows, cols


def _pieces(tensor: Any, row_slice: slice, permute_heads: Optional[int]) -> Piece:
    rows, _ = _matrix_rows(tensor)
    index = np.arange(rows, dtype=np.int64)[row_slice]
    if permute_heads:
        from .gguf_reading import unpermute_rows

        index = unpermute_rows(index, permute_heads)
    return Piece(tensor, np.ascontiguousarray(index, dtype=np.int64))


def plan(reader: Any, path: Path) -> Plan:
    """The model in `reader`'s GGUF as tensors to pack; GGUFError for a file the backend cannot
    serve at all, NotCovered for one that only this packing cannot."""
    config = config_from_gguf(reader, path)
    names = {t.name: t for t in reader.tensors}
    if {"rope_factors_long.weight", "rope_factors_short.weight"} & set(names):
        raise GGUFError(f"{path}: LongRoPE (rope_factors_long/short, Phi-3's 128k models) is not supported; the "
                        f"4k-context models of the family are")
    out = Plan(config, [dict() for _ in range(config.num_layers)])
    permuted = config.architecture in PERMUTED_QK_ARCHS
    for tensor in reader.tensors:
        base, _, suffix = tensor.name.rpartition(".")
        parts = base.split(".")
        if tensor.name == "rope_freqs.weight":
            from gguf import dequantize

            config.rope_freq_factors = [float(v) for v in np.asarray(dequantize(tensor.data, tensor.tensor_type))]
            continue
        if parts[0] != "blk":
            if base not in TOP_NAMES:
                continue
            slot = {"token_embd": "embed", "output": "head", "output_norm": "final_norm"}[base]
            setattr(out, slot, tensor)
            continue
        layer = int(parts[1])
        kind = parts[2]
        if config.post_norms and kind in GEMMA_POST_NORMS:
            out.layers[layer][kind] = tensor
            continue
        if kind not in LAYER_NAMES and kind not in FUSED_TENSORS:
            raise GGUFError(f"{path}: tensor {tensor.name!r} is not part of a {config.architecture} layer the llm "
                            f"backend knows ({', '.join(sorted(LAYER_NAMES))})")
        entry = out.layers[layer]
        if suffix == "bias":
            entry[f"{kind}.bias"] = tensor
            continue
        if kind in ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm"):
            entry[kind] = tensor
            continue
        if kind in FUSED_TENSORS and not (kind == "ffn_up" and f"blk.{layer}.ffn_gate.weight" in names):
            for hf, rows in fused_parts(config, parts[1], kind, suffix):
                entry[hf.rsplit(".", 2)[-2]] = _pieces(tensor, rows, None)
            continue
        heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
        entry[LAYER_NAMES[kind].rsplit(".", 1)[-1]] = _pieces(
            tensor, slice(None), heads if permuted and kind in ("attn_q", "attn_k") else None)
    _check(out, path)
    return out


_MATRICES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
             "down": ("down_proj",)}


def _check(p: Plan, path: Path) -> None:
    try:
        _check_covered(p, path)
    except NotCovered as exc:
        if p.config.architecture in NATIVE_ONLY:  # no older way serves it
            raise GGUFError(f"{path}: {exc}: {p.config.architecture} is served from the file's blocks alone, which "
                            f"needs every matrix in {', '.join(native_c.PACKED_TYPES)}") from None
        raise


def _check_covered(p: Plan, path: Path) -> None:
    for i, entry in enumerate(p.layers):
        for names in _MATRICES.values():
            for name in names:
                piece = entry.get(name)
                if piece is None:
                    raise GGUFError(f"{path}: layer {i} has no {name} weight")
                if piece.type_name not in native_c.PACKED_TYPES:
                    raise NotCovered(f"layer {i} {name} ({piece.tensor.name}) is {piece.type_name}, not a type the "
                                     f"kernels take as it is")
                if len(piece.rows) % native_c.TILE:
                    raise NotCovered(f"layer {i} {name} has {len(piece.rows)} rows, not whole tiles of 16")
        for name in ("attn_norm", "ffn_norm") + (GEMMA_POST_NORMS if p.config.post_norms else ()):
            if name not in entry:
                raise GGUFError(f"{path}: layer {i} has no {name}")
    for what, tensor in (("token embeddings", p.embed), ("output", p.head)):
        if tensor is None:
            if what == "token embeddings":
                raise GGUFError(f"{path}: no token_embd.weight")
            continue
        if tensor.tensor_type.name not in native_c.PACKED_TYPES:
            raise NotCovered(f"the {what} are {tensor.tensor_type.name}, not a type the kernels take as it is")
    if p.final_norm is None:
        raise GGUFError(f"{path}: no output_norm.weight")


class _TilesFile:
    """tiles.bin written at reserved offsets (os.pwrite): nothing of it is held in memory."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.end = 0

    def reserve(self, dtype: Any, shape: tuple) -> list:
        """A [offset, dtype, shape] reference to a new aligned array of the file."""
        self.end = -(-self.end // ALIGN) * ALIGN
        ref = [self.end, np.dtype(dtype).str, [int(n) for n in shape]]
        self.end += int(np.prod(shape)) * np.dtype(dtype).itemsize
        return ref

    def write(self, ref: list, array: np.ndarray, at_bytes: int = 0) -> None:
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        written = 0
        while written < len(data):
            written += os.pwrite(self.fd, data[written:], ref[0] + at_bytes + written)

    def dense(self, array: np.ndarray) -> list:
        array = np.ascontiguousarray(array, dtype=np.float32)
        ref = self.reserve(array.dtype, array.shape)
        self.write(ref, array)
        return ref

    def close(self) -> None:
        os.ftruncate(self.fd, self.end)
        os.close(self.fd)


class _Dropper:
    """Drops a packed tensor's pages of the mapped GGUF from this process (they stay in the page
    cache): the first start's resident size does not grow by the whole file as it is read."""

    def __init__(self, reader: Any) -> None:
        self.mapped = getattr(reader.data, "_mmap", None)
        self.page = mmap.PAGESIZE

    def __call__(self, tensor: Any) -> None:
        if self.mapped is None or not hasattr(self.mapped, "madvise"):
            return
        start = tensor.data_offset // self.page * self.page
        end = tensor.data_offset + tensor.n_bytes
        try:
            self.mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass


def _dense(tensor: Any) -> np.ndarray:
    from gguf import dequantize

    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)


def _pack_matrix(out: _TilesFile, pieces: list[Piece], drop: _Dropper, five_bit: bool,
                 rows_out: Optional[int] = None) -> list[dict]:
    """The matrix's parts in tiles.bin: pieces of one packed shape side by side as one part (their
    tiles consecutive), others as parts of their own. A chunk of rows at a time."""
    groups: list[list[Piece]] = []
    for piece in pieces:
        if groups and groups[-1][0].type_name == piece.type_name:
            groups[-1].append(piece)
        else:
            groups.append([piece])
    parts = []
    for group in groups:
        _, cols = _matrix_rows(group[0].tensor)
        shape = native_c_weights.packed_shape(group[0].type_name, cols, five_bit)
        total = rows_out if rows_out is not None else sum(len(p.rows) for p in group)
        ref = out.reserve(np.uint8, shape.w_shape(total // native_c.TILE, cols))
        chunk_rows = max(native_c.TILE, CHUNK_BYTES // max(1, shape.w_tile_bytes) * native_c.TILE)
        tile = 0
        for piece in group:
            rows = piece.rows
            if rows_out is not None:  # padded to whole tiles: -1 rows are zeros
                rows = np.concatenate([rows, np.full(rows_out - len(rows), -1, np.int64)])
            blocks = np.asarray(piece.tensor.data).reshape(_matrix_rows(piece.tensor)[0], -1)
            for start in range(0, len(rows), chunk_rows):
                part = native_c_weights.pack_gguf(piece.type_name, blocks, cols,
                                                  rows_out=min(chunk_rows, len(rows) - start),
                                                  row_map=rows[start:start + chunk_rows], five_bit=five_bit)
                out.write(ref, part.w, tile * shape.w_tile_bytes)
                tile += part.out // native_c.TILE
            drop(piece.tensor)
        parts.append({"w": ref, "d": None, "m": None, "bits": shape.bits, "group": shape.group})
    return parts


def build(path: Path, directory: Path, five_bit: bool) -> dict:
    """Writes the tiles artifact of the GGUF at `path` into `directory` but for its tokenizer (the
    caller's, see `load_gguf_tiles`); returns its figures. NotCovered before anything is written."""
    reader = GGUFFile(path)
    p = plan(reader, path)
    config = p.config
    drop = _Dropper(reader)
    out = _TilesFile(directory / TILES_FILE)
    served: dict[str, int] = {}
    q_scale = config.query_scale or config.head_dim ** -0.5
    layers = []
    try:
        for i, entry in enumerate(p.layers):
            layer: dict[str, Any] = {"attn_norm": out.dense(_dense(entry["attn_norm"])),
                                     "mlp_norm": out.dense(_dense(entry["ffn_norm"])),
                                     "qkv_bias": None, "q_norm": None, "k_norm": None, "q_scale": q_scale,
                                     "activation": config.activation}
            if config.post_norms:  # GGUF holds Gemma's norms as 1 + w already, as every other norm here
                layer["attn_post_norm"] = out.dense(_dense(entry["post_attention_norm"]))
                layer["mlp_post_norm"] = out.dense(_dense(entry["post_ffw_norm"]))
            if config.swa_layers and config.swa_layers[i]:
                layer["window"], layer["rope_table"] = int(config.swa_window), 1 if config.swa_rope_theta else 0
            if config.attn_softcap:
                layer["attn_softcap"] = float(config.attn_softcap)
            for name, members in _MATRICES.items():
                pieces = [entry[m] for m in members]
                for piece in pieces:
                    served[piece.type_name] = served.get(piece.type_name, 0) + 1
                layer[name] = _pack_matrix(out, pieces, drop, five_bit)
            if "attn_q.bias" in entry:
                layer["qkv_bias"] = out.dense(np.concatenate([_dense(entry[f"attn_{x}.bias"]) for x in "qkv"]))
            if "attn_q_norm" in entry:
                layer["q_norm"] = out.dense(_dense(entry["attn_q_norm"]))
                layer["k_norm"] = out.dense(_dense(entry["attn_k_norm"]))
            layers.append(layer)
        vocab_rows, hidden = _matrix_rows(p.embed)
        padded = -(-vocab_rows // native_c.TILE) * native_c.TILE
        embed_part = _pack_matrix(out, [_pieces(p.embed, slice(None), None)], drop, five_bit, rows_out=padded)[0]
        served[p.embed.tensor_type.name] = served.get(p.embed.tensor_type.name, 0) + 1
        if p.head is None:
            head, embed = embed_part, "head"
        else:
            head_rows, _ = _matrix_rows(p.head)
            head = _pack_matrix(out, [_pieces(p.head, slice(None), None)], drop, five_bit,
                                rows_out=-(-head_rows // native_c.TILE) * native_c.TILE)[0]
            served[p.head.tensor_type.name] = served.get(p.head.tensor_type.name, 0) + 1
            embed = embed_part
        final_norm = out.dense(_dense(p.final_norm))
    finally:
        out.close()
    eos = config.eos_token_id
    template = gguf_field(reader, "tokenizer.chat_template")
    if not template and config.architecture in BUILTIN_TEMPLATES:
        template = BUILTIN_TEMPLATES[config.architecture]
        log.info("%s: no chat template in the file: %s's own (as llama.cpp keeps it built in)", path.name,
                 config.architecture)
    meta = {"chat_template": template, "bos_token_id": config.bos_token_id,
            "add_bos": bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
            "eos_token_ids": [eos] if eos is not None else [], "source": str(path), "block_types": served,
            "converted": {}, "config": config.to_dict(), "format": CACHE_FORMAT}
    (directory / META_FILE).write_text(json.dumps(meta))
    index = {"config": config.to_dict(), "fingerprint": "", "weight_bytes": (directory / TILES_FILE).stat().st_size,
             "layers": layers, "final_norm": final_norm, "head": head, "embed": embed,
             "embed_shape": [vocab_rows, hidden]}
    # No fingerprint recorded: the model computes it from the mapped rows when a draft head asks.
    (directory / TILES_INDEX).write_text(json.dumps(index))
    return {"block_types": served, "weight_bytes": index["weight_bytes"]}


def covered(path: Path) -> str:
    """Why the GGUF at `path` cannot be packed here ("" when it can): read from its header."""
    try:
        plan(GGUFFile(path), path)
    except NotCovered as exc:
        return str(exc)
    return ""


def load_gguf_tiles(gguf_path: "str | Path", cache: Any = None, in_child: bool = True) -> Any:
    """The "llama-gguf-tiles" artifact of a GGUF, built once from the mapped file (see the module
    docstring); NotCovered where it holds what this packing does not take (found before anything is
    packed; nothing is kept), GGUFError for a file the backend cannot serve. A warm start reads no
    more of the file than its cache key needs. A directory is a baked model (`baked_tiles`)."""
    from outrider.artifacts import ArtifactCache, hash_remembered

    path = Path(gguf_path)
    if path.is_dir():
        return baked_tiles(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    from .conversion import ChildConversion, convert

    cache = cache or ArtifactCache()
    five_bit = native_c.five_bit_layout(native_c.kernels())
    # The tokenizer (3-4 s, most of it importing transformers) is built in a child on the other core
    # while this one packs the tiles. For a file this cache never hashed (a first start, nearly
    # always) the child starts now, while the file is hashed for the cache key (0.6 s for 800 MB),
    # into a folder of its own; a cache entry found after all only costs the child's kill.
    early: Optional[ChildConversion] = None
    if in_child and not hash_remembered(path, cache.root):
        try:
            cache.root.mkdir(parents=True, exist_ok=True)
            early_dir = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=cache.root))
        except OSError:  # a read-only cache: get_or_build says what it can
            pass
        else:
            early = ChildConversion("tokenizer", path, early_dir)

    def make(directory: Path, progress: Any) -> dict:
        if not in_child:
            figures = build(path, directory, five_bit)  # NotCovered before it writes anything
            convert("tokenizer", path, directory)
        else:
            tokenizer = early or ChildConversion("tokenizer", path, directory)
            try:
                figures = build(path, directory, five_bit)
            except BaseException:
                tokenizer.cancel()
                raise
            tokenizer.result()
            if early is not None:
                os.replace(early_dir / TOKENIZER_FILE, directory / TOKENIZER_FILE)
        log.info("%s: packed from the file's blocks (%s), %.0f MB of tiles", path.name,
                 ", ".join(f"{k} x{v}" for k, v in sorted(figures["block_types"].items())),
                 figures["weight_bytes"] / 1e6)
        return figures

    try:
        return cache.get_or_build(KIND, make, label=f"{path.name} -> native tiles", sources=[path],
                                  versions=["gguf", "transformers", "tokenizers"],
                                  options={"format": FORMAT, "cache_format": CACHE_FORMAT, "five_bit_tiles": five_bit})
    finally:
        if early is not None:
            early.cancel()  # done already where it was used
            shutil.rmtree(early_dir, ignore_errors=True)


def baked_tiles(directory: Path) -> Any:
    """The artifact `outrider bake` wrote into `directory` (LlmBackend.bake_files: the cache entry's
    files as they are), served in place: nothing packed, no cache written. Every part records its own
    layout (bits, group), so tiles baked on one CPU class compute the same on any other; what must
    match is the format this version reads. GGUFError saying what differs otherwise."""
    from outrider.artifacts import PROVENANCE, Artifact

    try:
        provenance = json.loads((directory / PROVENANCE).read_text())
    except (OSError, ValueError) as exc:
        raise GGUFError(f"{directory} is a directory, not a GGUF file, and not a model baked by `outrider bake` "
                        f"either ({PROVENANCE}: {exc})") from None
    made = provenance.get("options") or {}
    wrote = (provenance.get("kind"), made.get("format"), made.get("cache_format"))
    if wrote != (KIND, FORMAT, CACHE_FORMAT):
        raise GGUFError(f"{directory}: baked as {wrote[0]!r} format {wrote[1]}/{wrote[2]}, and this version of "
                        f"outrider reads {KIND!r} format {FORMAT}/{CACHE_FORMAT}: bake it again with this version")
    missing = [name for name in (TILES_FILE, TILES_INDEX, META_FILE, TOKENIZER_FILE) if not (directory / name).is_file()]
    if missing:
        raise GGUFError(f"{directory}: a baked model without {', '.join(missing)} (copied only in part?)")
    return Artifact(directory, KIND, provenance)
