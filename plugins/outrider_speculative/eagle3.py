"""EAGLE-3 draft heads as SafeAILab/EAGLE and SpecForge publish them ("eagle3").

    speculative:
      drafters: [eagle3]
      eagle3: {path: EAGLE3-LLaMA3.1-Instruct-8B}   # a folder: config.json + *.safetensors

What such a head is (EAGLE-3, Li et al. 2025; SafeAILab/EAGLE `cnets.py`, vLLM `llama_eagle3.py`,
read for the layout, written here on numpy): one Llama decoder layer that runs beside the target.
At every position t of the sequence its input is the target's features there, the residual stream
entering three of the target's layers (low, middle, high: by default layers 2, n/2 and n-3, or the
config's `eagle_config.eagle_aux_hidden_state_layer_ids`), side by side and mapped by `fc` to the
head's width, and the embedding of the token at t + 1; its own attention keeps a KV cache over the
sequence. The layer's output, through `norm` and `lm_head` (a reduced draft vocabulary; `d2t`
maps draft id i to target id i + d2t[i]), scores the token at t + 2. Deeper draft levels feed the
layer's own output back in place of the target's features (no `fc`), at the next position, so a
draft tree costs one row of the layer per node. Inside the layer: `hidden_norm` on the features,
`input_layernorm` on the embedding, [embedding, features] concatenated into q/k/v (2 x hidden
inputs), the residual the features (or their norm, with `norm_before_residual`), then the usual
post-attention norm and SiLU MLP.

The target gives its features through `CausalLM.capture_hidden(layers)` (each forward then returns
`aux_hidden`, and the engine hands each step's committed rows to the drafter as
`seq.new_features`); on the llm backend's native CPU runtime the layer stack then runs in pieces
between those layers. Committed rows enter the head's cache as they arrive (buffered, at most
`flush_rows` at a time when drafting rests), so the drafts attend to the whole sequence; tree
nodes are tentative rows, each attending to the committed ones and its ancestors.

The files (eagle3_files.py reads them): a folder with `config.json` (hidden_size,
num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps, rope_theta, rope_scaling,
vocab_size, draft_vocab_size, optionally head_dim, target_hidden_size, norm_before_residual,
eagle_config) and safetensors
weights (F32, F16 or BF16): `fc.weight`, `midlayer.*` (or `layers.0.*` / `model.layers.0.*`),
`norm.weight`, `lm_head.weight`, `d2t` (absent: the draft vocabulary is the target's), optionally
`embed_tokens.weight` (else the target's embeddings, which such heads are trained with).
Checkpoints saved with pickle (`pytorch_model.bin`) are refused: convert them to safetensors.
Drafting rules (best-first tree, top-k at T = 0, children drawn from q at T > 0 and verified with
min(1, p/q)) are draft_head.HeadDrafter's.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from typing import Any, Hashable, Mapping, Optional

import numpy as np

from outrider.generation.contract import DrafterContext
from outrider.generation.sampling import host_array

from .config import OptionError, path_drafter_options, read_bool, read_float, read_int
from .draft_head import HeadDrafter, rms_norm
from .drafters import sequence_key
from .eagle3_files import read_head
from .tree import SpecTree

log = logging.getLogger("outrider.speculative")

OPTIONS = ("path", "max_depth", "max_children", "prob_threshold", "frontier", "sample", "quantize", "max_sequences",
           "layers")
_ATTENTION_ROWS = 128  # committed rows fed per pass (their scores matrix stays small)
_ROOT = ("root",)  # the state of the tree's root in `_run`: the last committed row's output


def inverse_frequencies(config: Mapping[str, Any], head_dim: int) -> np.ndarray:
    """RoPE's inverse frequencies (transformers' rules for default, linear and llama3 scaling)."""
    theta = float(config.get("rope_theta", 10000.0))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv
        smooth = (old / wavelength - low) / (high - low)
        scaled = np.where(wavelength > old / low, inv / factor, inv)
        middle = (wavelength <= old / low) & (wavelength >= old / high)
        inv = np.where(middle, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif kind != "default":
        raise ValueError(f"rope_scaling type {kind!r} (supported: default, linear, llama3)")
    return inv.astype(np.float32)


# ---- the layer ----------------------------------------------------------------------------------------


class Eagle3Layer:
    """The head's decoder layer, norm and LM head in fp32 numpy, its matmuls the target's (`make_linear`)."""

    def __init__(self, config: Mapping[str, Any], tensors: dict[str, np.ndarray], model: Any,
                 quantize: Optional[str]) -> None:
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.inter = int(config["intermediate_size"])
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.inv_freq = inverse_frequencies(config, self.head_dim)
        self.fc_inputs = int(tensors["fc.weight"].shape[1])  # the target's captured layers side by side
        extra = {"quantize": quantize} if quantize else {}

        def linear(*names: str) -> Any:
            weight = np.concatenate([tensors[n].astype(np.float32) for n in names])
            return model.make_linear(np.ascontiguousarray(weight), **extra)

        m = "midlayer."
        self.fc = linear("fc.weight")
        self.qkv = linear(m + "self_attn.q_proj.weight", m + "self_attn.k_proj.weight", m + "self_attn.v_proj.weight")
        self.o = linear(m + "self_attn.o_proj.weight")
        self.gate_up = linear(m + "mlp.gate_proj.weight", m + "mlp.up_proj.weight")
        self.down = linear(m + "mlp.down_proj.weight")
        self.lm = linear("lm_head.weight")
        self.input_norm = tensors[m + "input_layernorm.weight"].astype(np.float32)
        self.hidden_norm = tensors[m + "hidden_norm.weight"].astype(np.float32)
        self.post_norm = tensors[m + "post_attention_layernorm.weight"].astype(np.float32)
        self.norm = tensors["norm.weight"].astype(np.float32)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x [n, heads, D] rotated NEOX-style (halves), as transformers' rotate_half."""
        angles = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        half = self.head_dim // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def project(self, features: np.ndarray, embeds: np.ndarray, positions: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(residual [n, H], q [n, heads, D] pre-scaled, k and v [n, KV, D]) of n rows."""
        normed = rms_norm(features, self.hidden_norm, self.eps)
        residual = normed if self.norm_before_residual else features
        x = np.concatenate([rms_norm(embeds, self.input_norm, self.eps), normed], axis=-1)
        qkv = self.qkv(np.ascontiguousarray(x, dtype=np.float32))
        n, d = x.shape[0], self.head_dim
        q = qkv[:, :self.heads * d].reshape(n, self.heads, d)
        k = qkv[:, self.heads * d:(self.heads + self.kv_heads) * d].reshape(n, self.kv_heads, d)
        v = qkv[:, (self.heads + self.kv_heads) * d:].reshape(n, self.kv_heads, d)
        q = self._rope(q, positions) * np.float32(d ** -0.5)
        return residual, q, self._rope(k, positions), v

    def attend(self, q: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray]],
               mask: Optional[np.ndarray] = None) -> np.ndarray:
        """q [n, heads, D] over the keys/values [KV, T_i, D] of `parts` taken as one sequence, in order,
        without joining them (a tree row reads the committed cache where it lies); mask bool [n, sum T_i]
        (None: all) -> [n, heads x D]."""
        n, group = q.shape[0], self.heads // self.kv_heads
        qg = q.reshape(n, self.kv_heads, group, self.head_dim)
        scores = np.concatenate([np.einsum("nkgd,ktd->nkgt", qg, keys) for keys, _ in parts], axis=-1)
        if mask is not None:
            scores = np.where(mask[:, None, None, :], scores, np.float32(-np.inf))
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        out, start = 0.0, 0
        for keys, values in parts:
            out = out + np.einsum("nkgt,ktd->nkgd", scores[..., start:start + keys.shape[1]], values)
            start += keys.shape[1]
        return out.reshape(n, self.heads * self.head_dim)

    def finish(self, residual: np.ndarray, attention: np.ndarray) -> np.ndarray:
        """The layer's output [n, H] (what deeper levels take as their features)."""
        h = residual + self.o(np.ascontiguousarray(attention, dtype=np.float32))
        g = self.gate_up(np.ascontiguousarray(rms_norm(h, self.post_norm, self.eps), dtype=np.float32))
        gate = g[:, :self.inter]
        return h + self.down(np.ascontiguousarray(gate / (1 + np.exp(-gate)) * g[:, self.inter:], dtype=np.float32))

    def logits(self, out: np.ndarray) -> np.ndarray:
        """Draft-vocabulary logits [n, Vd] of layer outputs."""
        return host_array(self.lm(np.ascontiguousarray(rms_norm(out, self.norm, self.eps), dtype=np.float32)))


# ---- the drafter --------------------------------------------------------------------------------------


class _Cache:
    """One sequence's committed rows in the head's attention: K/V [KV, capacity, D] (positions may
    have gaps where the target's features never came, e.g. a prompt prefix from the prefix cache),
    features waiting to be fed, and the last row's output (the tree's root)."""

    def __init__(self, kv_heads: int, head_dim: int) -> None:
        self.k = np.empty((kv_heads, 64, head_dim), np.float32)
        self.v = np.empty_like(self.k)
        self.rows = 0
        self.next_position = 0  # positions below this were fed (or skipped)
        self.waiting: list[tuple[int, np.ndarray]] = []  # (first position, features [n, k x H])
        self.root: Optional[tuple[int, np.ndarray, np.ndarray]] = None  # (position, output [H], logits [Vd])

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Rows k, v [n, KV, D] after the committed ones."""
        n = k.shape[0]
        if self.rows + n > self.k.shape[1]:
            capacity = max(2 * self.k.shape[1], self.rows + n)
            for name in ("k", "v"):
                grown = np.empty((self.k.shape[0], capacity, self.k.shape[2]), np.float32)
                grown[:, :self.rows] = getattr(self, name)[:, :self.rows]
                setattr(self, name, grown)
        self.k[:, self.rows:self.rows + n] = k.transpose(1, 0, 2)
        self.v[:, self.rows:self.rows + n] = v.transpose(1, 0, 2)
        self.rows += n


class Eagle3Drafter(HeadDrafter):
    """Drafts with an EAGLE-3 head over the target's captured features (see the module docstring)."""

    name = "eagle3"

    def __init__(self, model: Any, layer: Eagle3Layer, draft_ids: np.ndarray, embed: Any, max_depth: int = 8,
                 max_children: int = 4, prob_threshold: float = 0.05, frontier: int = 8, sample: bool = True,
                 max_sequences: int = 64, flush_rows: int = 64) -> None:
        super().__init__(model, draft_ids, max_depth, max_children, prob_threshold, frontier, sample)
        self.layer = layer
        self.embed = embed  # token ids -> fp32 [n, H] (the target's embeddings, or the head's own table)
        self.max_sequences = max_sequences
        self.flush_rows = flush_rows
        self._caches: OrderedDict[Hashable, _Cache] = OrderedDict()
        self._tentative: list[tuple[np.ndarray, np.ndarray]] = []  # this proposal's tree rows' (k, v) [KV, D]
        self._current: Optional[_Cache] = None

    # -- per-sequence state -----------------------------------------------------------------

    def _cache(self, key: Optional[Hashable]) -> _Cache:
        cache = self._caches.get(key) if key is not None else None
        if cache is None:
            cache = _Cache(self.layer.kv_heads, self.layer.head_dim)
            if key is not None:
                self._caches[key] = cache
                while len(self._caches) > self.max_sequences:  # the least recently used starts over
                    self._caches.popitem(last=False)
        elif key is not None:
            self._caches.move_to_end(key)
        return cache

    def start(self, seq: Any) -> None:
        with self._lock:
            self._cache(sequence_key(seq))

    def observe(self, seq: Any, outcome: Any = None) -> None:
        """Take the target's features of the rows the step committed; feed them once enough wait."""
        features = seq.new_features
        if features is None or len(features) == 0:
            return
        features = host_array(features)
        committed = len(seq.token_ids) - 1  # the pending token is not committed
        with self._lock:
            cache = self._cache(sequence_key(seq))
            cache.waiting.append((committed - features.shape[0], np.array(features, dtype=np.float32)))
            if sum(f.shape[0] for _, f in cache.waiting) >= self.flush_rows:
                self._feed(cache, seq.token_ids)

    def finish(self, seq: Any) -> None:
        key = sequence_key(seq)
        with self._lock:
            self._caches.pop(key, None)

    def _feed(self, cache: _Cache, token_ids: list[int]) -> None:
        """Run the waiting committed rows through the layer into the cache; keep the last one's output."""
        layer = self.layer
        last: Optional[tuple[int, np.ndarray]] = None  # (position, output) of the last row fed
        for first, features in cache.waiting:
            skip = max(0, cache.next_position - first)  # rows fed before (never expected; harmless)
            features = features[skip:]
            first += skip
            for start in range(0, features.shape[0], _ATTENTION_ROWS):
                chunk = features[start:start + _ATTENTION_ROWS]
                n = chunk.shape[0]
                positions = np.arange(first + start, first + start + n)
                # Row t reads the token at t + 1 (the pending token for the last committed row).
                embeds = self.embed(np.asarray([token_ids[p + 1] for p in positions], dtype=np.int64))
                residual, q, k, v = layer.project(layer.fc(np.ascontiguousarray(chunk)), embeds, positions)
                before = cache.rows
                cache.append(k, v)
                mask = np.ones((n, cache.rows), dtype=bool)
                mask[:, before:] = np.tril(np.ones((n, n), dtype=bool))
                committed = (cache.k[:, :cache.rows], cache.v[:, :cache.rows])
                out = layer.finish(residual, layer.attend(q, [committed], mask))
                last = (int(positions[-1]), out[-1])
            cache.next_position = first + features.shape[0]
        cache.waiting.clear()
        if last is not None:  # the LM head once, for the row the tree grows from
            cache.root = (last[0], last[1], layer.logits(last[1][None])[0])

    # -- drafting -----------------------------------------------------------------------------

    def propose(self, view: Any, budget: int) -> SpecTree:
        """A best-first tree from the head's output at the last committed position."""
        if budget <= 0 or len(view.token_ids) < 2:
            return SpecTree()
        with self._lock:
            cache = self._cache(sequence_key(view))
            if cache.waiting:
                self._feed(cache, view.token_ids)
            if cache.root is None or cache.root[0] != len(view.token_ids) - 2:
                return SpecTree()  # the target's features of the last committed row never came
            self._current, self._tentative = cache, []
            try:
                return self._grow(view, budget, _ROOT)
            finally:
                self._current, self._tentative = None, []

    def _run(self, states: list, tokens: list[int]) -> tuple[list, np.ndarray]:
        """(children's states, draft logits) of tree nodes: a state is (features [H], ancestors' tentative
        rows, position of the node's row), or _ROOT, whose logits the committed rows already gave."""
        cache = self._current
        if states[0] is _ROOT:
            position, out, logits = cache.root
            return [(out, (), position + 1)], logits[None, :]
        layer = self.layer
        features = np.stack([s[0] for s in states])
        positions = np.array([s[2] for s in states], dtype=np.int64)
        residual, q, k, v = layer.project(features, self.embed(np.asarray(tokens, dtype=np.int64)), positions)
        committed_k, committed_v = cache.k[:, :cache.rows], cache.v[:, :cache.rows]
        rows, children = [], []
        for i, (_, ancestors, position) in enumerate(states):
            self._tentative.append((k[i], v[i]))
            own = ancestors + (len(self._tentative) - 1,)
            path = (np.stack([self._tentative[j][0] for j in own], axis=1),
                    np.stack([self._tentative[j][1] for j in own], axis=1))
            rows.append(layer.attend(q[i:i + 1], [(committed_k, committed_v), path])[0])
            children.append(own)
        out = layer.finish(residual, np.stack(rows))
        return [(out[i], children[i], int(positions[i]) + 1) for i in range(len(states))], layer.logits(out)

    def warmup(self) -> None:
        """One committed row and one tree row through the layer, so the first request pays no setup."""
        layer, width = self.layer, self.layer.fc_inputs
        cache = self._cache(None)
        cache.waiting.append((0, np.zeros((2, width), np.float32)))
        self._feed(cache, [0, 0, 0])
        self._current = cache
        try:
            self._run([(np.zeros(layer.hidden, np.float32), (), 2)], [0])
        finally:
            self._current, self._tentative = None, []


def make_eagle3_drafter(model: Any, options: Optional[Mapping[str, Any]] = None,
                        context: Optional[DrafterContext] = None) -> Eagle3Drafter:
    """Drafter factory ("eagle3"): the head at `options.path`, checked against the target's shape."""
    options, path = path_drafter_options(options, OPTIONS, "eagle3",
                                         "the folder of an EAGLE-3 head (config.json + .safetensors)")
    context = context or DrafterContext()
    # capture_hidden and num_layers are optional in CausalLM: probing is how a model without them is told.
    capture = getattr(model, "capture_hidden", None)
    layers_total = int(getattr(model, "num_layers", 0) or 0)
    if capture is None or not layers_total or model.array_api != "numpy":
        raise OptionError("path", f"this target ({type(model).__name__}) cannot give the hidden states of its layers "
                                  f"that an EAGLE-3 head reads: it runs on the llm backend's native CPU runtime")
    resolved = context.resolve(path)
    if not resolved.exists():
        raise OptionError("path", f"EAGLE-3 head {str(resolved)!r} does not exist")
    quantize = options.get("quantize", "none")
    if quantize not in ("none", "int4"):
        raise OptionError("quantize", f"expected 'none' or 'int4' (got {quantize!r})")
    try:
        config, tensors = read_head(resolved)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as exc:
        raise OptionError("path", f"EAGLE-3 head {str(resolved)!r} cannot be read: {exc}") from None
    layers = _read_layers(options, config, layers_total)
    try:
        layer, draft_ids, embed = _check(config, tensors, model, len(layers), quantize)
    except (ValueError, KeyError) as exc:
        raise OptionError("path", f"EAGLE-3 head {str(resolved)!r} does not fit this target: {exc}") from None
    capture(layers)
    drafter = Eagle3Drafter(model, layer, draft_ids, embed,
                            max_depth=read_int(options, "max_depth", 8, 1, 64),
                            max_children=read_int(options, "max_children", 4, 1, 64),
                            prob_threshold=read_float(options, "prob_threshold", 0.05, 0.0, 1.0),
                            frontier=read_int(options, "frontier", 8, 1, 256),
                            sample=read_bool(options, "sample", True),
                            max_sequences=read_int(options, "max_sequences", 64, 1, 4096))
    drafter.warmup()
    log.info("EAGLE-3 head %s: draft vocabulary %d, target layers %s", resolved, len(draft_ids), list(layers))
    return drafter


def _read_layers(options: Mapping[str, Any], config: Mapping[str, Any], total: int) -> tuple[int, ...]:
    """The target layers whose entering residual stream the head reads (ascending)."""
    given = options.get("layers")
    if given is None:
        given = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if given is None:
        given = (2, total // 2, total - 3)
    if not isinstance(given, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in given):
        raise OptionError("layers", f"expected a list of layer numbers, got {given!r}")
    layers = tuple(given)
    if not layers or list(layers) != sorted(layers) or not all(0 <= i < total for i in layers):
        raise OptionError("layers", f"layers {list(layers)}: expected ascending numbers in 0..{total - 1} (the target "
                                    f"has {total} layers)")
    return layers


def _check(config: Mapping[str, Any], tensors: dict[str, np.ndarray], model: Any, captured: int,
           quantize: str) -> tuple[Eagle3Layer, np.ndarray, Any]:
    """(layer, draft ids in the target's vocabulary, embedding lookup); ValueError naming what does not fit."""
    hidden = int(config["hidden_size"])
    required = ["fc.weight", "norm.weight", "lm_head.weight"] + [
        "midlayer." + n for n in ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight")]
    missing = [n for n in required if n not in tensors]
    if missing:
        raise ValueError(f"tensors {missing} missing (has {sorted(tensors)[:12]}...)")
    target_hidden = int(model.hidden_size)
    fc = tensors["fc.weight"]
    if fc.shape != (hidden, captured * target_hidden):
        raise ValueError(f"fc.weight is {list(fc.shape)}; {captured} captured layers of this target's width "
                         f"{target_hidden} need [{hidden}, {captured * target_hidden}]")
    q = tensors["midlayer.self_attn.q_proj.weight"]
    if q.shape[1] != 2 * hidden:
        raise ValueError(f"midlayer.self_attn.q_proj.weight is {list(q.shape)}: expected {2 * hidden} inputs "
                         f"(the embedding and the features)")
    lm = tensors["lm_head.weight"]
    draft_vocab = lm.shape[0]
    d2t = tensors.get("d2t")
    offsets = np.zeros(draft_vocab, np.int64) if d2t is None else d2t.astype(np.int64).reshape(-1)
    if offsets.size != draft_vocab:
        raise ValueError(f"d2t has {offsets.size} entries for a draft vocabulary of {draft_vocab}")
    draft_ids = np.arange(draft_vocab, dtype=np.int64) + offsets
    vocab = int(model.vocab_size)
    if draft_ids.min() < 0 or draft_ids.max() >= vocab or np.unique(draft_ids).size != draft_vocab:
        raise ValueError(f"its draft vocabulary maps to ids outside 0..{vocab - 1} or twice onto one id "
                         f"(config vocab_size {config.get('vocab_size')}, the target's {vocab})")
    embed_table = tensors.get("embed_tokens.weight")
    if embed_table is not None and embed_table.shape[1] == hidden and hidden != target_hidden:
        table = embed_table.astype(np.float32)
        if table.shape[0] < vocab:
            raise ValueError(f"embed_tokens.weight has {table.shape[0]} rows for a vocabulary of {vocab}")
        embed: Any = lambda ids: table[ids]  # noqa: E731
    elif hidden == target_hidden:
        embed = lambda ids: np.asarray(model.embed(ids), dtype=np.float32)  # noqa: E731
    else:
        raise ValueError(f"the head is {hidden} wide and the target {target_hidden}: it needs its own "
                         f"embed_tokens.weight [{vocab}, {hidden}]")
    layer = Eagle3Layer(config, tensors, model, None if quantize == "none" else quantize)
    if layer.heads % layer.kv_heads or q.shape[0] != layer.heads * layer.head_dim:
        raise ValueError(f"q_proj is {list(q.shape)} for {layer.heads} heads of {layer.head_dim} "
                         f"({layer.kv_heads} KV heads)")
    return layer, draft_ids, embed
