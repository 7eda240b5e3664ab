#!/usr/bin/env python3
"""A draft model as the drafter (issue 39), served for real next to llama.cpp's `--model-draft`, in one run.

  python tools/bench_draft_model.py [--llama-cpp DIR] [--target Q8_0] [--draft Q4_0] [--prompts 6] [--chat 4]
                                    [--tokens 96] [--temperatures 0,1] [--streams 1,4,8] [--economy 1b,3b]

The pair: SmolLM2-135M-Instruct as the target in --target (Q8_0 by default: an F16 file is
served by the torch model, where no draft model runs) and the same weights in --draft (Q4_0) as
the draft model, both made from the shipped Q4_1 GGUF by llama.cpp's own `llama-quantize
--allow-requantize` (from --llama-cpp, see tools/build_llama_cpp.sh) into
~/.cache/outrider-bench/draft and kept. A real pair with real acceptance; at 135M a draft forward
costs about half a target forward, so this pair shows what the cost gate does where drafting
cannot pay, and what acceptance each runtime gets.

1. Single stream. One `outrider serve` with one manifest per row (plain; `drafters: [ngram]`;
   `[model]`; `[ngram, model]`; every row the same target file and options) and `llama-server`
   twice on the same target (plain, and `-md DRAFT`), each request to every row in turn, the row
   order rotated per prompt. Prompts: the first --prompts HumanEval problems and --chat chat
   prompts (bench_spec.py's), the chat ones rendered once with the file's chat template so both
   runtimes get the same text. T=0 and T=1 (seed = prompt index; llama.cpp with top_k 0, top_p 1,
   min_p 0, so both sample the model's plain distribution). Columns: decode tok/s (tokens after
   the first over the time after the first, summed over the prompts: llama.cpp's
   `timings.predicted_per_second` measures the same span), its ratio to the same runtime's plain
   row, tokens per decode step where the runtime says (Outrider's stats; llama.cpp's
   `draft_n_accepted` / steps), and for T=0 whether the output equals plain's (Outrider) token for
   token.
2. --streams: N concurrent greedy streams to the plain, draft-model and n-gram rows, two ways.
   Burst: N requests sent at once (N different prompts); all new tokens over the wall time of
   the batch. Its wall time is the slowest stream's, so gains on the other streams do not count
   while their draft rows slow every step: a lower bound. Sustained: N clients, each sending
   --stream-requests requests back to back (prompts cycled), as a server under steady load sees
   them (vLLM's benchmark_serving --max-concurrency N); a stream that finishes early is replaced
   at once, so every stream's gain counts. All new tokens over the wall time of all. A second
   plain instance ("plain again") runs the same rounds: its ratio to plain is the noise floor.
3. --economy: the random-weight 1B/3B GGUFs of tools/make_gguf.py (Q4_K_M) in this process on the
   native runtime: what one forward of 1 + k rows (a chain, as a drafted path is verified) costs
   against one row after a 512-token context, k = 4, 8, 16; and the served 1B/3B with the n-gram
   drafter and with the tiny random model of the same vocabulary (`tiny`, acceptance near zero) as
   the draft model, greedy, against plain (the never-slower check). With --eagle3, also what an
   EAGLE-3 head of the published shape for each target costs (a random head: its cost does not
   depend on its values): the target's step with its three layers captured, the head's committed
   rows and tree nodes, fp32 and int4.

The CPU, its kernel set and the load are printed; compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

import bench_sizes  # noqa: E402
from bench_sizes import _CHILDREN, START_TIMEOUT_S, cpu_line, llama_bench, outrider_kernels  # noqa: E402
from bench_spec import CHAT, humaneval_prompts  # noqa: E402
from bench_quantize import Server  # noqa: E402
from make_gguf import DEFAULT_DIR, DEFAULT_LLAMA_CPP, ensure  # noqa: E402

FILES = Path.home() / ".cache" / "outrider-bench" / "draft"
SLOTS = 8
LENGTH = 2048
REQUEST_TIMEOUT_S = 600.0

MANIFEST = """name: {name}
backend: llm
model:
  path: {path}
options:
  max_sequences: {slots}
  max_length: {length}
  threads: {threads}
"""


def requantized(llama_cpp: Path, source: Path, ftype: str, threads: int) -> Path:
    """`source` through llama.cpp's quantizer into `ftype`, kept in FILES."""
    FILES.mkdir(parents=True, exist_ok=True)
    out = FILES / f"{source.stem.split('.')[0]}-{ftype}.gguf"
    if not out.exists():
        partial = out.with_suffix(".partial")
        subprocess.run([str(llama_cpp / "bin" / "llama-quantize"), "--allow-requantize", str(source), str(partial),
                        ftype, str(threads)], check=True, capture_output=True)
        partial.rename(out)
    return out


def manifest(directory: Path, name: str, target: Path, threads: int, speculative: Optional[dict]) -> Path:
    text = MANIFEST.format(name=name, path=target, slots=SLOTS, length=LENGTH, threads=threads)
    if speculative is not None:
        text += "speculative: " + json.dumps(speculative) + "\n"
    path = directory / f"{name}.yaml"
    path.write_text(text)
    return path


class LlamaServer(bench_sizes.LlamaServer):
    """bench_sizes' `llama-server` with one slot, optionally with a draft model, asked to sample."""

    def __init__(self, build: Path, target: Path, threads: int, log: Path, draft: Optional[Path] = None) -> None:
        extra = [] if draft is None else ["-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads),
                                          "-tbd", str(threads)]
        super().__init__(build / "bin" / "llama-server", target, threads, log, slots=1, length=LENGTH, extra=extra)

    def sample(self, prompt: str, tokens: int, temperature: float, seed: int) -> dict:
        body = {"prompt": prompt, "n_predict": tokens, "temperature": temperature, "seed": seed, "top_k": 0,
                "top_p": 1.0, "min_p": 0.0, "cache_prompt": False}
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return json.loads(reply.read())


class Row:
    """One configuration's tallies per temperature: decode tokens and seconds, steps, outputs."""

    def __init__(self, name: str, runtime: str, call: Any) -> None:
        self.name, self.runtime, self.call = name, runtime, call
        self.tally: dict[float, dict] = {}

    def measure(self, index: int, prompt: str, tokens: int, temperature: float) -> None:
        got = self.call(prompt, tokens, temperature, index)
        t = self.tally.setdefault(temperature, {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0,
                                                "outputs": {}, "known": True})
        t["tokens"] += got["decoded"]
        t["seconds"] += got["seconds"]
        if got.get("steps") is None:
            t["known"] = False
        else:
            t["steps"] += got["steps"]
            t["accepted"] += got["accepted"]
        t["outputs"][index] = got.get("token_ids")


def outrider_call(client: Any, model: str) -> Any:
    def call(prompt: str, tokens: int, temperature: float, seed: int) -> dict:
        result = client.generate(model, prompt=prompt, max_tokens=tokens, temperature=temperature, seed=seed,
                                 timeout=REQUEST_TIMEOUT_S)
        s = result.stats
        decoded = max(s["new_tokens"] - 1, 0)
        return {"decoded": decoded, "seconds": max(s["seconds"] - s["time_to_first_token"], 1e-9),
                "steps": max(s["steps"] - 1, 0), "accepted": s.get("accepted_tokens", 0),
                "token_ids": result.token_ids}
    return call


def llama_call(server: LlamaServer) -> Any:
    def call(prompt: str, tokens: int, temperature: float, seed: int) -> dict:
        reply = server.sample(prompt, tokens, temperature, seed)
        timings = reply["timings"]
        decoded = max(int(timings["predicted_n"]) - 1, 0)
        seconds = decoded / timings["predicted_per_second"] if timings.get("predicted_per_second") else 1e-9
        accepted = timings.get("draft_n_accepted")
        steps = None if accepted is None else decoded - int(accepted)
        return {"decoded": decoded, "seconds": seconds, "steps": steps, "accepted": accepted or 0}
    return call


def print_table(title: str, rows: list[Row], temperature: float) -> None:
    print(f"\n{title}, T={temperature:g}")
    print(f"{'runtime':<10}{'row':<24}{'decode tok/s':>13}{'x plain':>9}{'tokens/step':>13}{'identical':>11}")
    plain = {r.runtime: r for r in rows if r.name == "plain"}
    for row in rows:
        t = row.tally[temperature]
        base = plain[row.runtime].tally[temperature]
        rate = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
        base_rate = base["tokens"] / base["seconds"] if base["seconds"] else 0.0
        per_step = f"{t['tokens'] / t['steps']:.2f}" if t["known"] and t["steps"] else "-"
        same = "-"
        if temperature == 0 and row.runtime == "outrider" and row.name != "plain":
            same = "yes" if t["outputs"] == base["outputs"] else "NO"
        print(f"{row.runtime:<10}{row.name:<24}{rate:>13.1f}{rate / base_rate:>8.2f}x{per_step:>13}{same:>11}")
    sys.stdout.flush()


def single_stream(args: argparse.Namespace, rows: list[Row], sets: list[tuple[str, list[str]]]) -> None:
    for set_name, prompts in sets:
        for temperature in args.temperatures:
            for row in rows:
                row.tally.pop(temperature, None)
            for i, prompt in enumerate(prompts):
                shift = i % len(rows)
                for row in rows[shift:] + rows[:shift]:
                    row.measure(i, prompt, args.tokens, temperature)
            print_table(f"{set_name}: {len(prompts)} prompts, {args.tokens} new tokens", rows, temperature)


def concurrent(address: str, model: str, prompts: list[str], tokens: int, streams: int, requests: int = 1) -> float:
    """Aggregate decode tok/s of `streams` greedy clients, each sending `requests` requests back to back
    (stream i starts at prompt i and cycles through `prompts`): all new tokens over the wall time of all."""
    from outrider import Client

    done: list[int] = [0] * streams
    errors: list[BaseException] = []
    barrier = threading.Barrier(streams + 1)

    def one(i: int) -> None:
        try:
            with Client(address, timeout=REQUEST_TIMEOUT_S) as client:
                barrier.wait(60)
                for k in range(requests):
                    prompt = prompts[(i + k * streams) % len(prompts)]
                    done[i] += client.generate(model, prompt=prompt, max_tokens=tokens, temperature=0.0,
                                               timeout=REQUEST_TIMEOUT_S).stats["new_tokens"]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    barrier.wait(60)
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(done) / (time.perf_counter() - start)


def economy(args: argparse.Namespace) -> None:
    """Verify cost at the 1B/3B shapes, and the served never-slower check on them."""
    import numpy as np

    from outrider.generation.contract import Chunk
    from outrider_llm import native_c
    from outrider_llm.gguf_tiles import load_gguf_tiles
    from outrider_llm.native_model import load_tiles

    native_c.set_threads(args.threads)
    tiny = ensure("tiny", ["Q4_0"], DEFAULT_DIR, Path(args.llama_cpp), args.threads)["Q4_0"]
    print(f"\nVerify cost on the native runtime ({args.threads} threads): one forward of 1 + k rows (a chain) "
          f"after 512 committed tokens, against 1 row; median of {args.repeats}")
    print("(llama.cpp: llama-bench pp1/pp5/pp9/pp17 at depth 512 on the same file, 3 repetitions, the same ratios)")
    print(f"{'file':<18}{'runtime':<11}{'1 row ms':>10}" + "".join(f"{f'1+{k} rows':>11}" for k in (4, 8, 16)))
    for shape in args.economy:
        path = ensure(shape, ["Q4_K_M"], DEFAULT_DIR, Path(args.llama_cpp), args.threads)["Q4_K_M"]
        model, _ = load_tiles(load_gguf_tiles(path, in_child=False))
        cache = model.new_cache(1, 1024)
        rng = np.random.default_rng(0)
        context = rng.integers(0, 30000, 512)
        model.forward(cache, [Chunk(0, context, np.arange(512))], logit_rows=np.array([511]))
        cache.commit(0, list(range(512)))
        times = {}
        for rows in (1, 5, 9, 17):
            samples = []
            for _ in range(args.repeats):
                tokens = rng.integers(0, 30000, rows)
                start = time.perf_counter()
                model.forward(cache, [Chunk(0, tokens, np.arange(512, 512 + rows))],
                              logit_rows=np.arange(rows))
                samples.append(time.perf_counter() - start)
                cache.commit(0, [])
            times[rows] = statistics.median(samples)
        print(f"{path.name:<18}{'outrider':<11}{times[1] * 1e3:>10.1f}"
              + "".join(f"{times[r] / times[1]:>10.2f}x" for r in (5, 9, 17)))
        if args.eagle3:
            eagle3_cost(model, path.name, args.repeats)
        del model, cache
        if (Path(args.llama_cpp) / "bin" / "llama-bench").exists():
            tests = llama_bench(Path(args.llama_cpp) / "bin" / "llama-bench", path, args.threads,
                                ["-p", "1,5,9,17", "-n", "0", "-d", "512", "-r", "3"])
            ms = {int(t["n_prompt"]): 1e3 * int(t["n_prompt"]) / float(t["avg_ts"]) for t in tests}
            print(f"{path.name:<18}{'llama.cpp':<11}{ms[1]:>10.1f}" + "".join(f"{ms[r] / ms[1]:>10.2f}x" for r in (5, 9, 17)))
        sys.stdout.flush()
    if args.verify_cost_only:
        return
    print(f"\nServed greedy on the same shapes ({args.prompts} HumanEval prompts, {args.tokens} tokens): "
          f"plain, n-gram, and the random `tiny` GGUF of the same vocabulary as the draft model")
    print(f"{'file':<18}{'row':<20}{'decode tok/s':>13}{'x plain':>9}{'tokens/step':>13}")
    from outrider import Client

    prompts = humaneval_prompts(args.prompts)
    for shape in args.economy:
        path = ensure(shape, ["Q4_K_M"], DEFAULT_DIR, Path(args.llama_cpp), args.threads)["Q4_K_M"]
        work = Path(tempfile.mkdtemp(prefix="bench-draft-economy-"))
        specs = [("plain", None), ("n-gram", {"drafters": ["ngram"]}),
                 ("random draft model", {"drafters": ["model"], "model": {"path": str(tiny)}})]
        manifests = [manifest(work, f"e{i}", path, args.threads, s) for i, (_, s) in enumerate(specs)]
        server = Server([str(m) for m in manifests], 0)
        _CHILDREN.append(server.proc)
        try:
            server.wait_ready(START_TIMEOUT_S)
            with Client(server.address, timeout=REQUEST_TIMEOUT_S) as client:
                rows = [Row(name, "outrider", outrider_call(client, f"e{i}")) for i, (name, _) in enumerate(specs)]
                for row in rows:
                    row.call("warm up", 4, 0.0, 0)
                for i, prompt in enumerate(prompts):
                    shift = i % len(rows)
                    for row in rows[shift:] + rows[:shift]:
                        row.measure(i, prompt, args.tokens, 0.0)
            base = rows[0].tally[0.0]
            for row in rows:
                t = row.tally[0.0]
                rate, base_rate = t["tokens"] / t["seconds"], base["tokens"] / base["seconds"]
                print(f"{path.name:<18}{row.name:<20}{rate:>13.1f}{rate / base_rate:>8.2f}x"
                      f"{t['tokens'] / max(t['steps'], 1):>13.2f}")
                sys.stdout.flush()
        finally:
            server.stop()


def eagle3_cost(model: Any, name: str, repeats: int) -> None:
    """What an EAGLE-3 head of the published shape for this target costs next to the target's own step:
    a random head (its cost does not depend on its values; acceptance cannot be measured without a
    real one), the target's forward with its three layers captured, and the head's rows."""
    import numpy as np
    from safetensors.numpy import save_file

    from outrider.generation.contract import Chunk, DrafterContext
    from outrider.generation.sampling import SamplingParams, new_generator
    from outrider_speculative.eagle3 import make_eagle3_drafter

    cfg = model.config
    hidden, heads, kv, inter = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    dim, draft_vocab = hidden // heads, 32000
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float16)

    m = "midlayer."
    tensors = {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": np.ones(hidden, np.float16),
               "lm_head.weight": rand(draft_vocab, hidden), "d2t": np.zeros(draft_vocab, np.int64),
               m + "input_layernorm.weight": np.ones(hidden, np.float16),
               m + "hidden_norm.weight": np.ones(hidden, np.float16),
               m + "post_attention_layernorm.weight": np.ones(hidden, np.float16),
               m + "self_attn.q_proj.weight": rand(heads * dim, 2 * hidden),
               m + "self_attn.k_proj.weight": rand(kv * dim, 2 * hidden),
               m + "self_attn.v_proj.weight": rand(kv * dim, 2 * hidden),
               m + "self_attn.o_proj.weight": rand(hidden, heads * dim),
               m + "mlp.gate_proj.weight": rand(inter, hidden), m + "mlp.up_proj.weight": rand(inter, hidden),
               m + "mlp.down_proj.weight": rand(hidden, inter)}
    folder = Path(tempfile.mkdtemp(prefix="bench-eagle3-"))
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": model.vocab_size, "draft_vocab_size": draft_vocab}))
    head_mb = (folder / "model.safetensors").stat().st_size / 1e6

    def median_ms(call: Any) -> float:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3

    def step_ms() -> float:
        cache = model.new_cache(1, 1024)
        context = rng.integers(0, 30000, 512)
        model.forward(cache, [Chunk(0, context, np.arange(512))], logit_rows=np.array([511]))
        cache.commit(0, list(range(512)))

        def one() -> None:
            model.forward(cache, [Chunk(0, rng.integers(0, 30000, 1), np.array([512]))], logit_rows=np.arange(1))
            cache.commit(0, [])
        return median_ms(one)

    plain = step_ms()
    print(f"  EAGLE-3 head of this shape (random, {draft_vocab}-token draft vocabulary): target step ms plain and "
          f"with three layers captured, head ms per committed row fed, per tree node (and x the target step), "
          f"per 8 nodes in one call")
    print(f"  {'file':<16}{'head':<13}{'MB':>8}{'step':>9}{'captured':>10}{'feed/row':>10}{'node':>9}{'x step':>9}"
          f"{'8 nodes':>10}")
    for quantize in ("none", "int4"):
        drafter = make_eagle3_drafter(model, {"path": str(folder), "quantize": quantize}, DrafterContext())
        captured = step_ms()
        tokens = [int(t) for t in rng.integers(0, 30000, 514)]
        features = rng.standard_normal((512, 3 * hidden), dtype=np.float32)

        class View:  # a greedy SequenceView
            seq_id, token_ids, prompt_length, new_features = "bench", tokens, len(tokens), features
            params, generator, last_hidden = SamplingParams(), new_generator(0), None

        start = time.perf_counter()
        drafter.observe(View())
        drafter.propose(View(), 1)  # the 512 committed rows fed
        feed = (time.perf_counter() - start) * 1e3 / 512
        cache = drafter._caches["bench"]
        drafter._current = cache

        def nodes(n: int) -> Any:
            state = (cache.root[1], (), 513)
            return lambda: (drafter._tentative.clear(), drafter._run([state] * n, [1] * n))

        one, eight = median_ms(nodes(1)), median_ms(nodes(8))
        drafter._current = None
        drafter.finish(View())
        print(f"  {name:<16}{'eagle3 ' + quantize:<13}{head_mb:>8.0f}{plain:>9.1f}{captured:>10.1f}{feed:>10.2f}"
              f"{one:>9.2f}{one / plain:>8.2f}x{eight:>10.2f}")
    model.capture_hidden(())
    shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", default=DEFAULT_LLAMA_CPP, help="llama.cpp build dir (bin/llama-quantize, "
                        "bin/llama-server); default $LLAMA_CPP_BUILD or /work/llamacpp-build")
    parser.add_argument("--target", default="Q8_0", help="the target's llama.cpp file type (one the native "
                        "runtime serves in its own blocks: the draft model runs beside it there)")
    parser.add_argument("--draft", default="Q4_0", help="the draft model's llama.cpp file type")
    parser.add_argument("--prompts", type=int, default=6, help="HumanEval prompts")
    parser.add_argument("--chat", type=int, default=4, help="chat prompts")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--streams", default="", help="comma-separated stream counts, e.g. 1,4,8")
    parser.add_argument("--stream-rounds", type=int, default=3, help="rounds per stream count in --streams")
    parser.add_argument("--stream-requests", type=int, default=4, help="requests per client in --streams' "
                        "sustained rows (0: burst rows only)")
    parser.add_argument("--economy", default="", help="comma-separated make_gguf shapes, e.g. 1b,3b")
    parser.add_argument("--repeats", type=int, default=7, help="forwards per row count in --economy")
    parser.add_argument("--no-llama", action="store_true", help="skip llama-server's rows")
    parser.add_argument("--only-economy", action="store_true", help="only the --economy part")
    parser.add_argument("--verify-cost-only", action="store_true", help="in --economy, skip the served rows")
    parser.add_argument("--eagle3", action="store_true",
                        help="in --economy, also what an EAGLE-3 head of the published shape costs beside the target")
    args = parser.parse_args()
    args.temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    args.economy = [s for s in args.economy.split(",") if s]
    build = Path(args.llama_cpp)

    from outrider import Client
    from outrider_llm.artifact import smollm2_gguf_path

    print(f"$ python tools/bench_draft_model.py {' '.join(sys.argv[1:])}")
    print(f"machine: {cpu_line()}; Outrider kernels: {outrider_kernels()}; load {os.getloadavg()[0]:.1f}")
    if args.only_economy:
        economy(args)
        return
    source = smollm2_gguf_path()
    target = requantized(build, source, args.target, args.threads)
    draft = requantized(build, source, args.draft, args.threads)
    print(f"target {target.name} ({target.stat().st_size / 1e6:.0f} MB), draft {draft.name} "
          f"({draft.stat().st_size / 1e6:.0f} MB), {args.threads} threads")
    # Chat prompts rendered once with the file's template (Outrider's tokenizer), as text for both runtimes.
    from outrider_llm.gguf_tiles import load_gguf_tiles
    from outrider_llm.native_model import load_tiles

    _, tokenizer = load_tiles(load_gguf_tiles(draft, in_child=False))  # the same vocabulary and template
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT[:args.chat]]
    sets = [("HumanEval", humaneval_prompts(args.prompts))] + ([("chat", chat)] if chat else [])
    work = Path(tempfile.mkdtemp(prefix="bench-draft-"))
    specs = [("plain", None), ("n-gram", {"drafters": ["ngram"]}),
             ("draft model", {"drafters": ["model"], "model": {"path": str(draft)}}),
             ("n-gram + draft model", {"drafters": ["ngram", "model"], "model": {"path": str(draft)}})]
    manifests = [manifest(work, f"m{i}", target, args.threads, s) for i, (_, s) in enumerate(specs)]
    if args.streams:  # a second plain instance: the stream rows' noise floor
        manifests.append(manifest(work, "twin", target, args.threads, None))
    server = Server([str(m) for m in manifests], 0)
    _CHILDREN.append(server.proc)
    llamas: list[LlamaServer] = []
    try:
        server.wait_ready(START_TIMEOUT_S)
        with Client(server.address, timeout=REQUEST_TIMEOUT_S) as client:
            rows = [Row(name, "outrider", outrider_call(client, f"m{i}")) for i, (name, _) in enumerate(specs)]
            if not args.no_llama:
                for name, d in (("plain", None), ("draft model", draft)):
                    llama = LlamaServer(build, target, args.threads, work / f"llama-{len(llamas)}.log", d)
                    llama.wait_ready()
                    llamas.append(llama)
                    rows.append(Row(name, "llama.cpp", llama_call(llama)))
            for row in rows:  # untimed
                row.call("def warmup():\n    return", 8, 0.0, 0)
            single_stream(args, rows, sets)
        if args.streams:
            counts = [int(n) for n in args.streams.split(",")]
            prompts = humaneval_prompts(max(counts) * max(1, args.stream_requests))
            for mode, requests in (("burst", 1), ("sustained", args.stream_requests)):
                if requests < 1:
                    continue
                what = ("N requests sent at once" if mode == "burst" else
                        f"N clients x {requests} requests back to back")
                print(f"\nConcurrent greedy streams, {mode} ({what}; HumanEval prompts, {args.tokens} tokens each): "
                      f"aggregate tok/s, median of {args.stream_rounds} rounds")
                print(f"{'streams':>8}{'plain':>10}{'draft model':>13}{'x plain':>9}{'n-gram':>9}{'x plain':>9}"
                      f"{'plain again':>13}{'x plain':>9}")
                for n in counts:
                    rates: dict[str, list[float]] = {"m0": [], "m1": [], "m2": [], "twin": []}
                    for round_ in range(args.stream_rounds):  # order rotated per round: drift hits all alike
                        order = list(rates)[round_ % 4:] + list(rates)[:round_ % 4]
                        for model_name in order:
                            rates[model_name].append(concurrent(server.address, model_name, prompts, args.tokens,
                                                                n, requests))
                    plain, ngram, model, twin = (statistics.median(rates[m]) for m in ("m0", "m1", "m2", "twin"))
                    print(f"{n:>8}{plain:>10.1f}{model:>13.1f}{model / plain:>8.2f}x{ngram:>9.1f}{ngram / plain:>8.2f}x"
                          f"{twin:>13.1f}{twin / plain:>8.2f}x")
                    sys.stdout.flush()
    finally:
        server.stop()
        for llama in llamas:
            llama.stop()
    if args.economy:
        economy(args)


if __name__ == "__main__":
    main()
