"""A decoder layer's pieces and the whole layer stack on the native kernels' C library (native_c.py),
on numpy arrays, without torch.

- `rms_norm`, `swiglu`, `add`, `attend`: the pieces of a layer (`KvCaches`: the K/V they write).
- `llama_layers` / `LayerStack`: every decoder layer of a step in one call (Llama, Qwen2's qkv bias,
  Qwen3's q/k norms, Gemma's post norms and windows), each matrix 1 to 3 `Part`s side by side in
  their own block types. Build the `LayerStack` (and the `KvCaches`) once at model load: a call
  then passes them as they are.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from .native_c import (ERR_SIZE, OutriderKv, OutriderLayer, OutriderPart, address, checked_array, loaded_library,
                       raise_error)
from .native_c_weights import Part

# ---- a layer's pieces ------------------------------------------------------------------------------

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, y: Optional[np.ndarray] = None) -> np.ndarray:
    """float32 [rows, hidden] = x / sqrt(mean(x^2) + eps) * w per row (hidden a multiple of 16);
    y may be x (in place)."""
    lib = loaded_library()
    checked_array(x, np.float32, (None, None), "rms_norm: x")
    rows, hidden = x.shape
    checked_array(w, np.float32, (hidden,), "rms_norm: w")
    y = np.empty_like(x) if y is None else checked_array(y, np.float32, (rows, hidden), "rms_norm: y", writeable=True)
    err = ctypes.create_string_buffer(ERR_SIZE)
    raise_error(lib.outrider_rms_norm(address(x), address(w), eps, rows, hidden, address(y), err, ERR_SIZE), err)
    return y


def swiglu(gate_up: np.ndarray, y: Optional[np.ndarray] = None, activation: str = "silu") -> np.ndarray:
    """float32 [rows, inter] = act(gate) * up of gate_up [rows, 2 inter] = [gate | up]; act "silu"
    (SwiGLU) or "gelu_tanh" (GeGLU: GELU's tanh approximation)."""
    lib = loaded_library()
    if activation not in ACTIVATIONS:
        raise ValueError(f"swiglu: activation {activation!r}, expected one of {', '.join(ACTIVATIONS)}")
    checked_array(gate_up, np.float32, (None, None), "swiglu: gate_up")
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"swiglu: gate_up must be [rows, 2 x intermediate], got {list(gate_up.shape)}")
    inter = width // 2
    y = np.empty((rows, inter), np.float32) if y is None else checked_array(y, np.float32, (rows, inter),
                                                                            "swiglu: y", writeable=True)
    err = ctypes.create_string_buffer(ERR_SIZE)
    fn = lib.outrider_swiglu if activation == "silu" else lib.outrider_geglu
    raise_error(fn(address(gate_up), rows, inter, address(y), err, ERR_SIZE), err)
    return y


def add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x += y in place (float32, C-contiguous, the same shape); returns x."""
    checked_array(x, np.float32, x.shape if isinstance(x, np.ndarray) else (), "add: x", writeable=True)
    checked_array(y, np.float32, x.shape, "add: y")
    loaded_library().outrider_add(address(x), address(y), x.size)
    return x


def kv_head_dim(kv: np.ndarray) -> int:
    """head_dim of a layer's KV array [2, slots, KV, capacity, row]: row, or for q8_0 (int8) rows of
    head_dim + head_dim / 16 bytes, 16/17 of it."""
    return kv.shape[-1] * 16 // 17 if kv.dtype == np.int8 else kv.shape[-1]


def _kv_struct(kv: Any, num_kv_heads: Optional[int], what: str, ring: bool = False) -> OutriderKv:
    size = getattr(getattr(kv, "dtype", None), "itemsize", 0)
    q8 = isinstance(kv, np.ndarray) and kv.dtype == np.int8
    if q8 and (kv.ndim != 5 or kv.shape[4] % 34 or kv_head_dim(kv) + kv_head_dim(kv) // 16 != kv.shape[4]):
        raise ValueError(f"{what}: a q8_0 KV cache's rows must be head_dim + head_dim / 16 bytes (head_dim a "
                         f"multiple of 32), got {list(kv.shape)}")
    if not (isinstance(kv, np.ndarray) and kv.dtype in (np.float32, np.float16, np.int8) and kv.ndim == 5
            and kv.shape[0] == 2
            and (num_kv_heads is None or kv.shape[2] == num_kv_heads) and kv.flags.writeable
            and kv.strides[4] == size and kv.strides[3] == size * kv.shape[4] and all(s > 0 and s % size == 0
                                                                                    for s in kv.strides)):
        heads = "KV" if num_kv_heads is None else num_kv_heads
        raise ValueError(f"{what}: a layer's KV cache must be a writeable float32, float16 or q8_0 int8 [2, slots, "
                         f"{heads}, "
                         f"capacity, D] with rows of D contiguous, got {getattr(kv, 'dtype', type(kv).__name__)} "
                         f"{list(getattr(kv, 'shape', ()))} strides {getattr(kv, 'strides', None)}")
    return OutriderKv(kv.ctypes.data, kv.shape[1], kv.shape[3], kv.strides[0] // size, kv.strides[1] // size,
                      kv.strides[2] // size, int(kv.dtype == np.float16), int(ring), int(q8))


class KvCaches:
    """The OutriderKv table of a model's KV caches, built once: `kv` float32 [layers, 2, slots, KV,
    capacity, D] (or a sequence of per-layer [2, slots, KV, capacity, D] arrays), rows of D
    contiguous; `rings`: which layers' caches are rings (a sliding layer's: index i at row i %
    capacity). Holds them (the table points into them)."""

    def __init__(self, kv: Union[np.ndarray, Sequence[np.ndarray]], num_kv_heads: Optional[int] = None,
                 rings: Optional[Sequence[bool]] = None) -> None:
        if isinstance(kv, np.ndarray) and kv.ndim != 6:
            raise ValueError(f"KvCaches: kv must be [layers, 2, slots, KV, capacity, D], got {list(kv.shape)}")
        self.layers_kv = list(kv)
        rings = list(rings) if rings is not None else [False] * len(self.layers_kv)
        structs = [_kv_struct(layer, num_kv_heads, f"KvCaches: layer {i}", rings[i])
                   for i, layer in enumerate(self.layers_kv)]
        self.table = (OutriderKv * max(1, len(structs)))(*structs)
        self.layers = len(structs)
        self.num_kv_heads = self.layers_kv[0].shape[2] if structs else num_kv_heads
        self.dim = kv_head_dim(self.layers_kv[0]) if structs else None
        self.keep = kv


def _chunk_args(chunks: Any, visible: Any, rows: int, what: str) -> tuple[int, int, Optional[int], int]:
    """(chunks pointer, count, visible pointer, visible width), checked for dtype and layout (the C
    side checks the table's values)."""
    checked_array(chunks, np.int64, (None, 4), f"{what}: chunks")
    if visible is None:
        return chunks.ctypes.data, chunks.shape[0], None, 0
    checked_array(visible, np.bool_, (rows, None), f"{what}: visible")
    return chunks.ctypes.data, chunks.shape[0], visible.ctypes.data, visible.shape[1]


def attend(qkv: np.ndarray, kv: np.ndarray, chunks: np.ndarray, visible: Optional[np.ndarray], num_heads: int,
           num_kv_heads: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """One layer's attention for a step's chunks (as `torch.ops.outrider.attend`): qkv float32 [T,
    (H + 2 KV) D] with RoPE applied, q pre-scaled by 1/sqrt(D); kv float32 [2, slots, KV, capacity, D]
    (the chunks' K and V are written into it); chunks int64 [C, 4] (slot, first row, rows, committed
    length); visible bool [T, W] or None (causal). Returns float32 [T, H D]."""
    lib = loaded_library()
    table = _kv_struct(kv, num_kv_heads, "attend")
    dim = kv_head_dim(kv)
    checked_array(qkv, np.float32, (None, (num_heads + 2 * num_kv_heads) * dim), "attend: qkv")
    total = qkv.shape[0]
    ch, count, vis, width = _chunk_args(chunks, visible, total, "attend")
    out = np.empty((total, num_heads * dim), np.float32) if out is None else checked_array(
        out, np.float32, (total, num_heads * dim), "attend: out", writeable=True)
    err = ctypes.create_string_buffer(ERR_SIZE)
    raise_error(lib.outrider_attend(address(qkv), total, ctypes.byref(table), ch, count, vis, width, num_heads,
                                    num_kv_heads, dim, address(out), err, ERR_SIZE), err)
    return out


# ---- layers ----------------------------------------------------------------------------------------

PartsLike = Union[Part, Sequence[Part]]
#: a layer's MLP activation -> the C ABI's code (OUTRIDER_SILU, OUTRIDER_GELU_TANH)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@dataclass
class Layer:
    """One decoder layer for `LayerStack`: fp32 norm weights [hidden]; each matrix a `Part` or 1 to 3
    of them side by side (q | k | v, gate | up); Qwen2's qkv_bias [(H + 2 KV) D] and Qwen3's q_norm and
    k_norm [D] where the model has them (attention takes q pre-scaled by 1/sqrt(D): with q_norm, put
    it in q_norm's weights)."""

    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    qkv: PartsLike
    o: PartsLike
    gate_up: PartsLike
    down: PartsLike
    qkv_bias: Optional[np.ndarray] = None
    q_norm: Optional[np.ndarray] = None
    k_norm: Optional[np.ndarray] = None
    #: 0: q comes pre-scaled by 1/sqrt(D) (in its weights or q_norm's); else q is multiplied by it after
    #: the bias and q_norm (a matrix at the file's bytes, whose scales cannot take it exactly)
    q_scale: float = 0.0
    #: Gemma 2/3: RMSNorm [hidden] of the attention's and the MLP's output before each is added to x
    attn_post_norm: Optional[np.ndarray] = None
    mlp_post_norm: Optional[np.ndarray] = None
    activation: str = "silu"  # or "gelu_tanh" (GeGLU)
    rope_table: int = 0  # which of the step's RoPE tables rotates q and k (Gemma 3's sliding layers: their own)
    window: int = 0  # a sliding layer's window: a key this many positions or more before its query is not seen
    attn_softcap: float = 0.0  # Gemma 2: attention scores soft-capped to cap * tanh(score / cap)


def _parts(parts: PartsLike) -> list[Part]:
    return [parts] if isinstance(parts, Part) else list(parts)


class LayerStack:
    """A model's decoder layers as the C layer table, built and checked once (at model load): a step
    then costs one call with the table as it is. Holds every array the table points into."""

    def __init__(self, layers: Sequence[Layer], *, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float) -> None:
        if not layers:
            raise ValueError("LayerStack: no layers")
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, float(eps)
        self.hidden = int(np.asarray(layers[0].attn_norm).size)
        self.inter = sum(p.out for p in _parts(layers[0].gate_up)) // 2
        q_width, width = num_heads * head_dim, (num_heads + 2 * num_kv_heads) * head_dim
        self.layers = list(layers)
        self.table = (OutriderLayer * len(layers))()
        self._keep: list[Any] = []  # every array the table points into (even were a Layer changed later)
        inputs = {"qkv": self.hidden, "o": q_width, "gate_up": self.hidden, "down": self.inter}
        for li, layer in enumerate(self.layers):
            entry = self.table[li]
            for name in ("attn_norm", "mlp_norm"):
                array = checked_array(getattr(layer, name), np.float32, (self.hidden,), f"layer {li} {name}")
                setattr(entry, name, array.ctypes.data)
                self._keep.append(array)
            entry.q_scale = float(layer.q_scale)
            if layer.activation not in ACTIVATIONS:
                raise ValueError(f"layer {li}: activation {layer.activation!r}, expected one of "
                                 f"{', '.join(ACTIVATIONS)}")
            entry.activation = ACTIVATIONS[layer.activation]
            entry.rope_table, entry.window = int(layer.rope_table), int(layer.window)
            entry.attn_softcap = float(layer.attn_softcap)
            for name, size in (("qkv_bias", width), ("q_norm", head_dim), ("k_norm", head_dim),
                               ("attn_post_norm", self.hidden), ("mlp_post_norm", self.hidden)):
                value = getattr(layer, name)
                if value is not None:
                    setattr(entry, name, checked_array(value, np.float32, (size,), f"layer {li} {name}").ctypes.data)
                    self._keep.append(value)
            for name, inp in inputs.items():
                parts = _parts(getattr(layer, name))
                if not 1 <= len(parts) <= 3:
                    raise ValueError(f"layer {li} {name}: 1 to 3 parts, got {len(parts)}")
                matrix = getattr(entry, name)
                matrix.count = len(parts)
                for p, part in enumerate(parts):
                    if not isinstance(part, Part):
                        raise ValueError(f"layer {li} {name} part {p}: a Part, got {type(part).__name__}")
                    if part.inputs != inp:
                        raise ValueError(f"layer {li} {name} part {p}: w holds {part.inputs} inputs, expected {inp}")
                    matrix.parts[p] = OutriderPart(*part.pointers, part.out, part.group, part.bits)
                    self._keep.append(part)
        # The C checks of every part (divisibility, widths) now, at load, not at the first step: a
        # call of no rows on a stand-in cache checks the layer table and computes nothing.
        self.rope_tables = 1 + max(int(layer.rope_table) for layer in self.layers)
        self.windowed = any(int(layer.window) > 0 for layer in self.layers)
        stand_in = np.zeros((len(self.layers), 2, 1, num_kv_heads, 1, head_dim), np.float32)
        empty = np.empty((self.rope_tables, 0, head_dim), np.float32)
        self(np.empty((0, self.hidden), np.float32), empty, empty, KvCaches(stand_in, num_kv_heads),
             np.empty((0, 4), np.int64), positions=np.empty(0, np.int64))

    def __len__(self) -> int:
        return len(self.layers)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: Union[KvCaches, np.ndarray],
                 chunks: np.ndarray, visible: Optional[np.ndarray] = None,
                 positions: Optional[np.ndarray] = None, span: Optional[tuple[int, int]] = None) -> None:
        """Every layer on x float32 [rows, hidden] in place: cos and sin float32 [rows, D], or
        [rope tables, rows, D] where layers rotate by tables of their own; kv a `KvCaches` (build it
        once) or its [layers, 2, slots, KV, capacity, D] array; chunks and visible as `attend`'s, for
        every layer; positions int64 [rows], each row's position (needed where a layer has a window).
        `span` (start, stop): only layers start..stop-1 (the residual stream between them is what an
        EAGLE-3 head reads)."""
        lib = loaded_library()
        if not isinstance(kv, KvCaches):
            kv = KvCaches(kv, self.num_kv_heads)
        if kv.layers != len(self.layers) or kv.dim != self.head_dim or kv.num_kv_heads != self.num_kv_heads:
            raise ValueError(f"llama_layers: {len(self.layers)} layers of {self.num_kv_heads} KV heads of "
                             f"{self.head_dim} need as many KV caches of those, got {kv.layers} of "
                             f"{kv.num_kv_heads} x {kv.dim}")
        checked_array(x, np.float32, (None, self.hidden), "llama_layers: x", writeable=True)
        rows = x.shape[0]
        tables = (self.rope_tables, rows, self.head_dim) if cos.ndim == 3 or self.rope_tables > 1 else \
            (rows, self.head_dim)
        checked_array(cos, np.float32, tables, "llama_layers: cos")
        checked_array(sin, np.float32, tables, "llama_layers: sin")
        pos = 0
        if positions is not None:
            pos = checked_array(positions, np.int64, (rows,), "llama_layers: positions").ctypes.data
        elif self.windowed and rows:
            raise ValueError("llama_layers: a layer with a sliding window needs the rows' positions")
        ch, count, vis, width = _chunk_args(chunks, visible, rows, "llama_layers")
        start, stop = (0, len(self.layers)) if span is None else (int(span[0]), int(span[1]))
        if not 0 <= start <= stop <= len(self.layers):
            raise ValueError(f"llama_layers: layers {start}..{stop - 1} of {len(self.layers)}")
        kv_table = ctypes.addressof(kv.table) + start * ctypes.sizeof(OutriderKv)
        layer_table = ctypes.addressof(self.table) + start * ctypes.sizeof(OutriderLayer)
        err = ctypes.create_string_buffer(ERR_SIZE)
        raise_error(lib.outrider_llama_layers(x.ctypes.data, rows, self.hidden, cos.ctypes.data, sin.ctypes.data,
                                              self.rope_tables, pos, kv_table, layer_table, stop - start, ch, count,
                                              vis, width, self.num_heads, self.num_kv_heads, self.head_dim, self.inter,
                                              self.eps, err, ERR_SIZE),
                    err)


def llama_layers(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: Union[KvCaches, np.ndarray],
                 layers: Union[LayerStack, Sequence[Layer]], chunks: np.ndarray, visible: Optional[np.ndarray] = None,
                 *, num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 eps: Optional[float] = None, positions: Optional[np.ndarray] = None) -> None:
    """Every decoder layer of a step on x in place (`LayerStack.__call__`). `layers` a `LayerStack`
    (built once: the fast way), or `Layer`s with num_heads, num_kv_heads and eps (a stack is built
    for this call; head_dim is kv's D)."""
    if not isinstance(layers, LayerStack):
        if num_heads is None or num_kv_heads is None or eps is None:
            raise ValueError("llama_layers: Layers need num_heads, num_kv_heads and eps (or pass a LayerStack)")
        dim = kv.dim if isinstance(kv, KvCaches) else kv_head_dim(np.asarray(kv))
        layers = LayerStack(layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=dim, eps=eps)
    elif any(given is not None and given != have for given, have in
             ((num_heads, layers.num_heads), (num_kv_heads, layers.num_kv_heads), (eps, layers.eps))):
        raise ValueError("llama_layers: num_heads, num_kv_heads and eps differ from the LayerStack's")
    layers(x, cos, sin, kv, chunks, visible, positions)

