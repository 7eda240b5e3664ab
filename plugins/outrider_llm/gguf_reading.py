"""A GGUF's metadata read as the llm backend's model shape, without torch: the config of a file's
architecture, the names its tensors map to, and the row orders llama.cpp writes. Shared by the
conversion into an artifact (loading.py, with torch) and the torch-free packing of a file's blocks
straight into the native model's tiles (gguf_tiles.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from .artifact import GGUFError
from .config import LlamaConfig


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    if hasattr(field, "contents"):
        return field.contents()
    value = field.parts[field.data[0]]  # older gguf: raw parts
    return bytes(value).decode("utf-8") if value.dtype.name == "uint8" else value.tolist()[0]


# GGUF tensor name (after "blk.N.") -> Hugging Face Llama name (after "model.layers.N.").
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Architectures served, and what the others would need (the error names it).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# Served by the torch-free native model alone (from the file's blocks, gguf_tiles.py): the torch
# model and the artifact conversion do not have their layer body.
NATIVE_ONLY = ("gemma2", "gemma3")
# Gemma 2 and 3's layer pieces (GGUF names after "blk.N."): the two norms after attention and the MLP.
GEMMA_POST_NORMS = ("post_attention_norm", "post_ffw_norm")
# Gemma 3: every sixth layer attends globally (llama.cpp's set_swa_pattern(6)) and the sliding ones
# rotate by RoPE base 10,000, neither stored in the file.
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# llama.cpp writes Q/K rows of these interleaved for its RoPE (qwen2/qwen3 use NEOX order: as is).
PERMUTED_QK_ARCHS = ("llama",)
UNSUPPORTED_ARCHS = {
    "gemma": "Gemma 1's layer (Gemma 2's without the post norms), which is not wired up",
    "qwen2moe": "mixture-of-experts layers", "qwen3moe": "mixture-of-experts layers",
    "mistral3": "its vision tower and Mistral 3's RoPE scaling",
}


def config_from_gguf(reader: Any, path: Path) -> LlamaConfig:
    """The decoder's shape, from the metadata keys of the file's architecture."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        need = UNSUPPORTED_ARCHS.get(arch, "a layer body the llm backend does not have")
        raise GGUFError(f"{path}: architecture {arch!r} is not supported: the llm backend runs "
                        f"{', '.join(ARCHITECTURES)} (llama: Llama, Mistral and SmolLM2, which llama.cpp writes as "
                        f"llama); {arch} needs {need}")

    def key(name: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{name}", default)

    experts = key("expert_count")
    if experts:
        raise GGUFError(f"{path}: a mixture of experts ({arch}.expert_count = {experts}, e.g. Mixtral) is not "
                        f"supported: the llm backend runs dense layers")
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    scaling = key("rope.scaling.type", "none")
    factor = float(key("rope.scaling.factor", 1.0) or 1.0)
    if scaling not in ("none", "linear") and not (scaling == "yarn" and factor == 1.0):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported: the llm "
                         f"backend runs none, linear, and Llama 3's rope_freqs")
    window = key("attention.sliding_window")
    window = int(window) if window and int(window) < int(key("context_length", 2048)) else None
    layers = int(key("block_count"))
    gemma: dict[str, Any] = {}
    if arch in ("gemma2", "gemma3"):
        gemma = dict(post_norms=True, activation="gelu_tanh", embed_scale=float(np.sqrt(np.float32(hidden))),
                     swa_window=window)
        if arch == "gemma3":  # every sixth layer global; the others slide and rotate by their own base
            pattern = int(key("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN) or GEMMA3_SWA_PATTERN)
            gemma.update(swa_layers=[(i + 1) % pattern != 0 for i in range(layers)] if window else None,
                         swa_rope_theta=GEMMA3_LOCAL_ROPE_THETA if window else None)
        else:  # Gemma 2: every other layer slides (the first does), all on one RoPE
            gemma.update(swa_layers=[i % 2 == 0 for i in range(layers)] if window else None)
        # Gemma 2's soft-capped attention scores and logits (Gemma 3 files have neither)
        gemma.update(attn_softcap=float(key("attn_logit_softcapping", 0.0) or 0.0) or None,
                     final_softcap=float(key("final_logit_softcapping", 0.0) or 0.0) or None)
        # The 27B models (Gemma 3: 62 layers, Gemma 2: 46) scale queries by hidden / heads, the others by
        # their head size (llama.cpp; HF's query_pre_attn_scalar)
        if layers == (62 if arch == "gemma3" else 46):
            gemma["query_scale"] = float((hidden // heads) ** -0.5)
        window = None  # not phi3's cap: the native model attends within each sliding layer's window
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        architecture=arch,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling_factor=factor if scaling == "linear" else 1.0,
        sliding_window=window,
        **gemma,
    )


TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

FUSED_TENSORS = ("attn_qkv", "ffn_up")


def fused_parts(config: LlamaConfig, layer: str, kind: str, suffix: str) -> list[tuple[str, slice]]:
    """(Hugging Face name, rows) of each projection in a fused phi3 tensor."""
    p = f"model.layers.{layer}."
    if kind == "attn_qkv":
        nq, nk = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [(f"{p}self_attn.q_proj.{suffix}", slice(0, nq)), (f"{p}self_attn.k_proj.{suffix}", slice(nq, nq + nk)),
                (f"{p}self_attn.v_proj.{suffix}", slice(nq + nk, nq + 2 * nk))]
    inter = config.intermediate_size
    return [(f"{p}mlp.gate_proj.{suffix}", slice(0, inter)), (f"{p}mlp.up_proj.{suffix}", slice(inter, 2 * inter))]


def unpermute_rows(rows: Any, heads: int) -> Any:
    """Rows of a Q/K weight (or its per-row blocks) from llama.cpp's interleaved RoPE order to HF's."""
    rows = rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:])
    return rows.swapaxes(2, 1).reshape(-1, *rows.shape[3:])


def gguf_tokenizer(path: Path) -> Any:
    """The GGUF's tokenizer as a `tokenizers.Tokenizer`, via transformers' converter (first load only).
    Where transformers has it (5.x), its GGUF tokenizer converter is called directly: what
    AutoTokenizer builds (the same JSON, tested), without the whole-file read AutoTokenizer does first
    for the model's config (8.2 s against 3.2 s on a 128k-token vocabulary here)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        pass
    else:
        # What transformers' get_gguf_tokenizer hands the converter, read by GGUFFile: its own reader
        # module imports torch (1.5 s) and decodes the vocabulary slower (0.7 s on 262k pieces).
        reader = GGUFFile(path)
        tokenizer = {name: gguf_field(reader, f"tokenizer.{key}") for key, name in
                     GGUF_TOKENIZER_MAPPING["tokenizer"].items() if f"tokenizer.{key}" in reader.fields}
        for name, value in tokenizer.items():
            if isinstance(value, np.ndarray):
                tokenizer[name] = value.tolist()
        return convert_gguf_tokenizer(gguf_field(reader, "general.architecture"), tokenizer)[0]
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return hf.backend_tokenizer


# ---- a GGUF's header, read fast ---------------------------------------------------------------

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
            12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFField:
    """One metadata value: `contents()` as gguf-py's ReaderField gives it; a string array's items are
    decoded only when asked for (a tokenizer's 128k-280k strings are skipped at parse)."""

    def __init__(self, value: Any, strings: "Optional[tuple[Any, list[int]]]" = None) -> None:
        self._value, self._strings = value, strings

    @property
    def data(self) -> Any:  # what len() is taken of
        return self._strings[1] if self._strings is not None else self._value

    def contents(self) -> Any:
        if self._strings is not None:
            buffer, starts = self._strings
            return [bytes(buffer[s + 8:s + 8 + int.from_bytes(buffer[s:s + 8], "little")]).decode("utf-8", "replace")
                    for s in starts]
        return self._value


class GGUFTensor:
    """A tensor's header and its bytes in the mapped file (`data`: uint8 [rows, row bytes] for a block
    type, or the dense values in their dtype), as gguf-py's ReaderTensor holds them."""

    def __init__(self, name: str, shape: list[int], tensor_type: Any, data_offset: int, n_bytes: int,
                 data: Any) -> None:
        self.name, self.shape, self.tensor_type = name, shape, tensor_type
        self.data_offset, self.n_bytes, self.data = data_offset, n_bytes, data


class GGUFFile:
    """The metadata and tensors of a GGUF, the file mapped read-only (`data`, an np.memmap): what
    gguf-py's GGUFReader gives (`fields`, `tensors`), in a fraction of its time, because a string
    array is walked, not decoded into one numpy array per item (GGUFReader took 5.3 s on a 128k-token
    vocabulary here)."""

    def __init__(self, path: "str | Path") -> None:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        buffer = memoryview(self.data)
        if bytes(buffer[:4]) != b"GGUF":
            raise GGUFError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version = int.from_bytes(buffer[4:8], "little")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} (this reader takes 2 and 3)")
        tensor_count = int.from_bytes(buffer[8:16], "little")
        kv_count = int.from_bytes(buffer[16:24], "little")
        at = 24

        def u32() -> int:
            nonlocal at
            at += 4
            return int.from_bytes(buffer[at - 4:at], "little")

        def u64() -> int:
            nonlocal at
            at += 8
            return int.from_bytes(buffer[at - 8:at], "little")

        def string() -> str:
            nonlocal at
            n = u64()
            at += n
            return bytes(buffer[at - n:at]).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            nonlocal at
            if kind == _STRING:
                return string()
            dtype = np.dtype(_SCALARS[kind])
            at += dtype.itemsize
            item = np.frombuffer(buffer[at - dtype.itemsize:at], dtype=dtype)[0].item()
            return bool(item) if kind == 7 else item

        self.fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            key = string()
            kind = u32()
            if kind != _ARRAY:
                self.fields[key] = GGUFField(value(kind))
                continue
            item_kind, count = u32(), u64()
            if item_kind == _STRING:
                starts = []
                for _ in range(count):
                    starts.append(at)
                    at += 8 + int.from_bytes(buffer[at:at + 8], "little")
                self.fields[key] = GGUFField(None, (buffer, starts))
            elif item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind])
                items = np.frombuffer(buffer[at:at + count * dtype.itemsize], dtype=dtype)
                at += count * dtype.itemsize
                self.fields[key] = GGUFField(items.tolist())
            else:
                raise GGUFError(f"{self.path}: metadata {key!r} is an array of type {item_kind} (nested arrays "
                                f"are not read)")
        infos = []
        for _ in range(tensor_count):
            name = string()
            dims = [u64() for _ in range(u32())]
            infos.append((name, dims, u32(), u64()))
        alignment = int(self.fields["general.alignment"].contents()) if "general.alignment" in self.fields else 32
        start = -(-at // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
            tensor_type = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[tensor_type]
            elements = 1
            for n in dims:
                elements *= n
            n_bytes = elements // block * size
            begin = start + offset
            if begin + n_bytes > len(self.data):
                raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
            raw = self.data[begin:begin + n_bytes]
            if tensor_type.name in ("F32", "F16", "F64"):
                values = raw.view({"F32": np.float32, "F16": np.float16, "F64": np.float64}[tensor_type.name])
                data = values.reshape(list(reversed(dims)))
            else:
                rows = elements // dims[0]
                data = raw.reshape(rows, -1)
            self.tensors.append(GGUFTensor(name, dims, tensor_type, begin, n_bytes, data))
