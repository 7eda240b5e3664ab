"""The trainer of the EAGLE-style draft head ("eagle"): collection, training, evaluation, export.

`tools/train_draft.py` is its command line (`build_parser` and `run` here; the tool loads the target
through the llm backend, which this plugin does not import). What the head learns is what *the
target* says next, so every label comes from the target:

1. Self-distillation: the target answers instructions this module writes (chat: explain, list,
   summarize, compare, write a function...; raw code: Python stdlib function headers with their
   docstrings, to complete), greedy and at T=0.7, batched through `LlamaModel.forward` with a KV
   cache. The forward that generates a token also yields the hidden state and the distribution
   at that position, so the generation pass *is* the feature pass: nothing is run twice.
2. Text: windows of the Python standard library's source (`sysconfig.get_paths()["stdlib"]`) and
   documentation (`pydoc_data.topics`, docstrings), run through the target once (prefill).

Each position t gives (h_t = last hidden after the final norm, token t+1, the target's top-8 next-token
distribution at t+1, h_{t+1}). The head reads (h_t, embed(x_{t+1})), and is trained with soft
cross-entropy to the target's distribution (restricted to the draft vocabulary) plus smooth-L1
regression of its feature onto h_{t+1}, unrolled `--unroll` levels deep with its own features fed
back (what it does at drafting time; "training-time test"). The draft vocabulary is the
`--draft-vocab` tokens the target predicts most often in the collected data.

Phases are time-budgeted (`--gen-minutes`, `--text-minutes`, the rest of `--minutes` trains);
checkpoints are written every few minutes; held-out top-1 agreement with the target (10% of the
sequences, and separately instructions no template produces: "unseen") is printed per depth, and
the weights that did best on the unseen instructions are kept. The result is safetensors (fp16
layers + draft vocabulary; the LM head and embeddings are the target's, not stored) with metadata:
the target's fingerprint (`outrider_speculative.eagle.target_fingerprint`), config and a training
summary.

The plugin's `__init__` does not import this module (it imports torch): only the tool and tests do.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import math
import random
import sysconfig
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F

from outrider.generation.contract import Chunk
from outrider.hardware import cpu_has_bf16_instructions

from .eagle import DraftHead, CompiledHead, save_head
from .draft_head import DEFAULT_WEIGHTS, HeadConfig, target_fingerprint

TOP_K = 8  # target probabilities kept per position (the soft label)
SOURCES = ("chat", "code", "text")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cpu_runs_bf16_natively() -> bool:
    """True when oneDNN can run bf16 matmuls in hardware (AVX512-BF16 or AMX): then bf16 autocast
    pays. The same test as the llm backend's `outrider_llm.linear.cpu_has_native_bf16`."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except Exception:
        return False
    return cpu_has_bf16_instructions()


# ---- collected features ---------------------------------------------------------------------------


@dataclass
class Features:
    """Per-position target outputs, segments concatenated (a segment = one sequence)."""

    tokens: torch.Tensor  # int64 [N]  token fed at each position
    hidden: torch.Tensor  # fp16 [N, H]  target's last hidden (after the final norm) there
    top_ids: torch.Tensor  # int32 [N, TOP_K]  the target's most likely next tokens
    top_probs: torch.Tensor  # fp16 [N, TOP_K]  and their probabilities (T = 1)
    segments: torch.Tensor  # int64 [S, 4]: start, end, source index (SOURCES), held out (1: never trained on)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def save(self, path: "str | Path") -> None:
        """safetensors (no pickle)."""
        from safetensors.torch import save_file

        save_file({k: getattr(self, k).contiguous() for k in ("tokens", "hidden", "top_ids", "top_probs", "segments")}, str(path))

    @classmethod
    def load(cls, path: "str | Path") -> "Features":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        if tensors["segments"].shape[1] == 3:  # written before the held-out column existed
            tensors["segments"] = torch.cat([tensors["segments"], torch.zeros_like(tensors["segments"][:, :1])], 1)
        return cls(**tensors)

    @classmethod
    def concat(cls, parts: list["Features"]) -> "Features":
        offset, segments = 0, []
        for part in parts:
            seg = part.segments.clone()
            seg[:, :2] += offset
            segments.append(seg)
            offset += len(part)
        return cls(torch.cat([p.tokens for p in parts]), torch.cat([p.hidden for p in parts]),
                   torch.cat([p.top_ids for p in parts]), torch.cat([p.top_probs for p in parts]), torch.cat(segments))

    def counts(self) -> dict[str, int]:
        """Positions per source."""
        out = {}
        for i, name in enumerate(SOURCES):
            seg = self.segments[self.segments[:, 2] == i]
            out[name] = int((seg[:, 1] - seg[:, 0]).sum())
        return out


class FeatureStore:
    """Accumulates segments while the target runs."""

    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.top_ids: list[torch.Tensor] = []
        self.top_probs: list[torch.Tensor] = []
        self.segments: list[tuple[int, int, int, int]] = []
        self.size = 0

    def add(self, tokens: list[int], hidden: torch.Tensor, logits: Any, source: str, keep_from: int = 0,
            held_out: bool = False) -> None:
        """One sequence: tokens fed, their hidden states [n, H] and next-token logits [n, V] (or top-k pairs)."""
        n = len(tokens) - keep_from
        if n < 3:
            return
        if isinstance(logits, tuple):
            ids, probs = logits
        else:
            ids, probs = top_k(logits)
        self.tokens.append(torch.tensor(tokens[keep_from:], dtype=torch.long))
        self.hidden.append(hidden[keep_from:].to(torch.float16))
        self.top_ids.append(ids[keep_from:])
        self.top_probs.append(probs[keep_from:])
        self.segments.append((self.size, self.size + n, SOURCES.index(source), int(held_out)))
        self.size += n

    def features(self) -> Features:
        hidden_size = self.hidden[0].shape[1] if self.hidden else 1
        if not self.tokens:
            return Features(torch.zeros(0, dtype=torch.long), torch.zeros(0, hidden_size, dtype=torch.float16),
                            torch.zeros(0, TOP_K, dtype=torch.int32), torch.zeros(0, TOP_K, dtype=torch.float16),
                            torch.zeros(0, 4, dtype=torch.long))
        return Features(torch.cat(self.tokens), torch.cat(self.hidden), torch.cat(self.top_ids),
                        torch.cat(self.top_probs), torch.tensor(self.segments, dtype=torch.long))


def top_k(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's TOP_K most likely tokens and their probabilities at T = 1, per row."""
    top = torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


# ---- running the target -------------------------------------------------------------------------


@dataclass
class Prompt:
    ids: list[int]
    source: str  # "chat" or "code"
    temperature: float
    keep_from: int = 0  # positions before this are not kept (a chat template's fixed system prompt)
    max_new: int = 128
    held_out: bool = False  # evaluation only (never trained on)


@dataclass
class _Running:
    prompt: Prompt
    ids: list[int]
    generator: torch.Generator
    fed: int = 0
    hidden: list = field(default_factory=list)
    top: list = field(default_factory=list)


def generate(model: Any, prompts: Iterable[Prompt], store: FeatureStore, deadline: float, eos: set[int],
             batch: int = 32, max_length: int = 512, seed: int = 0) -> dict[str, int]:
    """Self-distillation: the target answers `prompts`, `batch` at a time (continuous batching).

    Every forward's hidden states and distributions are recorded as it goes (the generation pass is
    the feature pass). Stops admitting at `deadline` and finishes what runs then.
    """
    cache = model.new_cache(batch, max_length)
    queue = deque(prompts)
    free = list(range(batch - 1, -1, -1))
    active: dict[int, _Running] = {}
    done = tokens = steps = 0
    while queue or active:
        while free and queue and time.monotonic() < deadline:
            prompt = queue.popleft()
            if len(prompt.ids) + 8 >= max_length:
                continue
            slot = free.pop()
            cache.reset(slot)
            active[slot] = _Running(prompt, list(prompt.ids), torch.Generator().manual_seed(seed + done + len(active)))
        if not active:
            break
        if time.monotonic() >= deadline + 60:  # a stuck tail never holds the run
            for slot in list(active):
                _finish(store, active.pop(slot))
            break
        slots = list(active)
        chunks = []
        for slot in slots:
            run = active[slot]
            new = run.ids[run.fed:]
            chunks.append(Chunk(slot, torch.tensor(new), torch.arange(run.fed, run.fed + len(new))))
        out = model.forward(cache, chunks)
        steps += 1
        offset = 0
        for slot, chunk in zip(slots, chunks):
            run = active[slot]
            n = len(chunk.tokens)
            cache.commit(slot, list(range(n)))
            logits = out.logits[offset:offset + n]
            run.hidden.append(out.hidden[offset:offset + n].to(torch.float16))
            run.top.append(top_k(logits))
            offset += n
            run.fed += n
            last = logits[-1]
            if run.prompt.temperature <= 0:
                token = int(torch.argmax(last))
            else:
                probs = torch.softmax(last / run.prompt.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=run.generator))
            tokens += 1
            run.ids.append(token)
            generated = len(run.ids) - len(run.prompt.ids)
            if token in eos or generated >= run.prompt.max_new or len(run.ids) >= max_length - 1:
                _finish(store, active.pop(slot))
                free.append(slot)
                done += 1
    return {"sequences": done, "generated_tokens": tokens, "steps": steps}


def _finish(store: FeatureStore, run: _Running) -> None:
    ids = run.ids[:run.fed]
    top_ids = torch.cat([t[0] for t in run.top])
    top_probs = torch.cat([t[1] for t in run.top])
    store.add(ids, torch.cat(run.hidden), (top_ids, top_probs), run.prompt.source, run.prompt.keep_from,
              run.prompt.held_out)


def prefill_texts(model: Any, windows: Iterable[list[int]], store: FeatureStore, deadline: float) -> dict[str, int]:
    """Run the target over token windows (one forward each) and record every position."""
    cache = model.new_cache(1, max(512, 1))
    count = tokens = 0
    for ids in windows:
        if time.monotonic() >= deadline:
            break
        if len(ids) > cache.max_length:
            cache = model.new_cache(1, len(ids))
        cache.reset(0)
        out = model.forward(cache, [Chunk(0, torch.tensor(ids), torch.arange(len(ids)))])
        cache.commit(0, [])
        store.add(ids, out.hidden, out.logits, "text")
        count += 1
        tokens += len(ids)
    return {"windows": count, "tokens": tokens}


# ---- what to run it on -----------------------------------------------------------------------------

SUBJECTS = [
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "climate change",
    "the stock market", "vaccines", "the Roman Empire", "volcanoes", "blockchain", "the immune system",
    "electric cars", "the printing press", "plate tectonics", "inflation", "social media", "honeybees",
    "the moon landing", "recycling", "quantum computing", "the human heart", "renewable energy",
    "the internet", "ancient Egypt", "nutrition", "coral reefs", "democracy", "gravity",
    "antibiotics", "jazz music", "the Olympic Games", "deserts", "time zones", "cloud computing",
    "the Renaissance", "earthquakes", "meditation", "supply and demand", "the solar system", "DNA",
    "rainforests", "public speaking", "personal budgeting", "chess", "the Great Wall of China",
    "electricity", "friendship", "learning a new language", "gardening", "dinosaurs", "the ocean",
    "coffee", "bread baking", "photography", "running a marathon", "the piano", "penguins", "tigers",
    "volunteering", "video games", "job interviews", "moving to a new city", "composting", "bicycles",
    "airplanes", "trains", "the Amazon river", "Mount Everest", "the Arctic", "chocolate", "tea",
    "soccer", "basketball", "yoga", "minimalism", "procrastination", "teamwork", "leadership",
    "artificial intelligence", "smartphones", "password security", "open source software", "databases",
    "the Python programming language", "spreadsheets", "email etiquette", "mountains", "rivers",
    "wolves", "owls", "mushrooms", "the human brain", "memory", "happiness", "stress", "kindness",
    "city planning", "public libraries", "museums", "the theater", "poetry", "comic books", "robots",
]
TASK_TEMPLATES = [
    "Explain {s} in simple terms.", "What is {s}? Answer in two or three sentences.",
    "List five interesting facts about {s}.", "Summarize the most important ideas about {s}.",
    "Write a short paragraph about {s} for a school newsletter.", "What are the pros and cons of {s}?",
    "Write a short poem about {s}.", "How would you explain {s} to a child?", "Describe the history of {s} briefly.",
    "Write a tweet about {s}.", "What are common misconceptions about {s}?", "Compare {s} and {t}.",
    "Give me a step-by-step plan to learn about {s}.", "Write a short story that involves {s}.",
    "Write a funny short story about {s}.", "Give me three tips related to {s}.",
    "Why do people care about {s}?", "Write a haiku about {s}.", "Tell me something surprising about {s}.",
    "Write a dialogue between two friends talking about {s}.", "Write a product description for a book about {s}.",
    "What questions should I ask an expert on {s}?", "Describe {s} in one sentence, then in one paragraph.",
    "Write a motivational message that mentions {s}.", "How is {s} related to {t}?",
    "Give me a quiz with three questions about {s}.", "Write a short blog post introduction about {s}.",
    "What would the world be like without {s}?", "Explain {s} using an analogy.",
    "Write a limerick about {s}.", "What are the key terms someone should know about {s}?",
    "Write an email inviting colleagues to a talk on {s}.", "Give me a fun fact about {s} and explain it.",
    "I am bored. Suggest an activity related to {s}.", "Write the opening lines of a speech about {s}.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list while keeping order",
    "computes the factorial of n", "finds the largest element in a list", "checks whether a string is a palindrome",
    "flattens a nested list", "converts Celsius to Fahrenheit", "returns the word frequencies of a text",
    "sorts a list of dictionaries by a key", "reads a CSV file and returns its rows", "computes the mean and median of a list",
    "validates an email address with a regular expression", "implements binary search", "transposes a matrix",
    "returns all permutations of a list", "checks whether two strings are anagrams", "computes the greatest common divisor",
    "converts a Roman numeral to an integer", "chunks a list into pieces of size n", "finds the longest common prefix of strings",
    "implements a stack class", "parses a date string into a datetime", "sums the digits of an integer",
    "rotates a list by k positions", "counts lines in a file", "implements bubble sort", "capitalizes every word",
    "returns the second largest number in a list", "checks if parentheses are balanced", "converts a number to binary",
    "finds all even numbers in a list", "computes the area of a circle", "shuffles a list", "zips two lists into a dict",
]
CODE_TEMPLATES = [
    "Write a Python function that {c}.", "Write a Python function that {c}, with a docstring and an example.",
    "How do I write a function in Python that {c}? Show the code.", "Write a JavaScript function that {c}.",
    "Explain how to write a program that {c}, then give the Python code.",
    "Write a Python function that {c} and a few unit tests for it.", "Write a one-line Python expression that {c}.",
    "What is wrong with this approach: a loop that {c}? Show a better Python version.",
]
OTHER = [
    "Tell me a joke.", "What is the capital of France?", "Give me a recipe for pancakes.",
    "Translate 'good morning, how are you?' into Spanish and French.", "What is 17 times 23?",
    "Suggest five names for a coffee shop.", "How do I change a flat tire?",
    "What should I consider when buying a laptop?", "Give me a workout plan for beginners.",
    "What is the difference between weather and climate?", "How can I improve my handwriting?",
    "Write a thank-you note to a teacher.", "Explain what a for loop is in Python.",
    "What does HTTP stand for and how does it work?", "Convert 5 miles to kilometers.",
    "Write a SQL query that selects the ten most recent orders.", "Explain the difference between a list and a tuple in Python.",
    "What is recursion? Give an example.", "Write a riddle and its answer.", "Plan a birthday party for a ten-year-old.",
    "Rewrite this sentence to sound more formal: 'gonna be late, sorry'.", "Give me a packing list for a beach holiday.",
    "What are good habits for studying?", "Write a short bedtime story.", "How do I politely decline an invitation?",
    "What is the Pythagorean theorem?", "Write a grocery list for a week of healthy meals.",
    "Describe a sunset without using the word 'sun'.", "How many minutes are in a week? Show your work.",
    "What are three ways to save water at home?", "Write a cover letter opening for a junior developer job.",
]
# Instructions that no template above produces: held out, to measure how the head generalizes.
UNSEEN = [
    "Describe your ideal weekend.", "What makes a good leader?", "Write a dialogue between a cat and a dog.",
    "How does a bicycle work?", "Why is the ocean salty?", "Give me advice for my first day at a new job.",
    "Write a letter to my future self.", "What is the meaning of the word 'serendipity'?",
    "How do airplanes stay in the air?", "Invent a new holiday and describe how people celebrate it.",
    "What should I do if I cannot fall asleep?", "Explain how a refrigerator keeps food cold.",
    "Write a short mystery story set in a library.", "What are the benefits of reading every day?",
    "How do I make friends as an adult?", "Write a Python function that returns the common elements of two lists.",
    "Describe the life cycle of a butterfly.", "Why do leaves change color in autumn?",
    "Give me a simple explanation of how vaccines work.", "Write a song chorus about the rain.",
    "How can a small town attract more tourists?", "Write instructions for making a paper airplane.",
    "What would happen if the moon disappeared?", "Write a Python class that represents a bank account.",
]


def chat_instructions(rng: random.Random, count: int) -> list[str]:
    """A varied, shuffled set of instructions: task templates x subjects, code requests, one-offs."""
    pairs = [(t, s) for t in TASK_TEMPLATES for s in SUBJECTS]
    rng.shuffle(pairs)
    code = [t.format(c=c) for t in CODE_TEMPLATES for c in CODE_TASKS]
    rng.shuffle(code)
    n_code = max(1, count // 6)
    subject = [t.format(s=s, t=rng.choice(SUBJECTS)) for t, s in pairs[:max(0, count - n_code - len(OTHER))]]
    chosen = OTHER + code[:n_code] + subject
    rng.shuffle(chosen)
    return chosen[:count]


def stdlib_files(rng: random.Random) -> list[Path]:
    """The standard library's .py files (no site-packages), shuffled."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [Path(p) for p in glob.glob(str(stdlib / "**" / "*.py"), recursive=True)
             if "site-packages" not in p and "__pycache__" not in p and "lib2to3/tests/data" not in p]
    files = [p for p in files if 200 < p.stat().st_size < 300_000]
    files.sort()
    rng.shuffle(files)
    return files


def code_prompts(files: list[Path], rng: random.Random, count: int) -> list[str]:
    """Function headers with their docstrings from the stdlib (the function body is left to the target)."""
    out: list[str] = []
    for path in files:
        if len(out) >= count:
            break
        if "/test" in str(path) or "/idlelib/" in str(path):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and ast.get_docstring(n)
                 and 40 <= len(ast.get_docstring(n)) <= 600 and not n.name.startswith("_")]
        if not funcs:
            continue
        func = rng.choice(funcs)
        doc = func.body[0]
        header = "\n".join(lines[func.lineno - 1 - len(func.decorator_list):doc.end_lineno])
        out.append(header.rstrip() + "\n")
    return out


def text_windows(tokenizer: Any, files: list[Path], rng: random.Random, window: int = 512) -> Iterable[list[int]]:
    """Token windows, about 2 of source code for every 1 of documentation, in a fixed shuffled order."""
    import pydoc_data.topics

    docs = list(pydoc_data.topics.topics.values())
    rng.shuffle(docs)

    def source_windows():
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            ids = tokenizer.encode(text)
            # One window per file (a random one): more files, more variety per minute.
            if len(ids) < 64:
                continue
            start = rng.randrange(0, max(1, len(ids) - window + 1))
            yield ids[start:start + window]

    def doc_windows():
        for text in docs:
            ids = tokenizer.encode(text)
            for start in range(0, len(ids) - 63, window):
                yield ids[start:start + window]
        for path in files:  # then docstrings, as prose
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, SyntaxError, ValueError, OSError):
                continue
            parts = [ast.get_docstring(n) for n in ast.walk(tree)
                     if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n)]
            ids = tokenizer.encode("\n\n".join(p for p in parts if len(p) > 80))
            if len(ids) >= 64:
                yield ids[:window]

    code, prose = source_windows(), doc_windows()
    while True:
        got = [w for w in (next(code, None), next(code, None), next(prose, None)) if w is not None]
        if not got:
            return
        yield from got


def build_prompts(tokenizer: Any, rng: random.Random, n_chat: int, n_code: int, files: list[Path],
                  max_new: int = 128) -> list[Prompt]:
    """Chat prompts (half greedy, half T=0.7; the fixed system prompt dropped), raw code prompts
    (greedy), and the UNSEEN instructions (held out: they measure generalization), interleaved."""
    first = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "a"}]))
    second = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "b"}]))
    common = next((i for i, (x, y) in enumerate(zip(first, second)) if x != y), 0)
    keep_from = max(0, common - 4)  # keep the user turn's start marker

    def chat(text: str, temperature: float, held_out: bool = False) -> Prompt:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        return Prompt(ids, "chat", temperature, keep_from, max_new, held_out)

    chats = [chat(text, 0.0 if i % 2 == 0 else 0.7) for i, text in enumerate(chat_instructions(rng, n_chat))]
    codes = [Prompt(tokenizer.encode(text), "code", 0.0, 0, max_new) for text in code_prompts(files, rng, n_code)]
    unseen = [chat(text, 0.0, held_out=True) for text in UNSEEN]
    # Interleave so that a time budget cut anywhere keeps the mix; held-out prompts go first.
    out, ratio = list(unseen), max(1, len(chats) // max(1, len(codes)))
    while chats or codes:
        out.extend(chats[:ratio])
        del chats[:ratio]
        if codes:
            out.append(codes.pop(0))
    return out


def collect(model: Any, tokenizer: Any, gen_minutes: float, text_minutes: float, seed: int = 0,
            batch: int = 48, n_chat: int = 2400, n_code: int = 400) -> tuple[Features, dict[str, Any]]:
    """Phases 1 and 2: self-distillation, then stdlib text; each within its time budget."""
    rng = random.Random(seed)
    files = stdlib_files(rng)
    prompts = build_prompts(tokenizer, rng, n_chat, n_code, files)
    log(f"self-distillation: {len(prompts)} prompts ready, {gen_minutes:.1f} min budget, batch {batch}")
    store = FeatureStore()
    start = time.monotonic()
    gen = generate(model, prompts, store, start + gen_minutes * 60, set(tokenizer.eos_token_ids), batch=batch,
                   max_length=384, seed=seed)
    gen["seconds"] = round(time.monotonic() - start, 1)
    log(f"self-distillation: {gen}, {store.size} positions kept")
    start = time.monotonic()
    text = prefill_texts(model, text_windows(tokenizer, files, rng), store, start + text_minutes * 60)
    text["seconds"] = round(time.monotonic() - start, 1)
    log(f"stdlib text: {text}, {store.size} positions in all")
    return store.features(), {"generation": gen, "text": text}


# ---- training ---------------------------------------------------------------------------------------


def choose_draft_vocab(features: Features, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` tokens the target predicts (top-1) most often, then the most frequent inputs; sorted ids."""
    size = min(size, vocab_size)
    counts = torch.bincount(features.top_ids[:, 0].long(), minlength=vocab_size).double()
    counts += 0.01 * torch.bincount(features.tokens, minlength=vocab_size).double()  # ties: frequent inputs
    counts += 1e-6 * torch.arange(vocab_size, 0, -1, dtype=torch.double)  # then low ids (deterministic)
    return torch.topk(counts, size).indices.sort().values


def split(features: Features, holdout_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks over positions: train / held-out (every `holdout_every`-th segment)."""
    held = torch.zeros(len(features), dtype=torch.bool)
    for i, (start, end, _, unseen) in enumerate(features.segments.tolist()):
        if unseen or i % holdout_every == holdout_every - 1:
            held[start:end] = True
    return ~held, held


def valid_starts(features: Features, depth: int, mask: torch.Tensor) -> torch.Tensor:
    """Positions p with p + depth still inside p's segment (and in `mask`)."""
    remaining = torch.zeros(len(features), dtype=torch.long)
    for start, end, *_ in features.segments.tolist():
        remaining[start:end] = torch.arange(end - start - 1, -1, -1)
    return torch.nonzero(mask & (remaining >= depth)).flatten()


@dataclass
class TrainConfig:
    intermediate_size: int = 1536
    num_blocks: int = 1
    draft_vocab: int = 8192  # covers ~97% of the target's top-1 (16k: ~98.4%), half the cost per call
    unroll: int = 3
    depth_weights: tuple[float, ...] = (1.0, 0.7, 0.5, 0.4, 0.3)
    reg_weight: float = 1.0
    noise: float = 0.1
    lr: float = 1e-3
    batch: int = 256
    warmup_steps: int = 100
    precision: str = "auto"  # bf16 autocast where the CPU has native bf16, else fp32
    seed: int = 0


class Trainer:
    """Trains a DraftHead on Features, time-budgeted; evaluates held-out top-1 per depth."""

    def __init__(self, model: Any, features: Features, cfg: TrainConfig, draft_vocab: Optional[torch.Tensor] = None) -> None:
        self.model, self.features, self.cfg = model, features, cfg
        torch.manual_seed(cfg.seed)
        self.draft_vocab = draft_vocab if draft_vocab is not None else choose_draft_vocab(features, cfg.draft_vocab, model.vocab_size)
        k = self.draft_vocab.numel()
        self.to_draft = torch.full((model.vocab_size,), -1, dtype=torch.long)
        self.to_draft[self.draft_vocab] = torch.arange(k)
        self.lm_rows = model.embed(self.draft_vocab).float()  # tied LM head rows (see eagle.lm_rows_for)
        self.head = DraftHead(HeadConfig(model.hidden_size, cfg.intermediate_size, k, cfg.num_blocks,
                                         float(getattr(model.config, "rms_norm_eps", 1e-5))))
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and cpu_runs_bf16_natively())
        self.train_mask, self.held_mask = split(features)
        self.train_starts = valid_starts(features, cfg.unroll, self.train_mask)
        self.hidden_scale = float(features.hidden[:20000].float().pow(2).mean().sqrt()) if len(features) else 1.0
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
        self.steps = 0
        self.seen = 0
        self.seconds = 0.0
        self.history: list[dict] = []
        self.best: Optional[tuple[float, dict, int]] = None  # (score, weights, step) of the best evaluation
        self.best_step: Optional[int] = None

    def coverage(self) -> float:
        """Share of the target's top-1 predictions that the draft vocabulary holds."""
        return float((self.to_draft[self.features.top_ids[:, 0].long()] >= 0).float().mean())

    def _soft_labels(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.to_draft[self.features.top_ids[rows].long()]
        probs = self.features.top_probs[rows].float() * (ids >= 0)
        mass = probs.sum(-1, keepdim=True)
        dense = torch.zeros(rows.numel(), self.draft_vocab.numel())
        dense.scatter_add_(1, ids.clamp_min(0), probs / mass.clamp_min(1e-6))
        return dense, (mass.squeeze(-1) > 0.05).float()

    def step(self, starts: torch.Tensor, lr: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = lr
        f = self.features
        h = f.hidden[starts].float()
        if self.cfg.noise:
            h = h + (torch.rand_like(h) * 2 - 1) * self.cfg.noise
        loss = torch.zeros(())
        for k in range(1, self.cfg.unroll + 1):
            rows = starts + k
            embeds = self.model.embed(f.tokens[rows])
            target, weight = self._soft_labels(rows)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                feat = self.head(h, embeds)
                logits = DraftHead.logits(feat, self.lm_rows)
            feat = feat.float()
            ce = -(target * torch.log_softmax(logits.float(), -1)).sum(-1)
            ce = (ce * weight).sum() / weight.sum().clamp_min(1)
            reg = F.smooth_l1_loss(feat / self.hidden_scale, f.hidden[rows].float() / self.hidden_scale)
            w = self.cfg.depth_weights[min(k - 1, len(self.cfg.depth_weights) - 1)]
            loss = loss + w * (ce + self.cfg.reg_weight * reg)
            h = feat
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        self.steps += 1
        self.seen += starts.numel()
        return loss.item()

    def train(self, minutes: float, checkpoint: Optional[Any] = None, checkpoint_minutes: float = 3.0,
              eval_minutes: float = 2.0) -> None:
        """Train for `minutes` (cosine learning rate over the budget); `checkpoint(trainer)` every few minutes."""
        cfg = self.cfg
        budget = minutes * 60
        gen = torch.Generator().manual_seed(cfg.seed)
        perm, cursor = torch.randperm(self.train_starts.numel(), generator=gen), 0
        start = time.monotonic()
        last_ckpt = last_eval = start
        losses: list[float] = []
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= budget:
                break
            if cursor + cfg.batch > perm.numel():
                perm, cursor = torch.randperm(self.train_starts.numel(), generator=gen), 0
            starts = self.train_starts[perm[cursor:cursor + cfg.batch]]
            cursor += cfg.batch
            progress = elapsed / budget
            lr = cfg.lr * min(1.0, (self.steps + 1) / cfg.warmup_steps) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
            losses.append(self.step(starts, lr))
            now = time.monotonic()
            if now - last_eval >= eval_minutes * 60:
                last_eval = now
                ev = self.evaluate(max_starts=2000)
                unseen = self.evaluate(max_starts=2000, sources=["unseen"])
                self._keep_best(unseen if unseen["starts"] else ev)
                self.history.append({"minute": round((now - start) / 60, 2), "loss": round(sum(losses) / len(losses), 4),
                                     **ev, "unseen": unseen})
                log(f"step {self.steps} ({self.seen} starts, {self.seen / max(1, self.train_starts.numel()):.2f} epochs) "
                    f"loss {sum(losses) / len(losses):.3f} held-out top-1 {ev['top1']}, unseen prompts "
                    f"{unseen['top1']} (chain {unseen.get('chain_accepted')})")
                losses = []
            if checkpoint is not None and now - last_ckpt >= checkpoint_minutes * 60:
                last_ckpt = now
                checkpoint(self)
        self.seconds += time.monotonic() - start
        if self.best is not None:  # the last weights, unless an earlier evaluation generalized better
            unseen = self.evaluate(max_starts=2000, sources=["unseen"])
            self._keep_best(unseen if unseen["starts"] else self.evaluate(max_starts=2000))
            score, state, step = self.best
            self.head.load_state_dict(state)
            self.best_step = step
            log(f"keeping the weights of step {step} (held-out chain acceptance {score})")

    def _keep_best(self, evaluation: dict[str, Any]) -> None:
        score = evaluation.get("chain_accepted", 0.0)
        if self.best is None or score > self.best[0]:
            self.best = (score, {k: v.clone() for k, v in self.head.state_dict().items()}, self.steps)

    @torch.no_grad()
    def evaluate(self, depth: int = 3, max_starts: int = 6000, sources: Optional[list[str]] = None) -> dict[str, Any]:
        """Held-out top-1 agreement with the target per depth (own features fed back, true tokens)."""
        f = self.features
        mask = self.held_mask.clone()
        if sources is not None:  # source names, or "unseen": the held-out UNSEEN instructions
            keep = torch.zeros_like(mask)
            for s, e, src, unseen in f.segments.tolist():
                if SOURCES[src] in sources or (unseen and "unseen" in sources):
                    keep[s:e] = True
            mask &= keep
        starts = valid_starts(f, depth, mask)
        if starts.numel() == 0:
            return {"top1": [], "starts": 0}
        if starts.numel() > max_starts:
            starts = starts[torch.randperm(starts.numel(), generator=torch.Generator().manual_seed(1))[:max_starts]]
        self.head.eval()
        hits = []
        h = f.hidden[starts].float()
        chain = torch.ones(starts.numel())
        expected = torch.zeros(starts.numel())
        for k in range(1, depth + 1):
            rows = starts + k
            feat = self.head(h, self.model.embed(f.tokens[rows]))
            pred = self.draft_vocab[DraftHead.logits(feat, self.lm_rows).argmax(-1)]
            hit = (pred == f.top_ids[rows, 0].long()).float()
            hits.append(round(float(hit.mean()), 4))
            # Chain acceptance where the next true token is the target's own top-1 (greedy text).
            chain = chain * hit
            expected += chain
            h = feat
        self.head.train()
        return {"top1": hits, "starts": int(starts.numel()), "chain_accepted": round(float(expected.mean()), 3)}


def head_ms(model: Any, trainer: Trainer, rows: int = 8, repeat: int = 50) -> float:
    """Milliseconds per drafting call (`rows` frontier nodes) of the trained head, as the drafter runs it."""
    compiled = CompiledHead(trainer.head, trainer.lm_rows, model, getattr(model, "dtype", torch.float32))
    h = torch.randn(rows, model.hidden_size)
    e = model.embed(torch.arange(rows))
    for _ in range(5):
        compiled(h, e)
    start = time.perf_counter()
    for _ in range(repeat):
        compiled(h, e)
    return (time.perf_counter() - start) / repeat * 1e3


def summary_of(trainer: Trainer, data: dict[str, Any], collect_seconds: float) -> dict[str, Any]:
    f = trainer.features
    return {
        "positions": len(f),
        "positions_by_source": f.counts(),
        "train_starts": int(trainer.train_starts.numel()),
        "collection": data,
        "collect_minutes": round(collect_seconds / 60, 2),
        "train_minutes": round(trainer.seconds / 60, 2),
        "steps": trainer.steps,
        "kept_step": trainer.best_step,
        "epochs": round(trainer.seen / max(1, trainer.train_starts.numel()), 2),
        "draft_vocab": int(trainer.draft_vocab.numel()),
        "draft_vocab_coverage": round(trainer.coverage(), 4),
        "config": {k: v for k, v in vars(trainer.cfg).items()},
        "history": trainer.history,
        "torch": torch.__version__,
    }


# ---- the command line's run ----------------------------------------------------------------------


def compare(model: Any, features: Features, minutes: float, base: TrainConfig) -> None:
    """Train a few head shapes for `minutes` each on the same data; print held-out top-1 and cost."""
    variants = [
        ("MLP 1536 x1, unroll 3", {}),
        ("MLP 768 x1, unroll 3", {"intermediate_size": 768}),
        ("MLP 1536 x2, unroll 3", {"num_blocks": 2}),
        ("MLP 1536 x1, unroll 1 (EAGLE-1)", {"unroll": 1}),
        ("MLP 1536 x1, unroll 3, reg 0.1", {"reg_weight": 0.1}),
        ("MLP 1536 x1, unroll 3, vocab 8k", {"draft_vocab": 8192}),
    ]
    rows = []
    for name, change in variants:
        cfg = TrainConfig(**{**vars(base), **change})
        trainer = Trainer(model, features, cfg)
        trainer.train(minutes, eval_minutes=1e9)
        ev = trainer.evaluate()
        rows.append((name, ev["top1"], ev["chain_accepted"], head_ms(model, trainer), trainer.steps))
        log(f"{name}: top-1 {ev['top1']} chain {ev['chain_accepted']} ({trainer.steps} steps)")
    print(f"\n{'variant':36s} {'top-1 d1':>9s} {'d2':>6s} {'d3':>6s} {'chain':>6s} {'ms/call(8)':>10s} {'steps':>6s}")
    for name, top1, chain, ms, steps in rows:
        print(f"{name:36s} {top1[0]:9.3f} {top1[1]:6.3f} {top1[2]:6.3f} {chain:6.2f} {ms:10.2f} {steps:6d}")


def build_parser(description: str = "Train the EAGLE-style draft head for a target model.") -> argparse.ArgumentParser:
    """The trainer's flags (tools/train_draft.py's command line)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=24.0, help="whole run, collection included (default 24)")
    parser.add_argument("--gen-minutes", type=float, default=10.0, help="self-distillation budget")
    parser.add_argument("--text-minutes", type=float, default=3.0, help="stdlib text budget")
    parser.add_argument("--out", default=str(DEFAULT_WEIGHTS), help="weights file to write")
    parser.add_argument("--data-cache", default=None, help="collected features (safetensors): reused when present, else written")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sequences", type=int, default=48, help="sequences generated together")
    parser.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab)
    parser.add_argument("--intermediate", type=int, default=TrainConfig.intermediate_size)
    parser.add_argument("--blocks", type=int, default=TrainConfig.num_blocks)
    parser.add_argument("--unroll", type=int, default=TrainConfig.unroll)
    parser.add_argument("--reg-weight", type=float, default=TrainConfig.reg_weight)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--compare", type=float, default=0.0, metavar="MINUTES",
                        help="instead of training one head: compare head shapes, MINUTES each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", default="", metavar="FILE",
                        help="train for this GGUF's model instead of the shipped SmolLM2 (any architecture the llm "
                             "backend serves); the head is tied to it by its fingerprint")
    return parser


def run(args: argparse.Namespace, model: Any, tokenizer: Any, target: str, run_start: float) -> int:
    """Collect (or reuse `--data-cache`), then train and save a head for `model` (or `--compare`).

    `target` names the model in the weights file; `run_start` is when the run began (the target's
    load counts against `--minutes`). Returns the exit status.
    """
    fingerprint = target_fingerprint(model)
    log(f"target {target} loaded, fingerprint {fingerprint[:16]}...")

    collect_start = time.monotonic()
    if args.data_cache and Path(args.data_cache).is_file():
        features = Features.load(args.data_cache)
        meta_path = Path(args.data_cache + ".json")
        data = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        log(f"features from {args.data_cache}: {len(features)} positions {features.counts()}")
    else:
        features, data = collect(model, tokenizer, args.gen_minutes, args.text_minutes, args.seed, args.batch_sequences)
        if args.data_cache:
            features.save(args.data_cache)
            Path(args.data_cache + ".json").write_text(json.dumps(data))
    collect_seconds = time.monotonic() - collect_start

    cfg = TrainConfig(intermediate_size=args.intermediate, num_blocks=args.blocks, draft_vocab=args.draft_vocab,
                      unroll=args.unroll, reg_weight=args.reg_weight, lr=args.lr, precision=args.precision, seed=args.seed)
    if args.compare:
        compare(model, features, args.compare, cfg)
        return 0

    trainer = Trainer(model, features, cfg)
    log(f"training: {trainer.train_starts.numel()} starts, draft vocab {trainer.draft_vocab.numel()} "
        f"(covers {trainer.coverage():.4f} of the target's top-1), bf16 autocast {trainer.bf16}, "
        f"head {sum(p.numel() for p in trainer.head.parameters()) / 1e6:.2f}M params")

    def checkpoint(t: Trainer) -> None:
        save_head(args.out, t.head, t.draft_vocab, fingerprint, {**summary_of(t, data, collect_seconds), "partial": True}, target)
        log(f"checkpoint -> {args.out}")

    reserve = min(1.0, 0.2 * args.minutes)  # final evaluation and saving
    minutes = args.minutes - (time.monotonic() - run_start) / 60 - reserve
    if minutes <= min(0.2, 0.25 * args.minutes):
        log("no time left to train: raise --minutes or lower --gen-minutes/--text-minutes")
        return 1
    trainer.train(minutes, checkpoint)
    summary = summary_of(trainer, data, collect_seconds)
    summary["held_out"] = {
        "all": trainer.evaluate(),
        **{name: trainer.evaluate(sources=[name]) for name in (*SOURCES, "unseen")},
    }
    summary["head_ms_8_rows"] = round(head_ms(model, trainer), 3)
    summary["total_minutes"] = round((time.monotonic() - run_start) / 60, 2)
    save_head(args.out, trainer.head, trainer.draft_vocab, fingerprint, summary, target)
    size = Path(args.out).stat().st_size
    log(f"saved {args.out} ({size / 1e6:.2f} MB)")
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=1))
    return 0
