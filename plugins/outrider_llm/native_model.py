"""A Llama-family decoder on outrider's native CPU kernels through their C ABI, without torch.

What it is for: serving a quantized GGUF on a CPU in a process that never imports torch. torch's
import alone holds 220-260 MB and takes 1-2 s; this model's process holds the weights (the file's
own blocks, as the torch model holds them), numpy, tokenizers and the core.

What it runs: every decoder layer of a step is one call of `outrider_llama_layers` (csrc/c_api.cpp:
RMSNorm, int8 activations, each matrix in its own block type (parts side by side where a file mixes
them), Qwen2's q/k/v biases, Qwen3's q/k norms, RoPE, attention over exactly the keys each row may
see, SwiGLU), then the final norm and the LM head on the same kernels. Sampling and speculation are
the engine's (numpy), so a draft tree's rows get exactly a one-token step's logits here too.

What it covers (`native_model_weights.coverage`): the llama (Llama, Mistral, SmolLM2), qwen2,
qwen3 and phi3 architectures as loading.py converts them, with every layer matrix in a native block type (the
quantized GGUF types; see gguf_blocks.py), and a `quantize:` artifact of int4 groups (mode int4, as
outrider_quantize writes it for kernel w4a8: a Q4_1 file's own blocks), whose tied head is the fp32
embedding table in blocks of 32 int8 values (exactly a Q8_0 table, where it is one; the torch
model's w4a8 head) or its own int4 groups. A float matrix (an F16/F32 file, or a dense tensor), an
untied head without blocks, an int8 per-channel head or another quantize: mode is not covered: the
llm backend serves those with the torch model and says why. A draft head reads it through `make_linear` (numpy in, numpy
out: `array_api = "numpy"`), as outrider_speculative/draft_head.py does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from outrider.generation.contract import Chunk, ForwardOutput

from . import native_c
from .artifact import (BLOCKS_FORMAT, META_FILE, TILES_FILE, TILES_INDEX, TOKENIZER_FILE, WEIGHTS_FILE, artifact_dir,
                       artifact_tokenizer, read_artifact_meta)
from .config import LlamaConfig, local_rope_config, rope_tables
from .heap import tune_malloc
from .kv_cache import NumpySlotKVCache, RingSlotKVCache
from .native_c_layers import KvCaches, LayerStack, rms_norm
from .native_c_weights import Part
from .native_model_tiles import TILES_FORMAT, TILES_KIND, read_tiles, save_tiles
from .native_model_weights import (PartRows, Weights, coverage, five_bit_tiles, int4_groups, kernel_part,
                                   model_fingerprint, pack_weights, weight_names)

log = logging.getLogger("outrider.llm")

ROPE_ROWS_AT_START = 2048  # positions the RoPE tables hold before a longer sequence grows them
#: rows a chunk may feed a sliding layer's ring in one pass (a longer prefill goes in passes): the
#: ring holds the window and this many rows, as llama.cpp's ubatch of 512
STEP_ROWS = 512


class NativeLlama:
    """`outrider.generation.contract.CausalLM` on the native kernels' C ABI (see the module docstring)."""

    dtype = "float32"  # what its activations and K/V are; its matrices are the file's blocks
    device = "cpu"
    array_api = "numpy"  # what it takes and returns (drafters pick their implementation by it)

    def __init__(self, config: LlamaConfig, layers: LayerStack, final_norm: np.ndarray,
                 head: Part, embed: PartRows, fingerprint: str, weight_bytes: int) -> None:
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
        return cls(cfg, *pack_weights(cfg, weights, meta))

    @classmethod
    def from_tiles(cls, directory: Path) -> "NativeLlama":
        """The model of a tiles artifact, its arrays read-only views of the mapped file."""
        cfg, packed = read_tiles(directory)
        return cls(cfg, *packed)

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

    def _run_layers(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: KvCaches,
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

    @property
    def max_length(self) -> int:
        """The longest context its positions are made for (the file's context length)."""
        return int(self.config.max_position_embeddings or 8192)

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
        return PartRows(self.head, self.vocab_size, self.hidden_size)(np.asarray(tokens, dtype=np.int64).reshape(-1))

    def make_linear(self, weight: Any, dtype: Any = None, quantize: Optional[str] = None) -> Any:
        """y = x @ W.T for fp32 numpy x [n, in] (a draft head's matmuls): with quantize="int4", W in
        4-bit groups of 32 (min/max per group, as weights.quantize_int4) on the native kernels, where
        the shape takes tiles of 16 outputs (rows padded) and groups of 32 inputs; else fp32 (numpy)."""
        w = np.ascontiguousarray(np.asarray(weight, dtype=np.float32))
        out, inp = w.shape
        if quantize == "int4" and inp % 32 == 0:
            part = kernel_part(int4_groups(w, 32), pad_rows=True)
            if out == part.out:
                return part.matmul
            return lambda x: np.ascontiguousarray(part.matmul(np.ascontiguousarray(x, dtype=np.float32))[:, :out])
        transposed = np.ascontiguousarray(w.T)
        return lambda x: np.asarray(x, dtype=np.float32) @ transposed

    def fingerprint(self) -> str:
        """Identifies the weights: the torch model's fingerprint of the same file (config.weights_fingerprint);
        computed from the mapped rows on first use where the packed file does not record it."""
        if not self._fingerprint:
            self._fingerprint = model_fingerprint(self.config, self.embed_rows, self.final_norm, self.layers.layers)
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
        hidden = rms_norm(x, self.final_norm, self.config.rms_norm_eps)
        for slot, _, n, *_ in table:
            cache._fed[slot] = n
        rows = hidden if logit_rows is None else np.ascontiguousarray(hidden[np.asarray(logit_rows, dtype=np.int64)])
        return ForwardOutput(logits=self.lm_head(rows), hidden=hidden, aux_hidden=aux)


    def _kv_table(self, cache: NumpySlotKVCache) -> KvCaches:
        """The native KV table of `cache`, rebuilt when its arrays moved (it grew)."""
        kv = cache.native_table
        if isinstance(cache, RingSlotKVCache):
            if kv is None or kv.keep[0] is not cache.kv or kv.keep[1] is not cache.ring:
                arrays, rings = cache.layer_caches()
                kv = cache.native_table = KvCaches(arrays, self.config.num_kv_heads, rings)
                kv.keep = (cache.kv, cache.ring, arrays)
        elif kv is None or kv.keep is not cache.kv:
            kv = cache.native_table = KvCaches(cache.kv, self.config.num_kv_heads)
        return kv

    def _in_passes(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: KvCaches, table: list,
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



def _rows_of(head: Part, config: LlamaConfig) -> int:
    """The vocabulary of an untied head (its tiles may be padded to 16 rows)."""
    return min(head.out, config.vocab_size) if config.vocab_size else head.out


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
        model, tokenizer = NativeLlama.from_tiles(source), artifact_tokenizer(source)
        from .heap import release_free_memory

        # Parsing a large vocabulary's tokenizer.json frees most of what it took (Gemma's 262k tokens
        # and 515k merges: 290 of 390 MB), which tune_malloc keeps: hand it back now, before the first
        # forward maps the weights in, or both count in the process's peak.
        release_free_memory()
        return model, tokenizer
    cache = cache or ArtifactCache()

    def build(directory: Path, progress: Any) -> dict:
        from .heap import release_free_memory

        model, _ = NativeLlama.from_artifact(source)
        save_tiles(model, directory)
        for name in (TOKENIZER_FILE, META_FILE):
            (directory / name).write_bytes((source / name).read_bytes())
        del model
        release_free_memory()  # the packing's temporaries
        return {"weight_bytes": (directory / TILES_FILE).stat().st_size}

    # The source's meta is checked first: an artifact the model does not cover fails before a build.
    missing = coverage(read_artifact_meta(source), weight_names(source))
    if missing:
        raise ValueError(f"the torch-free CPU model does not cover this model: {missing}")
    artifact = cache.get_or_build(
        TILES_KIND, build, label=f"{source.name} -> native tiles", sources=[source / WEIGHTS_FILE],
        options={"format": TILES_FORMAT, "blocks": BLOCKS_FORMAT, "five_bit_tiles": five_bit_tiles()},
    )
    return NativeLlama.from_tiles(Path(artifact.path)), artifact_tokenizer(artifact)

