#!/usr/bin/env python3
"""What an app asks of its sidecar, measured: structured output and prefix caching on smollm2-int8,
next to llama.cpp (llama-cpp-python: its JSON-schema grammar, and its prompt reuse) on the same
CPU, in one run.

  python tools/bench_structured.py [--llama-cpp DIR] [--gguf FILE] [--grammar-path DIR] [--prompts 8]

1. Grammar: decode tokens/s of smollm2-int8 answering questions as JSON under a schema, and
   without it, plain and with speculation (greedy; identical outputs checked); llama.cpp on its
   Q4_0 of the same model with and without its grammar (LlamaGrammar.from_json_schema).
2. Mask cost per token, in this process, over the tokens of a real constrained answer:
   llguidance (what Outrider uses), and xgrammar / outlines-core where importable (--grammar-path:
   a `pip install --target` directory holding them; optional, never a dependency).
3. Prefix cache: time to first token of a 1,000-token document followed by a question, cold
   (first request) and cached (the same document, another question), medians; a 10-turn chat's
   prefill tokens (prompt tokens minus cached ones) with the cache and with `prefix_cache_mb: 0`;
   llama.cpp's TTFT cold (after reset) and reusing its previous prompt (what `cache_prompt` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

from bench_quantize import Server, _decode_rate, long_prompt  # noqa: E402

MODEL = "smollm2-int8"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}
QUESTIONS = ["Describe a software engineer from Berlin.", "Describe a teacher who lives in Lagos.",
             "Invent a retired pilot.", "Describe a student in Tokyo who speaks three languages.",
             "Describe a chef from Lyon.", "Make up a character for a novel set in Lima.",
             "Describe a farmer from Iowa.", "Invent a musician from Havana.", "Describe a nurse in Manila.",
             "Describe an architect in Dubai.", "Describe a painter from Oslo.", "Invent a detective in Cairo."]
CHAT_TURNS = ["Tell me about the history of tea.", "Where is it grown today?", "How is green tea made?",
              "And black tea?", "Which has more caffeine?", "What is matcha?", "How do I brew it?",
              "What water temperature?", "Any health effects?", "Summarize our talk."]


def _tokenizer():
    from outrider_llm.artifact import artifact_tokenizer, smollm2_gguf_path
    from outrider_llm.conversion import load_weights_artifact

    return artifact_tokenizer(load_weights_artifact(smollm2_gguf_path()))


def bench_grammar(client, prompts: int, tokens: int) -> tuple[list[tuple], list[int]]:
    rows, path = [], []
    for label, constraint in (("no schema", None), ("JSON schema", {"json_schema": SCHEMA})):
        for speculative in (False, True):
            rates, texts = [], []
            for question in QUESTIONS[:prompts]:
                extra = {"constraint": constraint} if constraint else {}
                result = client.generate(MODEL, messages=[{"role": "user", "content": question + " Answer in JSON."}],
                                         max_tokens=tokens, speculative=speculative, **extra)
                rates.append(_decode_rate(result.stats)[0])
                texts.append(result.token_ids)
                if constraint and not path:
                    path = result.token_ids
            rows.append((label, "speculative" if speculative else "plain", statistics.median(rates), texts))
    return rows, path


def mask_costs(path: list[int], grammar_path: str) -> list[tuple[str, str, str]]:
    """(engine, compile ms, mask µs per token) over `path`, a constrained answer's tokens."""
    tokenizer = _tokenizer()
    vocab = tokenizer.vocab_size
    out = []
    from outrider.generation.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer.to_json(), vocab, sorted(tokenizer.eos_token_ids))
    compiler.state("json_schema", {"type": "object"})  # the tokenizer view, built once per model
    begin = time.perf_counter()
    state = compiler.state("json_schema", SCHEMA)
    compile_ms = (time.perf_counter() - begin) * 1e3
    import torch

    row = torch.zeros(vocab)
    begin = time.perf_counter()
    for token in path:  # the mask, applied to a row of logits (as TokenRules.apply does)
        row.masked_fill_(~state.allowed([]), float("-inf"))
        state.commit([token])
    out.append(("llguidance", f"{compile_ms:.1f}", f"{(time.perf_counter() - begin) / len(path) * 1e6:.0f}"))
    for directory in reversed(grammar_path.split(",") if grammar_path else []):
        sys.path.insert(0, directory)
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=sorted(tokenizer.eos_token_ids))
        xcompiler = xgr.GrammarCompiler(info)
        begin = time.perf_counter()
        compiled = xcompiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        compile_ms = (time.perf_counter() - begin) * 1e3
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        logits = torch.zeros(1, vocab)
        begin = time.perf_counter()
        for token in path:  # the mask, applied to a row of logits
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            matcher.accept_token(token)
        out.append(("xgrammar", f"{compile_ms:.1f}", f"{(time.perf_counter() - begin) / len(path) * 1e6:.0f}"))
    except Exception as exc:  # optional reference
        out.append(("xgrammar", "-", f"not measured: {type(exc).__name__}: {str(exc)[:80]}"))
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        eos = min(tokenizer.eos_token_ids)
        mapping: dict[str, list[int]] = {}
        for token in range(vocab):  # outlines keys tokens by the text they decode to
            if token != eos:
                mapping.setdefault(tokenizer.decode([token]), []).append(token)
        begin = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, mapping))
        compile_ms = (time.perf_counter() - begin) * 1e3
        guide = Guide(index)
        begin = time.perf_counter()
        for token in path:
            guide.get_tokens()
            guide.advance(token)
        out.append(("outlines-core", f"{compile_ms:.1f}", f"{(time.perf_counter() - begin) / len(path) * 1e6:.0f}"))
    except Exception as exc:
        out.append(("outlines-core", "-", f"not measured: {type(exc).__name__}: {str(exc)[:80]}"))
    return out


def bench_prefix(client, rounds: int) -> dict:
    document = long_prompt(1000, _tokenizer())
    questions = ["What is this about?", "Summarize it in one line.", "Which function is longest?",
                 "Is there a bug?", "What does it return?", "Name one variable.", "How long is it?"]
    cold, cached = [], []
    for i in range(rounds):
        text = f"[{i}] " + document  # a new document each round: its first request is cold
        first = client.generate(MODEL, prompt=text + "\nQuestion: " + questions[0] + "\nAnswer:", max_tokens=1)
        cold.append(first.stats["time_to_first_token"])
        again = client.generate(MODEL, prompt=text + "\nQuestion: " + questions[1 + i % 6] + "\nAnswer:", max_tokens=1)
        cached.append(again.stats["time_to_first_token"])
        assert again.stats["cached_tokens"] > 0
    return {"tokens": first.stats["prompt_tokens"], "cold": statistics.median(cold),
            "cached": statistics.median(cached), "cached_tokens": again.stats["cached_tokens"]}


def chat_prefill(client) -> tuple[int, int, float]:
    """(prompt tokens, prefilled tokens, seconds) of a 10-turn chat that resends its history."""
    messages, prompt, prefilled = [], 0, 0
    begin = time.perf_counter()
    for turn in CHAT_TURNS:
        messages.append({"role": "user", "content": turn})
        result = client.generate(MODEL, messages=messages, max_tokens=48)
        messages.append({"role": "assistant", "content": result.text})
        prompt += result.stats["prompt_tokens"]
        prefilled += result.stats["prompt_tokens"] - result.stats["cached_tokens"]
    return prompt, prefilled, time.perf_counter() - begin


def _llama_cpp_worker(gguf: str, threads: int, build: str) -> None:
    if build:
        sys.path.insert(0, build)
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    grammar = LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)
    print("ready", flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("reset"):
            llm.reset()
        begin = time.perf_counter()
        first = None
        count = 0
        for _ in llm.create_completion(ask["prompt"], max_tokens=ask["max_tokens"], temperature=0.0, stream=True,
                                       grammar=grammar if ask.get("grammar") else None):
            count += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        rate = (count - 1) / (end - first) if count > 1 else None
        print(json.dumps([rate, (first or end) - begin, count]), flush=True)


class LlamaCppWorker:
    def __init__(self, gguf: Path, threads: int, build: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--llama-cpp-worker", str(gguf), str(threads), build],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not self.proc.stdout.readline().startswith("ready"):
            raise RuntimeError(self.proc.stderr.read()[-300:])

    def ask(self, prompt: str, max_tokens: int, grammar: bool = False, reset: bool = True) -> list:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "grammar": grammar,
                                          "reset": reset}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def llama_cpp_rows(args, chat, document: str) -> dict:
    from bench_native import quantized_file
    from outrider_llm.artifact import smollm2_gguf_path

    gguf = Path(args.gguf) if args.gguf else quantized_file(args.llama_cpp, smollm2_gguf_path(), args.files_dir,
                                                             args.threads, "Q4_0")
    worker = LlamaCppWorker(gguf, args.threads, args.llama_cpp)
    try:
        out: dict = {"file": gguf.name}
        for label, grammar in (("no schema", False), ("JSON schema", True)):
            rates = [worker.ask(chat([{"role": "user", "content": q + " Answer in JSON."}]), args.tokens, grammar)[0]
                     for q in QUESTIONS[:args.prompts]]
            out[label] = statistics.median([r for r in rates if r])
        cold, cached = [], []
        for i in range(args.rounds):
            text = f"[{i}] " + document
            cold.append(worker.ask(text + "\nQuestion: What is this about?\nAnswer:", 1, reset=True)[1])
            cached.append(worker.ask(text + "\nQuestion: Is there a bug?\nAnswer:", 1, reset=False)[1])
        out["cold"], out["cached"] = statistics.median(cold), statistics.median(cached)
        return out
    finally:
        worker.close()


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--llama-cpp-worker":
        _llama_cpp_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", default="", metavar="DIR", help="llama-cpp-python target dir (optional)")
    parser.add_argument("--gguf", default="", help="the GGUF llama.cpp serves (default: SmolLM2's Q4_0, made once)")
    parser.add_argument("--files-dir", default=str(Path.home() / ".cache" / "outrider-bench"))
    parser.add_argument("--grammar-path", default="", help="directories (comma-separated) holding xgrammar / outlines-core (optional)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="")
    args = parser.parse_args()
    from outrider import Client

    tmp = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    off = tmp / "smollm2-int8.yaml"
    off.write_text((ROOT / "manifests/smollm2-int8.yaml").read_text().replace(
        "options:\n", "options:\n  prefix_cache_mb: 0\n", 1))
    results: dict = {}
    for label, manifest in (("on", ROOT / "manifests/smollm2-int8.yaml"), ("off", off)):
        server = Server([str(manifest)], args.threads, args.isa)
        try:
            server.wait_ready()
            with Client(server.address, timeout=600) as client:
                client.generate(MODEL, prompt="warm", max_tokens=4)
                if label == "on":
                    results["grammar"], path = bench_grammar(client, args.prompts, args.tokens)
                    results["prefix"] = bench_prefix(client, args.rounds)
                results[f"chat {label}"] = chat_prefill(client)
        finally:
            server.stop()
    masks = mask_costs(path, args.grammar_path)
    cpp = None
    if args.llama_cpp or _has_llama_cpp():
        try:
            tokenizer = _tokenizer()
            cpp = llama_cpp_rows(args, tokenizer.apply_chat_template, long_prompt(1000, tokenizer))
        except Exception as exc:
            print(f"(llama.cpp not measured: {exc})")

    print(f"\nStructured output, smollm2-int8, {args.prompts} questions answered as JSON, {args.tokens} tokens max, "
          f"greedy, {args.threads} threads; decode tok/s (medians)")
    print(f"{'':<14}{'plain':>10}{'speculative':>13}")
    by = {(r[0], r[1]): r for r in results["grammar"]}
    for label in ("no schema", "JSON schema"):
        print(f"{label:<14}{by[(label, 'plain')][2]:>10.1f}{by[(label, 'speculative')][2]:>13.1f}")
    same = by[("JSON schema", "plain")][3] == by[("JSON schema", "speculative")][3]
    print(f"speculative == plain under the schema: {same}")
    if cpp:
        print(f"llama.cpp ({cpp['file']}): no schema {cpp['no schema']:.1f}, JSON schema {cpp['JSON schema']:.1f} tok/s")
    print(f"\nMask cost per token over a {len(path)}-token constrained answer (this process)")
    print(f"{'engine':<16}{'compile ms':>12}  mask µs/token")
    for engine, compile_ms, cost in masks:
        print(f"{engine:<16}{compile_ms:>12}  {cost}")
    p = results["prefix"]
    print(f"\nPrefix cache: a {p['tokens']}-token prompt (1,000-token document + question), time to first token, "
          f"median of {args.rounds}")
    print(f"{'':<12}{'cold s':>9}{'cached s':>10}{'ratio':>8}")
    print(f"{'outrider':<12}{p['cold']:>9.3f}{p['cached']:>10.3f}{p['cached'] / p['cold']:>7.2f}x"
          f"   ({p['cached_tokens']} tokens from the cache)")
    if cpp:
        print(f"{'llama.cpp':<12}{cpp['cold']:>9.3f}{cpp['cached']:>10.3f}{cpp['cached'] / cpp['cold']:>7.2f}x"
              f"   (its previous prompt reused)")
    on, off_ = results["chat on"], results["chat off"]
    print(f"\n10-turn chat resending its history: prompt tokens {on[0]}; prefilled with the cache {on[1]}, "
          f"without {off_[1]} ({off_[1] / max(on[1], 1):.1f}x); seconds {on[2]:.1f} vs {off_[2]:.1f}")


def _has_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


if __name__ == "__main__":
    main()
