#!/usr/bin/env python3
"""How many draft tokens pay for their verification: SmolLM2 quantized weights, one run.

  python tools/bench_draft_budget.py [--budgets 2,3,4,8] [--kernel int4pack] [--prompts 4] [--tokens 80]

Builds (or reuses) the int4 weights artifact the `smollm2-int8` manifest serves, runs the engine
in process (no server) with plain decoding and with n-gram + draft head speculation at each
`max_draft_tokens`, interleaved per prompt, greedy and T=1. Prints decode tokens/s (after the
first token), tokens per step, and how many greedy continuations equal plain decoding's.
Packed int4 kernels cost about linearly in rows, so verification is not free: this is the table
behind `max_draft_tokens` in manifests/smollm2-int8.yaml.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]


def quantized_artifact(kernel: str):
    """The int4 "llama-weights" artifact of the shipped GGUF, through the quantize transform."""
    from outrider.accelerators import TransformContext
    from outrider.artifacts import ArtifactCache
    from outrider_llm.loading import model_from_artifact
    from outrider_llm.artifact import artifact_tokenizer, smollm2_gguf_path
    from outrider_llm.conversion import load_weights_artifact
    from outrider_quantize.config import QuantizeConfig
    from outrider_quantize.llm import LlmWeightQuantizer

    weights = load_weights_artifact(smollm2_gguf_path())
    tokenizer = artifact_tokenizer(weights)
    context = TransformContext(None, "llm", "cpu", ArtifactCache(), {
        "build_model": lambda art: model_from_artifact(art, kernel=kernel)[0], "tokenize": tokenizer.encode})
    return LlmWeightQuantizer(None, QuantizeConfig(mode="int4")).apply(weights, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="2,3,4,8")
    parser.add_argument("--kernel", default="auto", help="quantize.kernel (auto, int4pack, auto+bf16, ...)")
    parser.add_argument("--prompts", type=int, default=4, help="HumanEval prompts (problems 100+)")
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from bench_spec import EngineRow, humaneval_prompts
    from outrider_llm.loading import model_from_artifact

    torch.set_num_threads(args.threads)
    model, tokenizer = model_from_artifact(quantized_artifact(args.kernel), kernel=args.kernel)
    prompts = humaneval_prompts(100 + args.prompts)[100:]
    rows = {"plain": EngineRow("plain", model, tokenizer, None)}
    for budget in (int(b) for b in args.budgets.split(",")):
        section = {"drafters": ["ngram", "eagle"], "max_draft_tokens": budget, "min_draft_tokens": min(2, budget)}
        rows[f"{budget} draft"] = EngineRow(f"{budget} draft", model, tokenizer, section)
    results: dict[tuple[str, float], list[tuple[float, float, tuple]]] = {}
    for temperature in (0.0, 1.0):
        for i, prompt in enumerate(prompts):
            for name, row in rows.items():
                final, _ = row.run({"prompt": prompt, "max_tokens": args.tokens}, temperature, seed=i)
                stats = final["stats"]
                decode = (stats["new_tokens"] - 1) / max(stats["seconds"] - stats["time_to_first_token"], 1e-9)
                results.setdefault((name, temperature), []).append(
                    (decode, stats["mean_accepted_length"] or 1.0, tuple(final["token_ids"])))
    plain = [r[2] for r in results[("plain", 0.0)]]
    print(f"SmolLM2 int4 (kernel {args.kernel}), {args.prompts} HumanEval prompts, {args.tokens} tokens, "
          f"{args.threads} threads; median decode tokens/s")
    print(f"{'row':<10}{'T=0 tok/s':>10}{'tok/step':>9}{'T=1 tok/s':>10}{'tok/step':>9}{'greedy = plain':>16}")
    for name in rows:
        greedy, sampled = results[(name, 0.0)], results[(name, 1.0)]
        same = sum(a == b[2] for a, b in zip(plain, greedy))
        print(f"{name:<10}{statistics.median(r[0] for r in greedy):>10.1f}{statistics.median(r[1] for r in greedy):>9.2f}"
              f"{statistics.median(r[0] for r in sampled):>10.1f}{statistics.median(r[1] for r in sampled):>9.2f}"
              f"{f'{same}/{len(plain)}':>16}")


if __name__ == "__main__":
    main()
