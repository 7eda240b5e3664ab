#!/usr/bin/env python3
"""What the speculative cost gate costs or saves: the engine in process, plain against speculation
with the gate on and off, at several draft budgets, on any GGUF the native runtime serves.

  python tools/bench_gate.py                                   Gemma 3 270M (bench_gemma's file), n-gram
  python tools/bench_gate.py --file MODEL.gguf --budgets 4,16 --drafters ngram,eagle --eagle HEAD
  python tools/bench_gate.py --file MODEL.gguf --costs         what verifying 1-16 drafts costs, the cap
  python tools/bench_gate.py --streams 4,8                     several sequences per step: aggregate tok/s

The prompts are bench_gemma's 16 chat prompts (in the file's chat template) and 16 plain-text
openings; each is decoded `--tokens` long (greedy unless --temperature) by every configuration in turn (interleaved, so a
slow spell of the shared machine falls on all of them), `--rounds` times. One sequence at a time:
the gate's single-stream judgment; each `--budgets` value as given, and the default budget under
the cap measured at attach (`speculative.max_verify_cost`). Prints decode tok/s (after the first token) and its ratio to
plain, tokens per decode step, and ms per decode step. The gate is right where the gated rows are
near the ungated ones when drafting pays, and near plain (at least 0.97x) when it does not.

--streams N,...: N sequences share each step, two ways, each configuration in turn per group of
prompts. Burst: N prompts admitted at once, the group over when its slowest ends (a closed batch,
as N clients that each send one request see it). Sustained: a new prompt admitted as soon as one
ends, N always in flight (a server under steady load, vLLM's benchmark_serving --max-concurrency
N). Prints aggregate tok/s (all new tokens, prefill included, over the wall time) and its ratio to
plain, and for a draft model the forwards it ran and the seconds they took (the sequences of a step
draft together: one forward a depth); a second plain engine ("plain again") runs the same groups:
its ratio is the noise floor.

--flat-sampling adds a plain row that samples through the flat definitions tools/bench_sampling.py
compares the runtime's with: what the sampling code costs a decode step (use with --temperature).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

from bench_gemma import FILE, PROMPTS, TEXTS  # noqa: E402


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", type=Path, default=FILE, help="a GGUF (default: the Gemma 3 270M file)")
    parser.add_argument("--drafters", default="ngram", help="comma-separated drafters (default ngram)")
    parser.add_argument("--eagle", type=Path, default=None, metavar="HEAD", help="eagle weights, for drafters: eagle")
    parser.add_argument("--draft-model", type=Path, default=None, metavar="GGUF",
                        help="the draft model's file, for drafters: model")
    parser.add_argument("--budgets", default="4,8,16", help="max_draft_tokens values (default 4,8,16)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (default 0: greedy); requests are unseeded, so the gate learns from them")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", default="", help="comma-separated stream counts: aggregate tok/s, burst and "
                        "sustained, instead of one sequence at a time")
    parser.add_argument("--flat-sampling", action="store_true",
                        help="add a plain row that samples with the flat definitions tools/bench_sampling.py "
                        "compares against (numpy's running sum over the vocabulary): what sampling costs a step")
    parser.add_argument("--costs", action="store_true",
                        help="only print what verifying 1-16 drafts costs on the file (verify_cost.py) and the cap")
    args = parser.parse_args(argv)

    from outrider.generation.engine import GenerationEngine
    from outrider.manifest import validate_manifest
    from outrider.plugins import create_registry
    from outrider.serving.request import PendingRequest
    from outrider_llm import native_c
    from outrider_llm.gguf_tiles import load_gguf_tiles
    from outrider_llm.native_model import load_tiles

    native_c.set_threads(args.threads)
    model, tokenizer = load_tiles(load_gguf_tiles(args.file))
    if args.costs:
        from outrider_speculative.config import SpeculativeConfig
        from outrider_speculative.verify_cost import verify_cap

        limit = SpeculativeConfig.max_verify_cost
        started = time.perf_counter()
        cap, ratios = verify_cap(model, SpeculativeConfig.max_draft_tokens, limit)
        print(f"{args.file.name}: a step verifying k drafts, in one-row steps: "
              + ", ".join(f"{k}: {r:.2f}x" for k, r in sorted(ratios.items()))
              + f"; the cap at max_verify_cost {limit}: {cap}; measured in {time.perf_counter() - started:.1f} s "
              f"(what a load with speculation on spends on it)")
        return
    registry = create_registry(["outrider_llm", "outrider_speculative"], load_entry_points=False)

    def strategy(section: dict) -> Any:
        manifest = validate_manifest({"name": "bench", "backend": "llm", "speculative": section})
        made = registry.accelerators_for(manifest, registry.backends["llm"])["speculative"].for_instance()
        made.attach(model, tokenizer)
        return made

    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    extra: dict = {"eagle": {"weights": str(args.eagle), "quantize": "int4"}} if args.eagle else {}
    if args.draft_model:
        extra["model"] = {"path": str(args.draft_model)}
    configs: dict[str, Optional[dict]] = {"plain": None}
    for budget in [*(int(b) for b in args.budgets.split(",") if b.strip()), None]:
        for gated in (True, False):
            # A given budget as it is (max_verify_cost 0); None: the default budget under the cap
            # measured at attach (verify_cost.py), as a manifest without these knobs gets it.
            knobs = {"max_draft_tokens": budget, "max_verify_cost": 0} if budget else {}
            label = f"{budget} tokens" if budget else "default budget, measured cap"
            configs[f"{'+'.join(drafters)}, {label}, {'gated' if gated else 'ungated'}"] = {
                "drafters": drafters, "cost_gate": gated, **knobs, **extra}
    template = getattr(tokenizer, "apply_chat_template", None)
    prompts = [template([{"role": "user", "content": p}]) for p in PROMPTS] if template else []
    prompts += TEXTS
    if args.streams:
        configs["plain again"] = None
        for streams in (int(n) for n in args.streams.split(",")):
            engines = {name: GenerationEngine(model, tokenizer, strategy(section) if section else None,
                                              max_sequences=streams, max_length=1024)
                       for name, section in configs.items()}
            streamed(engines, prompts, streams, args)
        return
    if args.flat_sampling:
        configs["plain, flat sampling"] = None
    engines = {name: GenerationEngine(model, tokenizer, strategy(section) if section else None, max_sequences=1,
                                      max_length=1024) for name, section in configs.items()}
    tally = {name: [0, 0.0, 0] for name in configs}  # decoded tokens, seconds, decode steps
    replies: dict = {}

    def send(request: Any, kind: str, header: dict, outputs: Any) -> None:
        if kind != "chunk":
            replies[request.id] = header

    request_id = 0
    for _ in range(args.rounds):
        for prompt in prompts:
            for name, engine in engines.items():
                request_id += 1
                params = {"prompt": prompt, "max_tokens": args.tokens, "temperature": args.temperature}
                engine.admit([PendingRequest(b"bench", request_id, "generate", "bench", {}, params, send)])
                with flat_sampling(name == "plain, flat sampling"):
                    while engine.busy():
                        engine.step()
                stats = replies.pop(request_id)["stats"]
                tally[name][0] += stats["new_tokens"] - 1
                tally[name][1] += stats["seconds"] - stats["time_to_first_token"]
                tally[name][2] += max(stats["steps"] - 1, 0)
    print(f"{args.file.name}, {len(prompts)} prompts x {args.rounds} rounds, {args.tokens} tokens at T={args.temperature:g}, "
          f"one sequence at a time, {args.threads} threads")
    capped = next(engine.strategy for name, engine in engines.items() if "measured cap" in name)
    print("verifying drafts, one sequence, in one-row steps: "
          + ", ".join(f"{k} drafts {r:.2f}x" for k, r in sorted(capped.verify_costs.items()))
          + f"; the cap: {capped.controller.max_tokens} draft tokens")
    plain = tally["plain"][0] / tally["plain"][1]
    print("\n| configuration | decode tok/s | / plain | tokens per step | ms per step |\n|---|---|---|---|---|")
    for name, (tokens, seconds, steps) in tally.items():
        rate = tokens / seconds
        print(f"| {name} | {rate:.1f} | {rate / plain:.2f}x | {tokens / max(steps, 1):.2f} | "
              f"{seconds / max(steps, 1) * 1e3:.2f} |")


@contextlib.contextmanager
def flat_sampling(on: bool) -> Iterator[None]:
    """Plain sampling through the flat reference definitions (tools/bench_sampling.py) while `on`."""
    if not on:
        yield
        return
    from bench_sampling import reference_distribution, reference_draw
    from outrider.generation import sampling

    def draw(probs: Any, generator: Any) -> int:
        return reference_draw(probs, float((generator or sampling.new_generator()).random()))

    def distribution(logits: Any, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Any:
        return reference_distribution(sampling.host_array(logits), max(temperature, sampling.SAMPLING_EPS), top_k, top_p)

    saved = sampling.draw, sampling.target_distribution
    sampling.draw, sampling.target_distribution = draw, distribution
    try:
        yield
    finally:
        sampling.draw, sampling.target_distribution = saved


def streamed(engines: dict, prompts: list[str], streams: int, args: argparse.Namespace) -> None:
    """Aggregate tok/s of each engine with `streams` sequences per step, burst and sustained (module doc)."""
    from outrider.serving.request import PendingRequest

    tally = {(name, way): [0, 0.0] for name in engines for way in ("burst", "sustained")}  # tokens, seconds
    drafting = {name: draft_work(engine) for name, engine in engines.items()}  # counted from here
    done: dict = {}
    request_ids = iter(range(1, 1 << 30))

    def send(request: Any, kind: str, header: dict, outputs: Any) -> None:
        if kind != "chunk":
            done[request.id] = header["stats"]["new_tokens"]

    def admit(engine: Any, prompt: str) -> int:
        request_id = next(request_ids)
        params = {"prompt": prompt, "max_tokens": args.tokens, "temperature": args.temperature}
        engine.admit([PendingRequest(b"bench", request_id, "generate", "bench", {}, params, send)])
        return request_id

    for _ in range(args.rounds):
        for first in range(0, len(prompts), streams):
            group = prompts[first:first + streams]
            for name, engine in engines.items():  # burst: the group at once, over when its last ends
                started = time.perf_counter()
                ids = [admit(engine, prompt) for prompt in group]
                while engine.busy():
                    engine.step()
                tally[(name, "burst")][1] += time.perf_counter() - started
                tally[(name, "burst")][0] += sum(done.pop(i) for i in ids)
        for name, engine in engines.items():  # sustained: every prompt, `streams` always in flight
            queue, in_flight = list(prompts), set()
            started = time.perf_counter()
            while queue or engine.busy():
                while queue and len(in_flight) < streams:
                    in_flight.add(admit(engine, queue.pop(0)))
                engine.step()
                for request_id in [i for i in in_flight if i in done]:
                    in_flight.discard(request_id)
                    tally[(name, "sustained")][0] += done.pop(request_id)
            tally[(name, "sustained")][1] += time.perf_counter() - started
    print(f"\n{args.file.name}, {streams} streams, {len(prompts)} prompts x {args.rounds} rounds, {args.tokens} "
          f"tokens at T={args.temperature:g}, {args.threads} threads")
    capped = next((e.strategy for name, e in engines.items() if "measured cap" in name), None)
    if capped is not None:
        print(f"measured cap: {capped.controller.max_tokens} draft tokens a sequence; a step of {streams} "
              f"sequences may verify {capped.step_draft_rows(streams)} draft rows")
    print("| configuration | burst tok/s | / plain | sustained tok/s | / plain | draft forwards, s in them |\n"
          "|---|---|---|---|---|---|")
    rate = {key: tokens / seconds for key, (tokens, seconds) in tally.items()}
    for name, engine in engines.items():
        calls, seconds = (now - then for now, then in zip(draft_work(engine), drafting[name]))
        work = f"{calls:.0f}, {seconds:.2f} s" if calls else "-"
        print(f"| {name} | {rate[(name, 'burst')]:.1f} | {rate[(name, 'burst')] / rate[('plain', 'burst')]:.2f}x | "
              f"{rate[(name, 'sustained')]:.1f} | {rate[(name, 'sustained')] / rate[('plain', 'sustained')]:.2f}x | "
              f"{work} |")


def draft_work(engine: Any) -> tuple[float, float]:
    """(forwards, seconds) the engine's model-running drafters (a draft model) have run so far."""
    drafters = getattr(engine.strategy, "drafters", None) or []
    return (float(sum(getattr(d, "calls", 0) for d in drafters)),
            float(sum(getattr(d, "seconds", 0.0) for d in drafters)))


if __name__ == "__main__":
    main()
