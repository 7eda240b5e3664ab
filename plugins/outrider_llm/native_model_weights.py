"""The torch-free model's weights (native_model.py): what it covers (`coverage`), an artifact's
tensors read as numpy (`Weights`), packed into the native kernels' parts and layer stack
(`pack_weights`), and the embeddings' row lookups read from those parts (`PartRows`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np

from . import native_c
from .artifact import WEIGHTS_FILE
from .config import FINGERPRINT_ROW_STRIDE, LlamaConfig, weights_fingerprint
from .gguf_blocks import AffineGroups
from .native_c_layers import Layer, LayerStack
from .native_c_weights import Part, dequantize_super_rows

ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")  # from an artifact; Gemma 3 from its file alone (gguf_tiles.py)
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


def weight_names(directory: Path) -> set[str]:
    """The names in an artifact's weights file (what `coverage` reads), without reading the tensors."""
    from safetensors import safe_open

    with safe_open(str(directory / WEIGHTS_FILE), framework="numpy") as f:
        return set(f.keys())




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
        them before `kernel_part` rounds them to fp16)."""
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


def scaled_groups(groups: AffineGroups, factor: float) -> AffineGroups:
    """The weight times `factor`, as quantized_weights.QuantTensor.scaled forms it: d and m scaled in fp32, kept
    in fp16 when the file's were (rounded when `factor` is not a power of two)."""
    d, m = groups.d.astype(np.float32) * np.float32(factor), groups.m.astype(np.float32) * np.float32(factor)
    if groups.d.dtype == np.float16 and groups.m.dtype == np.float16:
        d, m = d.astype(np.float16), m.astype(np.float16)
    return AffineGroups(groups.bits, groups.q, d, m, groups.group, groups.exact, groups.source)


def five_bit_tiles() -> bool:
    """Whether 5-bit weights take the 5-bit layout on the kernel set in use (native_c.five_bit_layout)."""
    return native_c.five_bit_layout(native_c.kernels())


def kernel_part(groups: AffineGroups, pad_rows: bool = False) -> Part:
    """The kernel layout of `groups`; with `pad_rows`, rows padded with zeros to a whole tile (a
    head whose vocabulary is not a multiple of 16: its extra logits are cut off)."""
    if groups.source == "int4":
        # outrider's int4 groups: the torch model's w4a8 tables are fp16 (linear.py rounds them so,
        # after any scaling), and this model computes what that one does.
        groups = AffineGroups(4, groups.q, groups.d.astype(np.float16), groups.m.astype(np.float16), groups.group,
                              groups.exact, groups.source)
    if groups.bits == 5 and not five_bit_tiles():
        groups = AffineGroups(8, groups.q, groups.d, groups.m, groups.group, groups.exact, groups.source)
    extra = -groups.q.shape[0] % native_c.TILE if pad_rows else 0
    if extra:
        def pad(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros((extra, a.shape[1]), a.dtype)])

        groups = AffineGroups(groups.bits, pad(groups.q), pad(groups.d), pad(groups.m), groups.group,
                              groups.exact, groups.source)
    return Part.from_affine(groups)


class PartRows:
    """Row lookups (embeddings) dequantized as asked from a part's tiles: no second copy of the table."""

    def __init__(self, part: Part, rows: int, columns: int) -> None:
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
            return dequantize_super_rows(self.part, ids)
        tile, lane = ids // native_c.TILE, ids % native_c.TILE
        q = _tile_rows(self.part.w, self.layout, tile, lane).astype(np.float32)  # [n, columns]
        d = self.part.d[tile, :, lane].astype(np.float32)  # [n, groups]
        m = (-np.float32(self.offset) * d) if self.part.m is None else self.part.m[tile, :, lane].astype(np.float32)
        group = self.columns // d.shape[1]
        q = q.reshape(len(ids), d.shape[1], group)
        return (q * d[..., None] + m[..., None]).reshape(len(ids), self.columns)


class DenseRows:
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
    (csrc/kernels.h; the inverse of native_c_weights' packers, for those rows only)."""
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



def fused_parts(parts: list[Part]) -> Any:
    """Parts of one fused matrix (q|k|v, gate|up): one part where they share a layout and group
    (concatenated along the outputs, one kernel call), else side by side."""
    first = parts[0]
    same = all(p.bits == first.bits and p.group == first.group and p.d.dtype == first.d.dtype
               and (p.m is None) == (first.m is None) for p in parts)
    if not same or len(parts) == 1:
        return parts if len(parts) > 1 else first
    m = None if first.m is None else np.concatenate([p.m for p in parts])
    return Part(np.concatenate([p.w for p in parts]), np.concatenate([p.d for p in parts]), m,
                first.bits, first.group)


def int4_groups(w: np.ndarray, group: int) -> AffineGroups:
    """fp32 [out, in] as 4-bit affine groups: per group, w ~ q d + m with m its minimum and d its range / 15
    (weights.quantize_int4's rounding, without torch)."""
    out, inp = w.shape
    g = w.reshape(out, inp // group, group)
    low, high = g.min(axis=-1), g.max(axis=-1)
    scale = (high - low) / np.float32(15)
    scale = np.where(scale > 0, scale, np.float32(1))  # a constant group: q = 0 gives its value
    q = np.clip(np.rint((g - low[..., None]) / scale[..., None]), 0, 15).astype(np.uint8).reshape(out, inp)
    return AffineGroups(4, q, scale.astype(np.float32), low.astype(np.float32), group, False, "int4")


def parts_of(parts: Any) -> list:
    """A layer matrix's parts as a list (one `Part`, or several side by side)."""
    return parts if isinstance(parts, list) else [parts]


def _nbytes(part: Part) -> int:
    return int(part.w.nbytes + (0 if part.d is None else part.d.nbytes) + (0 if part.m is None else part.m.nbytes))


def model_fingerprint(cfg: LlamaConfig, embed: PartRows, final_norm: np.ndarray, layers: list) -> str:
    """The torch model's `fingerprint()` of the same weights (config.weights_fingerprint), so a draft
    head trained on either serves both."""
    rows = embed(np.arange(0, embed.rows, FINGERPRINT_ROW_STRIDE))
    norms = [w for layer in layers for w in (layer.attn_norm, layer.mlp_norm)]
    return weights_fingerprint(cfg, embed.rows, cfg.hidden_size, rows, final_norm, norms)



class PackedWeights(NamedTuple):
    """What `NativeLlama` computes with, in the kernels' layouts: its arguments after the config."""

    layers: LayerStack
    final_norm: np.ndarray
    head: Part
    embed: Any  # PartRows, or DenseRows
    fingerprint: str
    weight_bytes: int


def pack_weights(cfg: LlamaConfig, weights: Weights, meta: Optional[dict] = None) -> PackedWeights:
    """What the model of `weights` (`Weights`: an artifact's, or a state dict in a test) computes
    with; ValueError naming what it does not cover."""
    missing = coverage({"config": cfg.to_dict(), **(meta or {})}, weights.keys)
    if missing:
        raise ValueError(f"the torch-free CPU model does not cover this model: {missing}")
    scale = cfg.head_dim ** -0.5
    layers = []
    total = 0
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def part(name: str, factor: float = 1.0) -> Part:
            groups = weights.groups(p + name + ".weight")
            return kernel_part(groups if factor == 1.0 else scaled_groups(groups, factor))

        # 1/sqrt(head_dim) folded into q (under a q norm, into the norm's weight), as the torch model does.
        q_scale = 1.0 if cfg.qk_norm else scale
        layer = Layer(
            attn_norm=weights.get(p + "input_layernorm.weight").astype(np.float32),
            mlp_norm=weights.get(p + "post_attention_layernorm.weight").astype(np.float32),
            qkv=fused_parts([part("self_attn.q_proj", q_scale), part("self_attn.k_proj"), part("self_attn.v_proj")]),
            o=part("self_attn.o_proj"),
            gate_up=fused_parts([part("mlp.gate_proj"), part("mlp.up_proj")]),
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
    stack = LayerStack(layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
    for layer in layers:
        for parts in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += sum(_nbytes(x) for x in parts_of(parts))
    own_head = any(f"lm_head.weight.{kind}.q" in weights.keys for kind in ("affine", "int4"))  # untied, or apart
    name = "model.embed_tokens.weight"
    if f"{name}.affine.q" in weights.keys:
        embed_groups, exact = weights.groups(name), True
    else:  # a quantize: artifact's fp32 table: its tied head in int8 blocks (see `int8_blocks`)
        table = weights.get(name).astype(np.float32)
        embed_groups, exact = int8_blocks(table)
    head = kernel_part(weights.groups("lm_head.weight") if own_head else embed_groups, pad_rows=True)
    if not exact:  # lookups read the table itself, as the torch model does
        embed: Any = DenseRows(table)
    else:
        # A tied head without its own blocks is the table: lookups read rows from its tiles (one copy).
        embed = PartRows(kernel_part(embed_groups) if own_head else head, *embed_groups.shape)
    total += _nbytes(head) + (0 if embed.part is head else
                              embed.table.nbytes if embed.part is None else _nbytes(embed.part))
    del embed_groups
    final_norm = weights.get("model.norm.weight").astype(np.float32)
    return PackedWeights(stack, final_norm, head, embed, model_fingerprint(cfg, embed, final_norm, layers), total)
