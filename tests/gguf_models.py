"""Tiny random models of each architecture the `llm` backend claims, written as GGUF files the way
llama.cpp's convert_hf_to_gguf.py writes them (gguf-py's writer, its tensor names, the Q/K row
permutation for llama and mistral), with a small byte-level BPE tokenizer, so that tests can load
one file both through Outrider and through transformers (`from_pretrained(..., gguf_file=...)`).
Nothing is downloaded: the weights come from a seeded transformers model built here."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}

_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3's fused projections
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


THINK_TAGS = ["<think>", "</think>"]
# Qwen3's way: the model opens <think> itself; enable_thinking=false writes an empty one into the prompt.
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                  "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# DeepSeek-R1's way: the generation prompt opens <think>.
R1_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
THINKING_TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "r1": R1_TEMPLATE}


def tokenizer_fields(thinking: bool = False) -> tuple[list[str], list[str]]:
    """(tokens, merges): the 256 byte tokens, a few merges, (with `thinking`, <think> and </think>),
    and the chat specials, last."""
    alphabet = list(_bytes_to_unicode().values())
    merges = ["Ġ t", "Ġ a", "h e", "i n", "Ġt he", "e r", "o n", "Ġ s"]
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return alphabet + merged + (THINK_TAGS if thinking else []) + specials, merges


def hf_config(arch: str, vocab_size: int, **overrides):
    """A tiny transformers config of `arch` (two layers, GQA, head_dim 32; qwen3: 128)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  tie_word_embeddings=arch != "mistral", rope_theta=10000.0)
    common.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "phi3":
        return transformers.Phi3Config(pad_token_id=0, **common)
    if arch == "qwen3":
        # transformers reads no head_dim from a qwen3 GGUF (its default is 128, Qwen3's own), so the
        # tiny model uses 128 too: a q width (4 x 128) other than hidden_size, as in Qwen3-0.6B.
        return transformers.Qwen3Config(head_dim=128, **common)
    raise ValueError(arch)


def rope_theta(config) -> float:
    """RoPE's base of a transformers config (4.x: `rope_theta`; 5.x: `rope_parameters`)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def llama3_rope_factors(config, head_dim: int) -> Optional[np.ndarray]:
    """The `rope_freqs` divisors convert_hf_to_gguf.py writes for a Llama 3 rope scaling, or None."""
    import math

    parameters = getattr(config, "rope_parameters", None) or {}
    if parameters.get("rope_type") != "llama3":
        return None
    factor, low, high = parameters["factor"], parameters["low_freq_factor"], parameters["high_freq_factor"]
    old = parameters["original_max_position_embeddings"]
    freqs = 1.0 / (rope_theta(config) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# Types gguf-py has no quantizer for: (block bytes, offsets of their fp16 super-block scales).
RANDOM_BLOCKS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
                 "Q6_K": (210, (208,))}


def random_blocks(kind: str, rows: int, cols: int, seed: int, powers_of_two: bool = False) -> np.ndarray:
    """Random blocks of `kind` (any bytes are valid values) with fp16 super-block scales of a
    trained model's size; with `powers_of_two`, scales 2^-12 .. 2^-5, so that every K-type
    sub-block scale (scale x a 6- or 8-bit integer) is exact in fp16."""
    size, scales = RANDOM_BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for start in scales:
        if powers_of_two:
            values = (2.0 ** rng.integers(-12, -4, (rows, cols // 256))).astype(np.float16)
        else:
            values = rng.uniform(1e-4, 2e-2, (rows, cols // 256)).astype(np.float16)
        raw[..., start:start + 2] = values.view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


def one_token_logits(model, tokens) -> "object":
    """The logits of `tokens` fed to `model` (an outrider LlamaModel, or the torch-free NativeLlama:
    numpy out) one token at a time, each committed: what a prefill of them must equal bit for bit on
    the native paths."""
    import torch

    from outrider.generation.contract import Chunk

    cache = model.new_cache(1, len(tokens) + 1)
    steps = []
    for i, token in enumerate(tokens):
        steps.append(model.forward(cache, [Chunk(0, torch.tensor([int(token)]), torch.tensor([i]))]).logits)
        cache.commit(0, [0])
    return np.concatenate(steps) if isinstance(steps[0], np.ndarray) else torch.cat(steps)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for llama-style RoPE (convert_hf_to_gguf.py LlamaModel.permute)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def write_tiny_gguf(directory: Path, arch: str, seed: int = 0, matrix_type: str = "F32",
                    types: Optional[dict[str, str]] = None, thinking: Optional[str] = None,
                    **overrides) -> tuple[Path, object]:
    """A random `arch` model as `directory/tiny-<arch>.gguf`; returns (path, the transformers model).

    Matrices are written in `matrix_type` (F32, F16, or a type gguf-py quantizes: Q8_0, Q4_0, ...),
    or per GGUF tensor-name suffix in `types`; norms and biases stay F32. `thinking` ("qwen3" or
    "r1") adds <think> and </think> tokens (user-defined, as Qwen3's) and that family's template.
    """
    import torch
    import transformers

    tokens, merges = tokenizer_fields(thinking is not None)
    config = hf_config(arch, len(tokens), **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomize(model, (0.7, 1.3))
    path = Path(directory) / f"tiny-{arch}.gguf"
    # llama.cpp converts Mistral (MistralForCausalLM) as a "llama" GGUF: same layers and RoPE.
    writer = _writer(path, GGUF_ARCH[arch], f"tiny-{arch}", config)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch in ("llama", "mistral", "phi3"):
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config.vocab_size)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    tags = 2 if thinking else 0
    writer.add_token_types([1] * (len(tokens) - 3 - tags) + [4] * tags + [3] * 3)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 3)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_pad_token_id(len(tokens) - 1)  # else transformers' phi3 takes Phi-3's own (32000)
    writer.add_chat_template(THINKING_TEMPLATES[thinking] if thinking else
                             "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    factors = llama3_rope_factors(config, head_dim)
    if factors is not None:  # as convert_hf_to_gguf.py writes Llama 3's rope scaling
        writer.add_tensor("rope_freqs.weight", factors)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<module...>.(weight|bias)
            out = f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
            if arch in ("llama", "mistral") and parts[-2] in ("q_proj", "k_proj"):
                heads = config.num_attention_heads if parts[-2] == "q_proj" else config.num_key_value_heads
                values = _permute(values, heads)
        _add_tensor(writer, out, values, next((t for suffix, t in (types or {}).items() if out.endswith(suffix)),
                                              matrix_type))
    _finish(writer)
    return path, model


def _randomize(model, norms: tuple[float, float]) -> None:
    """Weights larger than the default init (so the logits differ visibly between tokens), norms
    uniform in `norms`."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(*norms)
            else:
                p.normal_(0.0, 0.05)


def _writer(path: Path, arch: str, name: str, config):
    """A GGUF writer with the shape of a transformers `config` written."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    return writer


def _add_tensor(writer, out: str, values: np.ndarray, kind: str) -> None:
    """A matrix in `kind` (F16, a type gguf-py quantizes, or random blocks of a K type), anything
    else in F32."""
    import gguf

    if values.ndim == 2 and kind != "F32":
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F16":
            data = values.astype(np.float16)
        elif kind in RANDOM_BLOCKS:  # a type gguf-py cannot quantize to: random blocks, sane scales
            data = random_blocks(kind, *values.shape, seed=len(out))
        else:
            data = gguf.quants.quantize(values, qtype)
        writer.add_tensor(out, data, raw_dtype=qtype)  # the writer reads the shape off the bytes
    else:
        writer.add_tensor(out, np.ascontiguousarray(values, dtype=np.float32))


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_block_gguf(path: Path, hidden: int, layers: int, ffn: int, vocab: int, types: dict[str, str],
                     heads: int = 16, kv_heads: int = 4) -> Path:
    """A llama GGUF of random blocks at a real layout (no transformers model behind it: for sizes,
    memory and speed, not for what it computes): each matrix in the type of the longest key of
    `types` its name contains ("" for the rest), norms F32; the tiny byte-level tokenizer."""
    import gguf

    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    tokens, merges = tokenizer_fields()
    tokens = tokens + [f"<|reserved_{i}|>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    shapes = {"token_embd": (vocab, hidden)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_q": (hidden, hidden), b + "attn_k": (kv_heads * head_dim, hidden),
                       b + "attn_v": (kv_heads * head_dim, hidden), b + "attn_output": (hidden, hidden),
                       b + "ffn_gate": (ffn, hidden), b + "ffn_up": (ffn, hidden), b + "ffn_down": (hidden, ffn)})
    rng = np.random.default_rng(0)
    for index, (name, (rows, cols)) in enumerate(shapes.items()):
        kind = types[max((k for k in types if k in name), key=len)]
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in RANDOM_BLOCKS:
            data = random_blocks(kind, rows, cols, seed=index)
        else:
            data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.02, qtype)
        writer.add_tensor(name + ".weight", data, raw_dtype=qtype)
        if name.endswith("attn_output"):
            layer = name.rsplit(".", 1)[0]
            for norm in ("attn_norm", "ffn_norm"):
                writer.add_tensor(f"{layer}.{norm}.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- Gemma 3 ----------------------------------------------------------------------------------------

GEMMA3_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def sentencepiece_fields() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a small SentencePiece vocabulary as Gemma's GGUF lays it out:
    pad 0, eos 1, bos 2, unk 3 and the turn markers (CONTROL), the 256 byte pieces <0xNN> (BYTE), then
    pieces with "▁" for spaces, scored by length (longer merges first, as a trained model's)."""
    pieces = ["▁", "e", "t", "a", "o", "i", "n", "s", "r", "h", "l", "d", "▁t", "▁a", "he", "in", "er", "▁the",
              "▁s", "on", "at", "en", "▁w", "is", "or", "▁o", "▁i", "it", "▁h", "an", "▁b", "ou", "▁c", "ll",
              "▁m", "ar", "▁f", "le", "▁p", "es", "▁and", "ing", "▁is", "▁of", "▁in", "▁to", "▁hello", "▁world"]
    tokens = GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * len(GEMMA_SPECIALS) + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [3] * len(GEMMA_SPECIALS) + [6] * 256 + [1] * len(pieces)
    types[3] = 2  # unk: UNKNOWN
    return tokens, scores, types


def write_tiny_gemma3_gguf(directory: Path, seed: int = 0, types: Optional[dict[str, str]] = None,
                           matrix_type: str = "Q8_0", chat_template: Optional[str] = None, arch: str = "gemma3",
                           **overrides) -> tuple[Path, object]:
    """A random Gemma 3 text model (or with arch "gemma2" a Gemma 2) as `directory/tiny-<arch>.gguf`,
    written as llama.cpp's convert_hf_to_gguf.py writes them (norm weights stored as 1 + w, no Q/K
    permutation, the SentencePiece vocabulary, no chat template unless given, Gemma 2's soft caps);
    returns (path, the transformers model). Seven layers: Gemma 3's layer 5 attends globally and the
    rest within `sliding_window` (8 by default: a test of 20 tokens crosses it), Gemma 2's even layers
    slide; head_dim 256 as Gemma's. Matrices in `matrix_type` or per tensor name suffix in `types`
    (the native runtime serves Gemma from block types only)."""
    import torch
    import transformers

    tokens, scores, token_types = sentencepiece_fields()
    settings = dict(vocab_size=len(tokens), hidden_size=128, intermediate_size=256, num_hidden_layers=7,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=256, max_position_embeddings=512,
                    rms_norm_eps=1e-6, sliding_window=8, query_pre_attn_scalar=256,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2, hidden_activation="gelu_pytorch_tanh",
                    tie_word_embeddings=True)
    if arch == "gemma3":
        settings.update(final_logit_softcapping=None, attn_logit_softcapping=None)
    else:  # Gemma 2's caps (its defaults are 50 and 30); a small attention cap so that it bites here
        settings.update(final_logit_softcapping=30.0, attn_logit_softcapping=2.0)
    settings.update(overrides)
    if arch == "gemma3":
        config = transformers.Gemma3TextConfig(**settings)
    else:
        config = transformers.Gemma2Config(**settings)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (transformers.Gemma3ForCausalLM if arch == "gemma3" else transformers.Gemma2ForCausalLM)(config).eval()
    _randomize(model, (-0.3, 0.3))  # Gemma's norms compute x (1 + w)
    path = Path(directory) / f"tiny-{arch}.gguf"
    writer = _writer(path, arch, f"tiny-{arch}", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    # transformers 5.x: Gemma 3 has a RoPE per layer type (its defaults: 1e6 global, 10,000 local)
    rope = config.rope_parameters
    writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"] if "full_attention" in rope
                                    else rope["rope_theta"]))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    if chat_template:
        writer.add_chat_template(chat_template)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        values = tensor.float().numpy()
        if name.endswith("norm.weight"):
            values = values + np.float32(1)  # convert_hf_to_gguf.py's Gemma norm shift
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            parts = name.split(".")
            out = f"blk.{parts[2]}.{GEMMA3_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
        _add_tensor(writer, out, values, next((t for suffix, t in (types or {}).items() if out.endswith(suffix)),
                                              matrix_type))
    _finish(writer)
    return path, model
