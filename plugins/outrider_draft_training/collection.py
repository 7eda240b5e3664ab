"""Running the target to collect features: self-distillation (the target answers the corpus'
instructions, batched, and every forward is recorded) and a prefill over text windows."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from outrider.generation.contract import Chunk

from .corpus import Prompt, build_prompts, stdlib_files, text_windows
from .features import Features, FeatureStore, top_k
from .progress import log


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
