"""What the target is run on: chat instructions this module writes, Python stdlib function headers
to complete, and windows of stdlib source and documentation; nothing needs the network."""

from __future__ import annotations

import ast
import glob
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable


@dataclass
class Prompt:
    ids: list[int]
    source: str  # "chat" or "code"
    temperature: float
    keep_from: int = 0  # positions before this are not kept (a chat template's fixed system prompt)
    max_new: int = 128
    held_out: bool = False  # evaluation only (never trained on)


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
