"""A Llama-family decoder on outrider's native CPU kernels through their C ABI, without torch.

What it is for: serving a quantized GGUF on a CPU in a process that never imports torch. torch's
import alone holds 220-260 MB and takes 1-2 s; this model's process holds the weights (the file's
own blocks, as the torch model holds them), numpy, tokenizers and the core.

What it runs: every decoder layer of a step is one call of `outrider_llama_layers` (csrc/c_api.cpp:
RMSNorm, int8 activations, each matrix in its own block type (parts side by side where a file mixes
them), Qwen2's q/k/v biases, Qwen3's q/k norms, RoPE, attention over exactly the keys each row may
see, SwiGLU), then the final norm and the LM head on the same kernels. Sampling and speculation are
the engine's (numpy), so a draft tree's rows get exactly a one-token step's logits here too.

What it covers (`coverage`): the llama (Llama, Mistral, SmolLM2), qwen2, qwen3 and phi3
architectures as loading.py converts them, with every layer matrix in a native block type (the
quantized GGUF types; see gguf_blocks.py), and a `quantize:` artifact of int4 groups (mode int4, as
outrider_quantize writes it for kernel w4a8: a Q4_1 file's own blocks), whose tied head is the fp32
embedding table in blocks of 32 int8 values (exactly a Q8_0 table, where it is one; the torch
model's w4a8 head) or its own int4 groups. A float matrix (an F16/F32 file, or a dense tensor), an
untied head without blocks, an int8 per-channel head or another quantize: mode is not covered: the
llm backend serves those with the torch model and says why. A draft head reads it through `make_linear` (numpy in, numpy
out: `array_api = "numpy"`), as outrider_speculative/draft_head.py does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from outrider.generation.contract import Chunk, ForwardOutput

from . import native_c
from .artifact import (BLOCKS_FORMAT, META_FILE, TILES_FILE, TILES_INDEX, TOKENIZER_FILE, WEIGHTS_FILE, artifact_dir, artifact_tokenizer,
                       read_artifact_meta)
from .config import FINGERPRINT_ROW_STRIDE, LlamaConfig, local_rope_config, rope_tables, weights_fingerprint
from .gguf_blocks import AffineGroups
from .heap import tune_malloc
from .kv_cache import NumpySlotKVCache, RingSlotKVCache

log = logging.getLogger("outrider.llm")

ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")  # from an artifact; Gemma 3 from its file alone (gguf_tiles.py)
# The packed model, mapped at start: its kernels' tiles as one file (see `load_tiles`).
TILES_KIND = "llama-native-tiles"
TILES_FORMAT = 2  # part of that artifact's key: bumped when what `_save_tiles` writes changes (2: the torch model's fingerprint)
ALIGN = 64  # bytes: every array in the tiles file starts on a cache line
ROPE_ROWS_AT_START = 2048  # positions the RoPE tables hold before a longer sequence grows them
#: rows a chunk may feed a sliding layer's ring in one pass (a longer prefill goes in passes): the
#: ring holds the window and this many rows, as llama.cpp's ubatch of 512
STEP_ROWS = 512
MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def coverage(meta: dict, keys: "set[str]") -> str:
    """Why this model cannot serve an artifact ("" when it can): `meta` its meta.json, `keys` the
    names in its weights file."""
    config = meta.get("config", {})
    arch = config.get("architecture", "llama")
    if arch not in ARCHITECTURES:
        return f"architecture {arch!r} (covered: {', '.join(ARCHITECTURES)})"
    quantize = meta.get("quantize")
    if quantize and quantize.get("mode") != "int4":
        return f"a quantize: artifact of mode {quantize.get('mode')!r} (the native model takes int4 groups)"
    formats = ("affine", "int4") if quantize else ("affine",)
    for i in range(int(config.get("num_layers", 0))):
        for name in MATRICES:
            base = f"model.layers.{i}.{name}.weight"
            if not any(f"{base}.{kind}.q" in keys for kind in formats):
                return f"{base} is not in a native block type (a float or dense matrix)"
    if "lm_head.weight.int8.q" in keys:
        return "an int8 per-channel LM head (torch's kernel)"
    embeddings = "model.embed_tokens.weight"
    if f"{embeddings}.affine.q" not in keys and not (quantize and embeddings in keys):
        return "the token embeddings are not in a native block type"
    head = any(f"lm_head.weight.{kind}.q" in keys for kind in formats)
    if not config.get("tie_word_embeddings", True) and not head:
        return "an untied LM head without native blocks"
    return ""


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [out, in / 2] two 4-bit values a byte (column 2j low, 2j+1 high; weights.pack_int4) -> [out, in]."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = packed & 15
    out[:, 1::2] = packed >> 4
    return out


class Weights:
    """Tensors by name (a state dict in linear.py's layout) as numpy arrays the model may keep."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self._tensors = tensors
        self.keys = set(tensors)

    @classmethod
    def of_artifact(cls, directory: Path) -> "Weights":
        """The artifact's weights file, read into memory the process owns (not views into the file's
        mmap, which would keep every touched page of it resident)."""
        from safetensors import safe_open

        out = cls({})
        out._file = safe_open(str(directory / WEIGHTS_FILE), framework="numpy")
        out.keys = set(out._file.keys())
        return out

    def get(self, name: str) -> np.ndarray:
        if name not in self.keys:
            raise KeyError(f"missing weight {name!r}")
        if name in self._tensors:
            value = self._tensors[name]
            return np.array(value.numpy() if hasattr(value, "numpy") else value)  # a torch tensor, in tests
        return np.array(self._file.get_tensor(name))

    def groups(self, name: str) -> AffineGroups:
        """The affine groups of weight `name`, q unpacked: a file's own blocks
        (`linear.affine_state_dict`'s layout) or int4 groups (`outrider.generation.weights`: w =
        (q - 8) scale + zero, so d = scale, m = zero - 8 scale in fp32, as linear.py's w4a8 tables form
        them before `_part` rounds them to fp16)."""
        if f"{name}.int4.q" in self.keys:
            q, scale, zero = (self.get(f"{name}.int4.{k}") for k in ("q", "scale", "zero"))
            if q.dtype != np.uint8 or scale.shape != zero.shape or scale.ndim != 2 or scale.shape[0] != q.shape[0] \
                    or (2 * q.shape[1]) % scale.shape[1]:
                raise ValueError(f"{name}: expected int4 q uint8 [out, in / 2] and scale, zero [out, in / group], got "
                                 f"{q.dtype} {q.shape}, {scale.shape}, {zero.shape}")
            d = scale.astype(np.float32)
            values = _unpack_nibbles(q)
            return AffineGroups(4, values, d, zero.astype(np.float32) - np.float32(8) * d,
                                values.shape[1] // d.shape[1], True, "int4")
        q, d, m = (self.get(f"{name}.affine.{k}") for k in ("q", "d", "m"))
        bits = int(self.get(f"{name}.affine.bits").reshape(-1)[0])
        if bits not in (4, 5, 8) or q.dtype != np.uint8 or d.shape != m.shape or d.ndim != 2:
            raise ValueError(f"{name}: expected affine q uint8, d and m of one 2-D shape and 4, 5 or 8 bits, got "
                             f"{q.dtype} {q.shape}, {d.shape}, {m.shape}, {bits} bits")
        values = _unpack_nibbles(q) if bits == 4 else q
        if values.shape[0] != d.shape[0] or values.shape[1] % d.shape[1]:
            raise ValueError(f"{name}: affine d {d.shape} does not fit q {values.shape}")
        return AffineGroups(bits, values, d, m, values.shape[1] // d.shape[1], True, "")


def _scaled(groups: AffineGroups, factor: float) -> AffineGroups:
    """The weight times `factor`, as linear.QuantTensor.scaled forms it: d and m scaled in fp32, kept
    in fp16 when the file's were (rounded when `factor` is not a power of two)."""
    d, m = groups.d.astype(np.float32) * np.float32(factor), groups.m.astype(np.float32) * np.float32(factor)
    if groups.d.dtype == np.float16 and groups.m.dtype == np.float16:
        d, m = d.astype(np.float16), m.astype(np.float16)
    return AffineGroups(groups.bits, groups.q, d, m, groups.group, groups.exact, groups.source)


def _five_bit_tiles() -> bool:
    return native_c.five_bit_layout(native_c.kernels())


def _part(groups: AffineGroups, pad_rows: bool = False) -> native_c.Part:
    """The kernel layout of `groups`; with `pad_rows`, rows padded with zeros to a whole tile (a
    head whose vocabulary is not a multiple of 16: its extra logits are cut off)."""
    if groups.source == "int4":
        # outrider's int4 groups: the torch model's w4a8 tables are fp16 (linear.py rounds them so,
        # after any scaling), and this model computes what that one does.
        groups = AffineGroups(4, groups.q, groups.d.astype(np.float16), groups.m.astype(np.float16), groups.group,
                              groups.exact, groups.source)
    if groups.bits == 5 and not _five_bit_tiles():
        groups = AffineGroups(8, groups.q, groups.d, groups.m, groups.group, groups.exact, groups.source)
    extra = -groups.q.shape[0] % native_c.TILE if pad_rows else 0
    if extra:
        def pad(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros((extra, a.shape[1]), a.dtype)])

        groups = AffineGroups(groups.bits, pad(groups.q), pad(groups.d), pad(groups.m), groups.group,
                              groups.exact, groups.source)
    return native_c.Part.from_affine(groups)


class _Rows:
    """Row lookups (embeddings) dequantized as asked from a part's tiles: no second copy of the table."""

    def __init__(self, part: native_c.Part, rows: int, columns: int) -> None:
        self.part, self.rows, self.columns = part, rows, columns
        self.super = native_c.own_layout(part.bits)  # scales among the values: the C library reads its rows
        self.layout = part.bits & 15
        log2 = (part.bits >> native_c.OFFSET_SHIFT) & 15
        self.offset = 1 << log2 if log2 else 0  # a symmetric type: m = -offset d

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """fp32 [n, columns]: w = q d + m of rows `ids` (as gguf_blocks.AffineGroups.dequantize)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise ValueError(f"token ids must be in 0 .. {self.rows - 1}, got {int(ids.min())} .. {int(ids.max())}")
        if self.super:
            return native_c.dequantize_super_rows(self.part, ids)
        tile, lane = ids // native_c.TILE, ids % native_c.TILE
        q = _tile_rows(self.part.w, self.layout, tile, lane).astype(np.float32)  # [n, columns]
        d = self.part.d[tile, :, lane].astype(np.float32)  # [n, groups]
        m = (-np.float32(self.offset) * d) if self.part.m is None else self.part.m[tile, :, lane].astype(np.float32)
        group = self.columns // d.shape[1]
        q = q.reshape(len(ids), d.shape[1], group)
        return (q * d[..., None] + m[..., None]).reshape(len(ids), self.columns)


class _DenseRows:
    """Row lookups of an fp32 table the model holds as it is (a quantize: artifact's embeddings where
    its tied head is not exactly that table, as the torch model keeps them)."""

    part = None

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.rows, self.columns = table.shape

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise ValueError(f"token ids must be in 0 .. {self.rows - 1}, got {int(ids.min())} .. {int(ids.max())}")
        return self.table[ids]


def int8_blocks(table: np.ndarray, block: int = 32) -> tuple[AffineGroups, bool]:
    """fp32 [rows, cols] in blocks of `block` int8 values with one scale each, w = q d (Q8_0), as
    groups of 8 bits (q + 128, m = -128 d), and whether that holds every value exactly (a GGUF's
    Q8_0 table dequantized). Where it does not, the values are quantized as linear.py's w4a8 head
    quantizes them: d = amax / 127 rounded to fp16, q = round(w / d)."""
    rows, cols = table.shape
    if cols % block:
        raise ValueError(f"a table of {cols} columns does not split into blocks of {block}")
    q = np.empty((rows, cols), dtype=np.uint8)
    scale = np.empty((rows, cols // block), dtype=np.float32)
    exact = True
    for start in range(0, rows, 4096):  # chunks: the temporaries stay small
        part = table[start:start + 4096].astype(np.float32).reshape(-1, cols // block, block)
        d = np.abs(part).max(axis=2) / np.float32(127)  # Q8_0 puts 127 at each block's largest magnitude
        d = np.where(d > 0, d, np.float32(1)).astype(np.float32)
        values = np.rint(part / d[..., None])
        if exact and (np.abs(values).max() > 127 or not np.array_equal(values * d[..., None], part)):
            exact = False
        if not exact:
            break
        q[start:start + 4096] = (values + 128).astype(np.uint8).reshape(-1, cols)
        scale[start:start + 4096] = d
    if not exact:
        blocks = table.astype(np.float32).reshape(rows, cols // block, block)
        scale = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float16).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1))
        q = (np.clip(np.rint(blocks / safe[..., None]), -127, 127) + 128).astype(np.uint8).reshape(rows, cols)
    return AffineGroups(8, q, scale, scale * np.float32(-128), block, exact, "Q8_0"), exact


def _tile_rows(w: np.ndarray, layout: int, tile: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """uint8 [n, in]: the values of rows (tile, lane) of a weight in the kernels' layout `layout`
    (csrc/kernels.h; the inverse of native_c's packers, for those rows only)."""
    n, blocks = len(tile), w.shape[1]
    # bytes 4i .. 4i+3 of every block are row lane i's: one gather over (tile, lane), blocks kept whole
    if w.shape[2] == 64:
        b = w.reshape(w.shape[0], blocks, 16, 4)[tile, :, lane, :]  # [n, block, p]
    else:  # 5 bits: a fifth-bit plane follows the 64 bytes (a reshape would copy the whole weight)
        b = w[tile[:, None, None], np.arange(blocks)[None, :, None], (4 * lane)[:, None, None] + np.arange(4)]
    if layout == 8:  # byte 4i+p of block j: input 4j+p
        return b.reshape(n, blocks * 4)
    # inputs 8j+p (low nibble) and 8j+4+p (high)
    q = np.stack([b & 15, b >> 4], axis=2)  # [n, block, half, p]
    if layout == 5:  # bit L = 4i+p of fifth-bit byte 8 half + L // 8: the value's bit 4
        lanes = (4 * lane)[:, None] + np.arange(4)  # [n, p]
        plane = w[tile, :, 64:].reshape(n, blocks, 2, 8)  # [n, block, half, byte]
        byte = np.take_along_axis(plane, np.broadcast_to((lanes // 8)[:, None, None, :], (n, blocks, 2, 4)), axis=3)
        q = q | (((byte >> (lanes % 8)[:, None, None, :]) & 1) << 4)
    return q.reshape(n, blocks * 8)


class NativeLlama:
    """`outrider.generation.contract.CausalLM` on the native kernels' C ABI (see the module docstring)."""

    dtype = "float32"  # what its activations and K/V are; its matrices are the file's blocks
    device = "cpu"
    array_api = "numpy"  # what it takes and returns (drafters pick their implementation by it)

    def __init__(self, config: LlamaConfig, layers: native_c.LayerStack, final_norm: np.ndarray,
                 head: native_c.Part, embed: _Rows, fingerprint: str, weight_bytes: int) -> None:
        self.config = config
        self.layers = layers
        self.final_norm = final_norm
        self.head = head
        self.embed_rows = embed
        self.vocab_size = embed.rows if head is embed.part else _rows_of(head, config)
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_layers
        self._fingerprint = fingerprint
        self._weight_bytes = weight_bytes
        self.captured_layers: tuple[int, ...] = ()  # see capture_hidden
        self._rope_table(ROPE_ROWS_AT_START)

    # ---- loading ---------------------------------------------------------------------------

    @classmethod
    def from_artifact(cls, artifact: Any) -> tuple["NativeLlama", Any]:
        """(model, ChatTokenizer) from a "llama-gguf-blocks" artifact; ValueError naming what it does
        not cover (`coverage`)."""
        loaded, why = native_c.library()
        if not loaded:
            raise ValueError(f"the native kernels' C library is not loaded: {why}")
        # Freed temporaries stay in the heap: without it every step's multi-MB buffers page-faulted
        # afresh (decode 20 against 120 tok/s on SmolLM2 here).
        tune_malloc()
        directory = artifact_dir(artifact)
        meta = read_artifact_meta(directory)
        model = cls.from_weights(LlamaConfig.from_dict(meta["config"]), Weights.of_artifact(directory), meta)
        return model, artifact_tokenizer(directory)

    @classmethod
    def from_weights(cls, cfg: LlamaConfig, weights: Weights, meta: Optional[dict] = None) -> "NativeLlama":
        """The model of `weights` (`Weights`: an artifact's, or a state dict in a test); ValueError
        naming what it does not cover."""
        missing = coverage({"config": cfg.to_dict(), **(meta or {})}, weights.keys)
        if missing:
            raise ValueError(f"the torch-free CPU model does not cover this model: {missing}")
        scale = cfg.head_dim ** -0.5
        layers = []
        total = 0
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."

            def part(name: str, factor: float = 1.0) -> native_c.Part:
                groups = weights.groups(p + name + ".weight")
                return _part(groups if factor == 1.0 else _scaled(groups, factor))

            # 1/sqrt(head_dim) folded into q (under a q norm, into the norm's weight), as the torch model does.
            q_scale = 1.0 if cfg.qk_norm else scale
            layer = native_c.Layer(
                attn_norm=weights.get(p + "input_layernorm.weight").astype(np.float32),
                mlp_norm=weights.get(p + "post_attention_layernorm.weight").astype(np.float32),
                qkv=_fused([part("self_attn.q_proj", q_scale), part("self_attn.k_proj"), part("self_attn.v_proj")]),
                o=part("self_attn.o_proj"),
                gate_up=_fused([part("mlp.gate_proj"), part("mlp.up_proj")]),
                down=part("mlp.down_proj"),
            )
            if cfg.qkv_bias:
                layer.qkv_bias = np.concatenate([
                    weights.get(p + "self_attn.q_proj.bias").astype(np.float32) * np.float32(scale),
                    weights.get(p + "self_attn.k_proj.bias").astype(np.float32),
                    weights.get(p + "self_attn.v_proj.bias").astype(np.float32)])
            if cfg.qk_norm:
                layer.q_norm = weights.get(p + "self_attn.q_norm.weight").astype(np.float32) * np.float32(scale)
                layer.k_norm = weights.get(p + "self_attn.k_norm.weight").astype(np.float32)
            layers.append(layer)
        stack = native_c.LayerStack(layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
        for layer in layers:
            for parts in (layer.qkv, layer.o, layer.gate_up, layer.down):
                total += sum(_nbytes(x) for x in _parts_of(parts))
        own_head = any(f"lm_head.weight.{kind}.q" in weights.keys for kind in ("affine", "int4"))  # untied, or apart
        name = "model.embed_tokens.weight"
        if f"{name}.affine.q" in weights.keys:
            embed_groups, exact = weights.groups(name), True
        else:  # a quantize: artifact's fp32 table: its tied head in int8 blocks (see `int8_blocks`)
            table = weights.get(name).astype(np.float32)
            embed_groups, exact = int8_blocks(table)
        head = _part(weights.groups("lm_head.weight") if own_head else embed_groups, pad_rows=True)
        if not exact:  # lookups read the table itself, as the torch model does
            embed: Any = _DenseRows(table)
        else:
            # A tied head without its own blocks is the table: lookups read rows from its tiles (one copy).
            embed = _Rows(_part(embed_groups) if own_head else head, *embed_groups.shape)
        total += _nbytes(head) + (0 if embed.part is head else
                                  embed.table.nbytes if embed.part is None else _nbytes(embed.part))
        del embed_groups
        final_norm = weights.get("model.norm.weight").astype(np.float32)
        return cls(cfg, stack, final_norm, head, embed, _fingerprint(cfg, embed, final_norm, layers), total)

    def weight_bytes(self) -> int:
        """Bytes of weights the model holds (its packed tiles and tables)."""
        return self._weight_bytes

    def _rope_table(self, size: int) -> None:
        self._cos, self._sin_signed = rope_tables(self.config, size)  # the torch model's tables
        if self.layers.rope_tables > 1:  # Gemma 3's sliding layers: table 1, their own base
            local = rope_tables(local_rope_config(self.config), size)
            self._cos, self._sin_signed = np.stack([self._cos, local[0]]), np.stack([self._sin_signed, local[1]])

    # ---- CausalLM ----------------------------------------------------------------------------

    #: what the KV cache holds: float32 (as the torch model's, bit for bit), or float16 (as llama.cpp's
    #: f16 cache: half the bytes a token, read widened to fp32 by the attention kernels); the llm
    #: backend sets it from `options.kv_cache`, whose default is f16
    kv_dtype: Any = np.float32

    def new_cache(self, num_slots: int, max_length: int) -> NumpySlotKVCache:
        """A KV cache for `num_slots` sequences of up to `max_length` tokens each, grown as admitted;
        a model with sliding layers keeps rings for those (kv_cache.RingSlotKVCache) where a ring is
        smaller than the context."""
        cfg = self.config
        if cfg.swa_layers and any(cfg.swa_layers) and cfg.swa_window + STEP_ROWS - 1 < max_length:
            return RingSlotKVCache(cfg, num_slots, max_length, STEP_ROWS, dtype=self.kv_dtype)
        return NumpySlotKVCache(cfg, num_slots, max_length, dtype=self.kv_dtype)

    def capture_hidden(self, layers: "tuple[int, ...] | list[int]") -> None:
        """From now on every forward also returns `aux_hidden`, fp32 [rows, len(layers) x hidden]: the
        residual stream entering each of `layers` (ascending, 0 .. num_layers - 1), side by side, as
        EAGLE-3 heads read the target's low, middle and high features. The layer stack then runs in
        pieces between them (one C call each), the same arithmetic as one call."""
        layers = tuple(int(i) for i in layers)
        if list(layers) != sorted(layers) or not all(0 <= i < self.config.num_layers for i in layers):
            raise ValueError(f"capture_hidden: layers {list(layers)}: expected ascending layer numbers in "
                             f"0..{self.config.num_layers - 1} (none: capture nothing)")
        self.captured_layers = layers

    def _run_layers(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: native_c.KvCaches,
                    chunks: np.ndarray, visible: Optional[np.ndarray], positions: Optional[np.ndarray],
                    aux: Optional[np.ndarray], rows: Optional[np.ndarray] = None) -> None:
        """The layer stack on x in place; with `aux`, the residual stream entering each captured layer
        copied into its rows (`rows`: which of aux's rows x's rows are; all when None)."""
        if aux is None:
            self.layers(x, cos, sin, kv, chunks, visible, positions)
            return
        start, width = 0, self.hidden_size
        for i, layer in enumerate(self.captured_layers):
            self.layers(x, cos, sin, kv, chunks, visible, positions, span=(start, layer))
            if rows is None:
                aux[:, i * width:(i + 1) * width] = x
            else:
                aux[rows, i * width:(i + 1) * width] = x
            start = layer
        self.layers(x, cos, sin, kv, chunks, visible, positions, span=(start, len(self.layers)))

    def load_draft_model(self, path: "str | Path") -> tuple["NativeLlama", Any]:
        """(model, tokenizer) of another GGUF on this runtime, for the draft-model drafter: its tiles
        packed from the mapped file into the artifact cache once (as the target's), its KV cache of
        this model's type (f16 where this one's is q8_0 and its head_dim takes no blocks of 32).
        ValueError where the native runtime does not serve the file."""
        from .gguf_tiles import load_gguf_tiles

        model, tokenizer = load_tiles(load_gguf_tiles(path))
        kv = self.kv_dtype
        model.kv_dtype = np.float16 if isinstance(kv, str) and model.config.head_dim % 32 else kv
        return model, tokenizer

    def embed(self, tokens: Any) -> np.ndarray:
        """fp32 [n, hidden] input embeddings of token ids (Gemma's scaled by sqrt(hidden))."""
        rows = self.embed_rows(np.asarray(tokens, dtype=np.int64).reshape(-1))
        if self.config.embed_scale != 1.0:
            rows *= np.float32(self.config.embed_scale)
        return rows

    def lm_head(self, hidden: Any) -> np.ndarray:
        """fp32 [n, vocab] logits of fp32 [n, hidden] (after the final norm)."""
        x = np.ascontiguousarray(np.asarray(hidden, dtype=np.float32).reshape(-1, self.hidden_size))
        logits = self.head.matmul(x)
        if logits.shape[1] != self.vocab_size:
            logits = np.ascontiguousarray(logits[:, :self.vocab_size])
        cap = self.config.final_softcap
        if cap:  # Gemma 2: logits soft-capped to cap * tanh(logits / cap)
            logits = (np.tanh(logits / np.float32(cap)) * np.float32(cap)).astype(np.float32)
        return logits

    def lm_head_rows(self, tokens: Any) -> np.ndarray:
        """The head's rows for `tokens`, fp32 [k, hidden]."""
        return _Rows(self.head, self.vocab_size, self.hidden_size)(np.asarray(tokens, dtype=np.int64).reshape(-1))

    def make_linear(self, weight: Any, dtype: Any = None, quantize: Optional[str] = None) -> Any:
        """y = x @ W.T for fp32 numpy x [n, in] (a draft head's matmuls): with quantize="int4", W in
        4-bit groups of 32 (min/max per group, as weights.quantize_int4) on the native kernels, where
        the shape takes tiles of 16 outputs (rows padded) and groups of 32 inputs; else fp32 (numpy)."""
        w = np.ascontiguousarray(np.asarray(weight, dtype=np.float32))
        out, inp = w.shape
        if quantize == "int4" and inp % 32 == 0:
            part = _part(_int4_groups(w, 32), pad_rows=True)
            if out == part.out:
                return part.matmul
            return lambda x: np.ascontiguousarray(part.matmul(np.ascontiguousarray(x, dtype=np.float32))[:, :out])
        transposed = np.ascontiguousarray(w.T)
        return lambda x: np.asarray(x, dtype=np.float32) @ transposed

    def fingerprint(self) -> str:
        """Identifies the weights: the torch model's fingerprint of the same file (config.weights_fingerprint);
        computed from the mapped rows on first use where the packed file does not record it."""
        if not self._fingerprint:
            self._fingerprint = _fingerprint(self.config, self.embed_rows, self.final_norm, self.layers.layers)
        return self._fingerprint

    def forward(self, cache: NumpySlotKVCache, chunks: list[Chunk],
                logit_rows: Optional[np.ndarray] = None) -> ForwardOutput:
        """One pass over every chunk's tokens (contract.py); K/V appended tentatively."""
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        table, seen, start = [], set(), 0
        for c in chunks:
            tokens = np.asarray(c.tokens, dtype=np.int64)
            positions = np.asarray(c.positions, dtype=np.int64)
            n = tokens.shape[0] if tokens.ndim == 1 else 0
            if not 0 <= c.slot < cache.num_slots:
                raise ValueError(f"slot {c.slot} out of range (cache has {cache.num_slots})")
            if c.slot in seen:
                raise ValueError(f"slot {c.slot} appears in two chunks of one forward")
            seen.add(c.slot)
            if n == 0 or positions.shape != tokens.shape:
                raise ValueError(f"chunk for slot {c.slot}: tokens and positions must be equal-length 1-D, n >= 1")
            length = cache.length(c.slot)
            if length + n > cache.max_length:
                raise ValueError(f"slot {c.slot}: {length} committed + {n} fed tokens exceed max_length "
                                 f"{cache.max_length}")
            cache.reserve(c.slot, length + n)
            mask = None if c.tree_mask is None else np.asarray(c.tree_mask, dtype=bool)
            if mask is not None and mask.shape != (n, n):
                raise ValueError(f"chunk for slot {c.slot}: tree_mask must be [{n}, {n}], got {list(mask.shape)}")
            table.append((c.slot, start, n, length, tokens, positions, mask))
            start += n
        total = start
        tokens = np.concatenate([t[4] for t in table])
        positions = np.concatenate([t[5] for t in table])
        chunk_table = np.array([t[:4] for t in table], dtype=np.int64)
        visible = None
        if any(t[6] is not None for t in table):
            width = max(t[2] for t in table)
            visible = np.zeros((total, width), dtype=bool)
            for _, first, n, _, _, _, mask in table:
                visible[first:first + n, :n] = np.tril(np.ones((n, n), dtype=bool)) if mask is None else mask
        top = int(positions.max())
        if top >= self._cos.shape[-2]:
            self._rope_table(max(top + 1, 2 * self._cos.shape[-2]))
        if int(positions.min()) < 0:
            raise ValueError("positions must be >= 0")
        cos = np.ascontiguousarray(self._cos[..., positions, :])
        sin = np.ascontiguousarray(self._sin_signed[..., positions, :])
        x = np.ascontiguousarray(self.embed(tokens))
        kv = self._kv_table(cache)
        aux = np.empty((total, len(self.captured_layers) * self.hidden_size), np.float32) \
            if self.captured_layers else None
        if isinstance(cache, RingSlotKVCache) and max(t[2] for t in table) > cache.step_rows:
            # A ring holds a window and one step's rows: a longer prefill goes in passes of at most
            # step_rows rows a chunk, each row computed as in one pass (rows never depend on each other).
            self._in_passes(x, cos, sin, kv, table, positions, cache.step_rows, aux)
        else:
            self._run_layers(x, cos, sin, kv, chunk_table, visible, positions if self.layers.windowed else None, aux)
        hidden = native_c.rms_norm(x, self.final_norm, self.config.rms_norm_eps)
        for slot, _, n, *_ in table:
            cache._fed[slot] = n
        rows = hidden if logit_rows is None else np.ascontiguousarray(hidden[np.asarray(logit_rows, dtype=np.int64)])
        return ForwardOutput(logits=self.lm_head(rows), hidden=hidden, aux_hidden=aux)


    def _kv_table(self, cache: NumpySlotKVCache) -> native_c.KvCaches:
        """The native KV table of `cache`, rebuilt when its arrays moved (it grew)."""
        kv = getattr(cache, "native_table", None)
        if isinstance(cache, RingSlotKVCache):
            if kv is None or kv.keep[0] is not cache.kv or kv.keep[1] is not cache.ring:
                arrays, rings = cache.layer_caches()
                kv = cache.native_table = native_c.KvCaches(arrays, self.config.num_kv_heads, rings)
                kv.keep = (cache.kv, cache.ring, arrays)
        elif kv is None or kv.keep is not cache.kv:
            kv = cache.native_table = native_c.KvCaches(cache.kv, self.config.num_kv_heads)
        return kv

    def _in_passes(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: native_c.KvCaches, table: list,
                   positions: np.ndarray, rows: int, aux: Optional[np.ndarray] = None) -> None:
        """The layer stack over causal chunks (`table` as forward builds it) in passes of at most
        `rows` rows a chunk: pass k takes each chunk's k-th piece, its earlier pieces already in the
        cache as if committed (the chunk's length grows by the rows before)."""
        longest = max(t[2] for t in table)
        for done in range(0, longest, rows):
            picks, entries, masks, at = [], [], [], 0
            for slot, first, n, length, _, _, mask in table:
                take = min(rows, n - done)
                if take <= 0:
                    continue
                if mask is not None and take != n:  # a tree never spans passes (it is one step's drafts)
                    raise ValueError(f"slot {slot}: a chunk with a tree mask of {n} rows exceeds {rows} a pass")
                picks.append(np.arange(first + done, first + done + take))
                entries.append((slot, at, take, length + done))
                masks.append((at, take, mask))
                at += take
            visible = None
            if any(m is not None for _, _, m in masks):
                visible = np.zeros((at, max(t for _, t, _ in masks)), dtype=bool)
                for start, take, mask in masks:
                    visible[start:start + take, :take] = np.tril(np.ones((take, take), bool)) if mask is None else mask
            pick = np.concatenate(picks)
            part = np.ascontiguousarray(x[pick])
            self._run_layers(part, np.ascontiguousarray(cos[..., pick, :]), np.ascontiguousarray(sin[..., pick, :]),
                             kv, np.array(entries, dtype=np.int64), visible, np.ascontiguousarray(positions[pick]),
                             aux, pick)
            x[pick] = part


def _fused(parts: list[native_c.Part]) -> Any:
    """Parts of one fused matrix (q|k|v, gate|up): one part where they share a layout and group
    (concatenated along the outputs, one kernel call), else side by side."""
    first = parts[0]
    same = all(p.bits == first.bits and p.group == first.group and p.d.dtype == first.d.dtype
               and (p.m is None) == (first.m is None) for p in parts)
    if not same or len(parts) == 1:
        return parts if len(parts) > 1 else first
    m = None if first.m is None else np.concatenate([p.m for p in parts])
    return native_c.Part(np.concatenate([p.w for p in parts]), np.concatenate([p.d for p in parts]), m,
                         first.bits, first.group)


def _int4_groups(w: np.ndarray, group: int) -> AffineGroups:
    """fp32 [out, in] as 4-bit affine groups: per group, w ~ q d + m with m its minimum and d its range / 15
    (weights.quantize_int4's rounding, without torch)."""
    out, inp = w.shape
    g = w.reshape(out, inp // group, group)
    low, high = g.min(axis=-1), g.max(axis=-1)
    scale = (high - low) / np.float32(15)
    scale = np.where(scale > 0, scale, np.float32(1))  # a constant group: q = 0 gives its value
    q = np.clip(np.rint((g - low[..., None]) / scale[..., None]), 0, 15).astype(np.uint8).reshape(out, inp)
    return AffineGroups(4, q, scale.astype(np.float32), low.astype(np.float32), group, False, "int4")


def _rows_of(head: native_c.Part, config: LlamaConfig) -> int:
    """The vocabulary of an untied head (its tiles may be padded to 16 rows)."""
    return min(head.out, config.vocab_size) if config.vocab_size else head.out


def _parts_of(parts: Any) -> list:
    return parts if isinstance(parts, list) else [parts]


def _nbytes(part: native_c.Part) -> int:
    return int(part.w.nbytes + (0 if part.d is None else part.d.nbytes) + (0 if part.m is None else part.m.nbytes))


def _fingerprint(cfg: LlamaConfig, embed: _Rows, final_norm: np.ndarray, layers: list) -> str:
    """The torch model's `fingerprint()` of the same weights (config.weights_fingerprint), so a draft
    head trained on either serves both."""
    rows = embed(np.arange(0, embed.rows, FINGERPRINT_ROW_STRIDE))
    norms = [w for layer in layers for w in (layer.attn_norm, layer.mlp_norm)]
    return weights_fingerprint(cfg, embed.rows, cfg.hidden_size, rows, final_norm, norms)


# ---- the packed model on disk --------------------------------------------------------------------


def load_tiles(blocks: Any, cache: Any = None) -> tuple[NativeLlama, Any]:
    """(model, tokenizer) of a "llama-gguf-blocks" artifact, from its packed form in the artifact cache
    ("llama-native-tiles": every array the model computes with, in the kernels' layouts, in one file),
    built on the first start and mapped read-only after: a warm start packs nothing and copies
    nothing (the pages come from the page cache, shared by every process serving the file).
    ValueError naming what the model does not cover, as `NativeLlama.from_artifact`."""
    from outrider.artifacts import ArtifactCache

    loaded, why = native_c.library()
    if not loaded:
        raise ValueError(f"the native kernels' C library is not loaded: {why}")
    tune_malloc()  # see NativeLlama.from_artifact
    source = artifact_dir(blocks)
    if (source / TILES_INDEX).is_file():  # packed from the GGUF itself (gguf_tiles.py): mapped as it is
        return _map_tiles(source), artifact_tokenizer(source)
    cache = cache or ArtifactCache()

    def build(directory: Path, progress: Any) -> dict:
        from .heap import release_free_memory

        model, _ = NativeLlama.from_artifact(source)
        _save_tiles(model, directory)
        for name in (TOKENIZER_FILE, META_FILE):
            (directory / name).write_bytes((source / name).read_bytes())
        del model
        release_free_memory()  # the packing's temporaries
        return {"weight_bytes": (directory / TILES_FILE).stat().st_size}

    # The source's meta is checked first: an artifact the model does not cover fails before a build.
    missing = coverage(read_artifact_meta(source), _weight_names(source))
    if missing:
        raise ValueError(f"the torch-free CPU model does not cover this model: {missing}")
    artifact = cache.get_or_build(
        TILES_KIND, build, label=f"{source.name} -> native tiles", sources=[source / WEIGHTS_FILE],
        options={"format": TILES_FORMAT, "blocks": BLOCKS_FORMAT, "five_bit_tiles": _five_bit_tiles()},
    )
    return _map_tiles(Path(artifact.path)), artifact_tokenizer(artifact)


def _weight_names(directory: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / WEIGHTS_FILE), framework="numpy") as f:
        return set(f.keys())


def _save_tiles(model: NativeLlama, directory: Path) -> None:
    """Every array of `model` into TILES_FILE (aligned, raw) and how to put it together into TILES_INDEX."""
    offset = 0
    arrays: list[tuple[int, np.ndarray]] = []

    def ref(a: Optional[np.ndarray]) -> Optional[list]:
        nonlocal offset
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        offset = -(-offset // ALIGN) * ALIGN
        arrays.append((offset, a))
        out = [offset, a.dtype.str, list(a.shape)]
        offset += a.nbytes
        return out

    def part(p: native_c.Part) -> dict:
        return {"w": ref(p.w), "d": ref(p.d), "m": ref(p.m), "bits": int(p.bits), "group": int(p.group)}

    layers = []
    for layer in model.layers.layers:
        entry = {name: ref(getattr(layer, name)) for name in ("attn_norm", "mlp_norm", "qkv_bias", "q_norm", "k_norm",
                                                              "attn_post_norm", "mlp_post_norm")}
        entry.update(q_scale=float(layer.q_scale), activation=layer.activation, rope_table=int(layer.rope_table),
                     window=int(layer.window), attn_softcap=float(layer.attn_softcap))
        for name in ("qkv", "o", "gate_up", "down"):
            entry[name] = [part(p) for p in _parts_of(getattr(layer, name))]
        layers.append(entry)
    head = part(model.head)
    rows = model.embed_rows
    embed = "head" if rows.part is model.head else {"table": ref(rows.table)} if rows.part is None else part(rows.part)
    index = {"config": model.config.to_dict(), "fingerprint": model.fingerprint(), "weight_bytes": model.weight_bytes(),
             "layers": layers, "final_norm": ref(model.final_norm), "head": head, "embed": embed,
             "embed_shape": [model.embed_rows.rows, model.embed_rows.columns]}
    with open(directory / TILES_FILE, "wb") as f:
        for at, a in arrays:
            f.seek(at)
            f.write(memoryview(a).cast("B"))
    (directory / TILES_INDEX).write_text(json.dumps(index))


def _map_tiles(directory: Path) -> NativeLlama:
    """The model of a tiles artifact, its arrays read-only views of the mapped file."""
    index = json.loads((directory / TILES_INDEX).read_text())
    mapped = np.memmap(directory / TILES_FILE, dtype=np.uint8, mode="r")

    def get(r: Optional[list]) -> Optional[np.ndarray]:
        if r is None:
            return None
        at, dtype, shape = r
        return np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=mapped, offset=at)

    def part(p: dict) -> native_c.Part:
        return native_c.Part(get(p["w"]), get(p["d"]), get(p["m"]), p["bits"], p["group"])

    def matrix(parts: list) -> Any:
        return part(parts[0]) if len(parts) == 1 else [part(p) for p in parts]

    cfg = LlamaConfig.from_dict(index["config"])
    layers = [native_c.Layer(attn_norm=get(e["attn_norm"]), mlp_norm=get(e["mlp_norm"]), qkv=matrix(e["qkv"]),
                             o=matrix(e["o"]), gate_up=matrix(e["gate_up"]), down=matrix(e["down"]),
                             qkv_bias=get(e["qkv_bias"]), q_norm=get(e["q_norm"]), k_norm=get(e["k_norm"]),
                             q_scale=float(e.get("q_scale", 0.0)), attn_post_norm=get(e.get("attn_post_norm")),
                             mlp_post_norm=get(e.get("mlp_post_norm")), activation=e.get("activation", "silu"),
                             rope_table=int(e.get("rope_table", 0)), window=int(e.get("window", 0)),
                             attn_softcap=float(e.get("attn_softcap", 0.0)))
              for e in index["layers"]]
    stack = native_c.LayerStack(layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                eps=cfg.rms_norm_eps)
    head = part(index["head"])
    if index["embed"] == "head":
        embed: Any = _Rows(head, *index["embed_shape"])
    elif "table" in index["embed"]:
        embed = _DenseRows(get(index["embed"]["table"]))
    else:
        embed = _Rows(part(index["embed"]), *index["embed_shape"])
    return NativeLlama(cfg, stack, get(index["final_norm"]), head, embed, index["fingerprint"], index["weight_bytes"])
