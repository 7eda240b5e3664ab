#!/usr/bin/env python3
"""SmolLM2 forward: outrider's LlamaModel vs transformers (DynamicCache), same weights, same run.

  python tools/bench_llm_forward.py                 forward table (decode, verify, prefill, LM head)
  python tools/bench_llm_forward.py --load          also time loading (first load, cached load, transformers)
  python tools/bench_llm_forward.py --context 1000  committed tokens before each measured step
  python tools/bench_llm_forward.py --quant int4,int8,int4+bf16 --no-hf   quantized columns only vs ours
  python tools/bench_llm_forward.py --quant int4,int4native,w4a8 --no-hf   torch's int4 kernel vs outrider's two

Columns: outrider fp32, bf16 (where the CPU has native bf16, or --bf16 yes), the quantized modes
of --quant (weights from outrider_quantize.llm; kernels chosen as at load, "+bf16" also keeps a
dense bf16 copy for calls of many rows), then transformers. The ratio columns are fp32 time over
each column's time, measured in the same run.

Every case is timed as the median of repeated calls, with `--threads` (default 2) torch threads.
"Verify n" feeds the pending token plus n-1 draft tokens: a tree for outrider (DraftTree mask),
a chain for transformers (its cache is cropped back after each call). Read the ratios: absolute
numbers differ between machines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def balanced_tree(size: int, width: int = 2):
    """A DraftTree of `size` nodes, each node with up to `width` children (breadth first)."""
    from outrider.generation.contract import DraftTree

    parents = [-1 if i < width else (i - width) // width for i in range(size)]
    return DraftTree(tokens=[(17 * i + 5) % 1000 + 100 for i in range(size)], parents=parents, probs=[1.0] * size)


def interleaved_ms(fns: list[Optional[Callable[[], object]]], repeat: int, warmup: int = 3) -> list[Optional[float]]:
    """Median ms per function, the calls taken round-robin: load from other processes on a shared
    machine then hits every column alike instead of whichever happened to run during it."""
    for fn in fns:
        for _ in range(warmup if fn else 0):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, samples):
            if fn is not None:
                start = time.perf_counter()
                fn()
                out.append(time.perf_counter() - start)
    return [statistics.median(out) * 1e3 if out else None for out in samples]


class Ours:
    def __init__(self, model, context: list[int]) -> None:
        from outrider.generation.contract import Chunk

        self.model, self.Chunk = model, Chunk
        self.cache = model.new_cache(9, len(context) + 256)
        for slot in range(9):
            model.forward(self.cache, [self._chain(slot, context, 0)], only_last=True)
            self.cache.commit(slot, list(range(len(context))))
        self.length = len(context)

    def _chain(self, slot: int, tokens: list[int], start: int):
        return self.Chunk(slot, torch.tensor(tokens), torch.arange(start, start + len(tokens)))

    def decode(self) -> Callable[[], object]:
        chunk = self._chain(0, [123], self.length)
        return lambda: self.model.forward(self.cache, [chunk])

    def decode_batch(self, sequences: int) -> Callable[[], object]:
        chunks = [self._chain(s, [123 + s], self.length) for s in range(sequences)]
        return lambda: self.model.forward(self.cache, chunks)

    def verify(self, n: int) -> Callable[[], object]:
        tree = balanced_tree(n - 1)
        positions = [self.length] + [self.length + d for d in tree.depths()]
        chunk = self.Chunk(0, torch.tensor([123] + tree.tokens), torch.tensor(positions), tree.mask())
        return lambda: self.model.forward(self.cache, [chunk])

    def verify_batch(self, n: int, sequences: int) -> Callable[[], object]:
        tree = balanced_tree(n - 1)
        positions = torch.tensor([self.length] + [self.length + d for d in tree.depths()])
        mask = tree.mask()
        chunks = [self.Chunk(s, torch.tensor([123 + s] + tree.tokens), positions, mask) for s in range(sequences)]
        return lambda: self.model.forward(self.cache, chunks)

    def prefill(self, n: int) -> Callable[[], object]:
        chunk = self._chain(8, [(7 * i) % 1000 + 100 for i in range(n)], 0)

        def run():
            self.cache.reset(8)
            return self.model.forward(self.cache, [chunk])

        return run

    def lm_head(self, rows: int) -> Callable[[], object]:
        hidden = torch.randn(rows, self.model.hidden_size)
        return lambda: self.model.lm_head(hidden)


class Transformers:
    def __init__(self, model, context: list[int]) -> None:
        import inspect

        from transformers import DynamicCache

        self.model, self.DynamicCache = model, DynamicCache
        params = inspect.signature(type(model).forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.kv = DynamicCache()
        self._run([context], self.kv)
        self.length = len(context)

    @torch.inference_mode()
    def _run(self, ids: list[list[int]], kv) -> torch.Tensor:
        return self.model(torch.tensor(ids), use_cache=True, **{self.cache_arg: kv}).logits

    def _step(self, tokens: list[int]) -> Callable[[], object]:
        def run():
            logits = self._run([tokens], self.kv)
            self.kv.crop(-len(tokens))  # back to the committed context (negative: tokens to drop)
            return logits

        return run

    def decode(self) -> Callable[[], object]:
        return self._step([123])

    def verify(self, n: int) -> Callable[[], object]:
        return self._step([123] + balanced_tree(n - 1).tokens)

    def prefill(self, n: int) -> Callable[[], object]:
        tokens = [(7 * i) % 1000 + 100 for i in range(n)]
        return lambda: self._run([tokens], self.DynamicCache())

    def lm_head(self, rows: int) -> Callable[[], object]:
        weight = self.model.lm_head.weight
        hidden = torch.randn(rows, self.model.config.hidden_size, dtype=weight.dtype)
        return lambda: F.linear(hidden, weight)


def transformers_model(config, state_dict, dtype: torch.dtype):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    hf_config = HFLlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    model = LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(state_dict, strict=False)
    return model.to(dtype)


def quantized_models(config, raw_state_dict: dict, modes: list[str]) -> list[tuple[str, object]]:
    """(column name, LlamaModel) per quantized mode ("int4", "int8", "int4+bf16": dense copy too)."""
    from outrider_llm.model import LlamaModel
    from outrider_quantize.llm import quantize_state_dict

    out = []
    for spec in modes:
        mode, _, extra = spec.partition("+")
        native = mode in ("int4native", "w4a8")
        kernel = mode if native else f"{mode}pack+bf16" if extra else "auto"
        mode = "int4" if native else mode
        if mode not in ("int4", "int8") or extra not in ("", "bf16") or (native and extra):
            raise SystemExit(f"--quant: expected int4, int8, int4+bf16, int8+bf16, int4native or w4a8, got {spec!r}")
        weights = quantize_state_dict(raw_state_dict, mode)
        model = LlamaModel(config, weights, kernel=kernel)
        for plan in model.kernel_plans.values():
            print(f"# {spec}: {plan.mode} weights -> {plan.kernel} (dense copy {'from %d rows' % plan.dense_from_rows if plan.dense_copy else 'off'}); {plan.reason}")
        print(f"# {spec}: matmul weights {model.weight_bytes() / 1e6:.0f} MB")
        out.append((f"outrider {spec}", model))
    return out


def bench_forward(args: argparse.Namespace) -> None:
    from outrider_llm.loading import read_artifact_weights
    from outrider_llm.conversion import load_weights_artifact
    from outrider_llm.artifact import read_artifact_meta, smollm2_gguf_path
    from outrider_llm.model import LlamaConfig, LlamaModel
    from outrider_llm.linear import cpu_has_native_bf16
    from outrider_llm.heap import tune_malloc

    tune_malloc()
    artifact = load_weights_artifact(smollm2_gguf_path())
    config = LlamaConfig.from_dict(read_artifact_meta(artifact)["config"])
    raw = read_artifact_weights(artifact, raw_blocks=True)  # with the GGUF's Q4_1 blocks, for exact int4
    state_dict = {k: v for k, v in raw.items() if ".q4_1." not in k}
    context = [(11 * i) % 2000 + 100 for i in range(args.context)]
    columns: list[tuple[str, object]] = [("outrider fp32", Ours(LlamaModel(config, state_dict, dtype="fp32"), context))]
    if args.bf16 == "yes" or (args.bf16 == "auto" and cpu_has_native_bf16()):
        columns.append(("outrider bf16", Ours(LlamaModel(config, state_dict, dtype="bf16"), context)))
    modes = [m for m in args.quant.split(",") if m]
    for name, model in quantized_models(config, raw, modes):
        columns.append((name, Ours(model, context)))
    del raw
    if not args.no_hf:
        columns.append(("transformers fp32", Transformers(transformers_model(config, state_dict, torch.float32), context)))
    if args.hf_bf16 and not args.no_hf:
        hf_bf16 = transformers_model(config, state_dict, torch.bfloat16)
        columns.append(("transformers bf16", Transformers(hf_bf16, context)))

    cases: list[tuple[str, str, tuple, int]] = [
        ("decode 1 token", "decode", (), args.repeat),
        ("verify 8 (tree)", "verify", (8,), args.repeat),
        ("verify 16 (tree)", "verify", (16,), args.repeat),
        ("verify 32 (tree)", "verify", (32,), args.repeat),
        ("verify 8, 4 seqs", "verify_batch", (8, 4), args.repeat),
        ("decode 4 seqs x 1", "decode_batch", (4,), args.repeat),
        ("decode 8 seqs x 1", "decode_batch", (8,), args.repeat),
        ("prefill 128", "prefill", (128,), max(3, args.repeat // 4)),
        ("LM head, 1 row", "lm_head", (1,), args.repeat),
        ("LM head, 8 rows", "lm_head", (8,), args.repeat),
        ("LM head, 32 rows", "lm_head", (32,), args.repeat),
    ]
    names = [name for name, _ in columns]
    print(f"SmolLM2-135M, {torch.get_num_threads()} threads, {args.context} committed tokens, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    width = max(17, *(len(n) for n in names))
    ratio_names = [n.removeprefix("outrider ") for n in names[1:]]
    header = (f"| {'case':<20} | " + " | ".join(f"{n:>{width}}" for n in names) + " | "
              + " | ".join(f"{'fp32/' + n:>{max(10, len(n) + 5)}}" for n in ratio_names) + " |")
    print(header)
    print("|" + "|".join("-" * len(part) for part in header.split("|")[1:-1]) + "|")
    for label, method, method_args, repeat in cases:
        fns = [getattr(runner, method, None) for _, runner in columns]
        row = interleaved_ms([fn(*method_args) if fn else None for fn in fns], repeat)
        cells = " | ".join(f"{v:>{width - 3}.2f} ms" if v is not None else f"{'-':>{width}}" for v in row)
        ratios = " | ".join(
            f"{(f'{row[0] / v:.2f}x' if v and row[0] else '-'):>{max(10, len(n) + 5)}}" for n, v in zip(ratio_names, row[1:])
        )
        print(f"| {label:<20} | {cells} | {ratios} |", flush=True)


LOAD_SNIPPET = r"""
import sys, time
start = time.perf_counter()
import torch
if sys.argv[1] == "outrider":
    from outrider_llm.loading import load_smollm2
    model, tokenizer = load_smollm2()
    tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    logging.disable_progress_bar()
    from outrider_llm.loading import smollm2_gguf_path
    path = smollm2_gguf_path()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
print(f"{time.perf_counter() - start:.2f}")
"""


def bench_load() -> None:
    def timed(which: str, cache: str) -> float:
        env = dict(os.environ, OUTRIDER_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, "-c", LOAD_SNIPPET, which], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as cache:
        first = timed("outrider", cache)
        cached = timed("outrider", cache)
        hf = timed("transformers", cache)
    print("\nLoad, process start to model + tokenizer ready (import torch included):")
    print("| what                                   |  seconds |")
    print("|----------------------------------------|----------|")
    print(f"| outrider, first load (convert + cache) | {first:8.2f} |")
    print(f"| outrider, cached                       | {cached:8.2f} |")
    print(f"| transformers from_pretrained(gguf)     | {hf:8.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256, help="committed tokens before each step")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--bf16", choices=("auto", "yes", "no"), default="auto", help="also outrider in bf16")
    parser.add_argument("--hf-bf16", action="store_true", help="also transformers in bf16")
    parser.add_argument("--quant", default="int4,int8",
                        help="quantized columns: int4, int8, int4+bf16, int8+bf16, int4native, w4a8")
    parser.add_argument("--no-hf", action="store_true", help="leave out the transformers columns")
    parser.add_argument("--load", action="store_true", help="also time loading, in fresh processes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench_forward(args)
    if args.load:
        bench_load()


if __name__ == "__main__":
    main()
