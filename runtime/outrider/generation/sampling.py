"""Request parameters for generation, and the one definition of the target distribution.

Plain sampling and speculative verification both draw from `target_distribution`, so the
speculative accept rule reproduces exactly the distribution plain decoding samples from.

NumPy only: the engine samples on the host whatever computed the logits (a torch model on CPU or
CUDA, or the torch-free CPU model), so serving a GGUF needs no torch. Every draw comes from the
request's own `numpy.random.Generator` (`new_generator`): a seed gives the same tokens every run.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from outrider.errors import BadRequestError

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 64
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPT_CHARS = 200_000
MAX_MESSAGES = 256
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 30
# A temperature below this is greedy (as vLLM's _SAMPLING_EPS): logits / 1e-300 overflow to inf
# and softmax turns them into NaN. It is also the floor `target_distribution` divides by.
SAMPLING_EPS = 1e-5


def is_greedy(temperature: float) -> bool:
    """Whether a temperature means greedy decoding (0, or too small to sample from safely)."""
    return temperature < SAMPLING_EPS


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    speculative: Optional[bool] = None
    stream: bool = False
    # The request's rules on the target distribution (constraints.TokenRules).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None  # as sent; checked against the vocabulary at admission
    constraint: Optional[tuple[str, Any]] = None  # grammar.parse_constraint
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's knobs for load tests and evaluation harnesses: EOS does not end the sequence; EOS,
    # stop_token_ids and stop strings cannot end it before `min_tokens` tokens.
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def _number(params: dict, name: str, default: Any, kind: type, low: float, high: float) -> Any:
    value = params.get(name, default)
    if value is None:
        return default
    what = "an integer" if kind is int else "a number"
    bounds = f"between {low:g} and {high:g}" if kind is float else f"between {low} and {high}"
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or (kind is int and not float(value).is_integer())):
        raise BadRequestError(f"parameter {name!r} must be {what} {bounds}, got {value!r}")
    if not low <= value <= high:
        raise BadRequestError(f"parameter {name!r} must be {bounds}, got {value!r}")
    return kind(value)


#: Every parameter a generate request may carry; any other is refused, so that a misspelled
#: `temprature` fails loudly instead of being ignored. `timeout_ms` is the server's (its deadline).
GENERATE_PARAMETERS = frozenset({
    "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
    "speculative", "stream", "presence_penalty", "frequency_penalty", "logit_bias", "constraint", "logprobs",
    "top_logprobs", "ignore_eos", "min_tokens", "timeout_ms", "chat_template_kwargs",
})
MAX_TEMPLATE_KWARGS = 16
#: what the engine itself passes to a chat template: a request may not set these
TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def check_parameter_names(params: dict) -> None:
    """Refuse a parameter the engine does not take, naming it (and the likely intended one)."""
    unknown = sorted(str(name) for name in params if name not in GENERATE_PARAMETERS)
    if unknown:
        name = unknown[0][:64]
        close = difflib.get_close_matches(name, GENERATE_PARAMETERS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise BadRequestError(f"unknown parameter {name!r}{hint}; generate takes "
                              f"{', '.join(sorted(GENERATE_PARAMETERS))}")


def parse_sampling(params: dict, max_tokens_limit: int) -> SamplingParams:
    """Validate a generate request's parameters; errors name the parameter and the expected value.

    Runs when the request is admitted, so a bad value fails that request alone. A temperature
    below SAMPLING_EPS is stored as 0 (greedy): every later check of greediness agrees.
    """
    check_parameter_names(params)
    out = SamplingParams(
        max_tokens=_number(params, "max_tokens", 128, int, 1, max_tokens_limit),
        temperature=_number(params, "temperature", 0.0, float, 0.0, MAX_TEMPERATURE),
        top_p=_number(params, "top_p", 1.0, float, 0.0, 1.0),
        top_k=_number(params, "top_k", 0, int, 0, MAX_TOP_K),
    )
    if out.top_p == 0.0:
        raise BadRequestError("parameter 'top_p' must be > 0 and at most 1 (1.0 turns it off), got 0")
    if is_greedy(out.temperature):
        out.temperature = 0.0
    seed = params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise BadRequestError(f"parameter 'seed' must be a non-negative integer, got {seed!r}")
    out.seed = seed
    stop = params.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in stop)):
        raise BadRequestError(
            f"parameter 'stop' must be a list of at most {MAX_STOP_STRINGS} non-empty strings "
            f"of at most {MAX_STOP_LENGTH} characters"
        )
    out.stop = stop
    stop_ids = params.get("stop_token_ids") or []
    if (not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids)):
        raise BadRequestError(f"parameter 'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} "
                              f"token ids (non-negative integers)")
    out.stop_token_ids = list(dict.fromkeys(stop_ids))
    ignore_eos = params.get("ignore_eos", False)
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise BadRequestError(f"parameter 'ignore_eos' must be true or false, got {ignore_eos!r}")
    out.ignore_eos = bool(ignore_eos)
    out.min_tokens = _number(params, "min_tokens", 0, int, 0, out.max_tokens)
    speculative = params.get("speculative")
    if speculative is not None and not isinstance(speculative, bool):
        raise BadRequestError(f"parameter 'speculative' must be true or false, got {speculative!r}")
    out.speculative = speculative
    out.stream = bool(params.get("stream", False))
    out.presence_penalty = _number(params, "presence_penalty", 0.0, float, -2.0, 2.0)
    out.frequency_penalty = _number(params, "frequency_penalty", 0.0, float, -2.0, 2.0)
    out.logit_bias = params.get("logit_bias") or None
    from .grammar import parse_constraint  # no grammar engine is imported here

    out.constraint = parse_constraint(params.get("constraint"))
    logprobs = params.get("logprobs", False)
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequestError(f"parameter 'logprobs' must be true or false, got {logprobs!r}")
    out.top_logprobs = _number(params, "top_logprobs", 0, int, 0, 20)
    out.logprobs = bool(logprobs) or out.top_logprobs > 0
    return out


def parse_prompt(params: dict) -> tuple[Optional[str], Optional[list[dict]]]:
    """(prompt, messages): exactly one is given, both bounded."""
    prompt, messages = params.get("prompt"), params.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequestError("give exactly one of 'prompt' (a string) or 'messages' (a list of {role, content})")
    if prompt is not None:
        if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT_CHARS:
            raise BadRequestError(f"parameter 'prompt' must be a string of at most {MAX_PROMPT_CHARS} characters")
        _check_text(prompt, "parameter 'prompt'")
        return prompt, None
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise BadRequestError(f"parameter 'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequestError(f"messages[{i}] must be a map with string 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise BadRequestError(f"messages[{i}].role must be system, user or assistant, got {m['role']!r}")
        total += len(m["content"])
        _check_text(m["content"], f"messages[{i}].content")
    if total > MAX_PROMPT_CHARS:
        raise BadRequestError(f"messages hold {total} characters; the limit is {MAX_PROMPT_CHARS}")
    return None, [{"role": m["role"], "content": m["content"]} for m in messages]


def parse_template_kwargs(params: dict) -> dict[str, Any]:
    """`chat_template_kwargs`: extra variables for the chat template (e.g. Qwen3's enable_thinking),
    as vLLM takes them: at most 16, named by identifiers, each a bool, number, string or null."""
    value = params.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise BadRequestError(f"parameter 'chat_template_kwargs' must be a map of at most {MAX_TEMPLATE_KWARGS} "
                              f"names to values")
    for name, item in value.items():
        if not isinstance(name, str) or not name.isidentifier() or len(name) > 64 or name in TEMPLATE_OWN:
            raise BadRequestError(f"parameter 'chat_template_kwargs': {str(name)[:64]!r} is not a name a request may "
                                  f"set (an identifier, not one of {', '.join(sorted(TEMPLATE_OWN))})")
        if not (item is None or isinstance(item, (bool, int, float)) or (isinstance(item, str) and len(item) <= 4096)):
            raise BadRequestError(f"parameter 'chat_template_kwargs': {name!r} must be a bool, a number, a string "
                                  f"of at most 4096 characters, or null")
    return dict(value)


def _check_text(text: str, where: str) -> None:
    """A 400 for text no tokenizer can take: a lone surrogate (JSON's "\\ud800") is not Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequestError(f"{where} is not valid text: {exc.reason} at character {exc.start}") from None


def new_generator(seed: Optional[int] = None) -> np.random.Generator:
    """A request's generator: PCG64 from its seed, or from fresh OS entropy without one."""
    return np.random.Generator(np.random.PCG64(seed))


def host_array(values: Any) -> np.ndarray:
    """fp32 numpy view (or copy) of a model's output: numpy as it is, a torch tensor from any device."""
    if isinstance(values, np.ndarray):
        return values if values.dtype == np.float32 else values.astype(np.float32)
    return values.detach().float().cpu().numpy()  # duck-typed: this module never imports torch


_NEAR_TOP = np.float32(np.exp(-9.0))  # target_distribution's cuts look first among entries this close to the top
_NEAR_TOP_MOST = 4096  # and only when they are few enough to sort


def target_distribution(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Probabilities the target samples from at T > 0: softmax(logits / T), then top-k, then top-p.

    Ties at the top-k or top-p boundary are all kept, so the set does not depend on sort order.
    The logits are scaled in fp32 by at least SAMPLING_EPS (softmax subtracts the maximum), so
    finite logits always give a distribution; non-finite ones (a broken forward) raise
    ValueError, which fails that sequence alone, rather than NaN reaching a draw. Rows of a
    2-D input are taken one by one.
    """
    logits = host_array(logits)
    if logits.ndim > 1:
        return np.stack([target_distribution(row, temperature, top_k, top_p) for row in logits])
    probs = logits / np.float32(max(float(temperature), SAMPLING_EPS))  # a new array: worked in place below
    with np.errstate(over="ignore", invalid="ignore"):
        probs -= probs.max()
        np.exp(probs, out=probs)
        total = probs.sum()
    if not np.isfinite(total) or not total > 0:
        raise ValueError("the model's logits are not finite (inf or NaN): cannot sample from them")
    vocab = probs.shape[-1]
    if (top_k and top_k < vocab) or top_p < 1.0:
        # The cuts keep the largest entries: find them among the few within e^-9 of the maximum
        # (which is 1 here) when those hold them, not by partitioning or sorting the whole
        # vocabulary (0.5 ms at 49,152 tokens, 3.1 ms at 262,144; tools/bench_sampling.py), and
        # cut the whole vocabulary once, at the larger of the two thresholds.
        near = probs[probs >= _NEAR_TOP]
        if len(near) > _NEAR_TOP_MOST:
            near = None
        cut = np.float32(0)
        if top_k and top_k < vocab:
            if near is not None and len(near) >= top_k:
                cut = np.partition(near, len(near) - top_k)[len(near) - top_k]
                near = near[near >= cut]
            else:  # the kept entries reach below the near ones
                cut = np.partition(probs, vocab - top_k)[vocab - top_k]
                near = None
        if top_p < 1.0:
            values = None
            if near is not None:
                mass = near.sum(dtype=np.float64)
                total = mass if cut > 0 else total  # every entry top-k keeps is near: its mass is theirs
                if mass >= top_p * total:
                    values = np.sort(near)[::-1]
                    cumulative = np.cumsum(values)
            if values is None:  # grow a top-k until it holds top_p of the mass (sorting all costs ~2 ms a row)
                if cut > 0:
                    probs = np.where(probs >= cut, probs, np.float32(0))
                    total = probs.sum()
                k = min(64, vocab)
                while True:
                    values = np.sort(np.partition(probs, vocab - k)[vocab - k:])[::-1]
                    cumulative = np.cumsum(values)
                    if k == vocab or cumulative[-1] >= top_p * total:
                        break
                    k = min(vocab, k * 4)
            # The smallest prefix whose mass reaches top_p: the last kept value is the threshold.
            cut = max(cut, values[(cumulative - values) < top_p * total].min())
        probs = np.where(probs >= cut, probs, np.float32(0))
        total = probs.sum()
    probs /= total
    return probs


DRAW_BLOCK = 256  # entries per block of `draw`'s two-level inverse CDF


def draw(probs: np.ndarray, generator: Optional[np.random.Generator]) -> int:
    """One index from (unnormalized, non-negative) probabilities: the inverse CDF at one uniform
    (from `generator`; None: fresh OS entropy), in float64; an entry without mass is never drawn.

    Two levels: the uniform picks a block of `DRAW_BLOCK` entries by the blocks' sums, then an
    entry by the running sum within the block. numpy's cumsum is a sequential loop (a flat running
    sum took 0.24 ms over a 49,152-token vocabulary and 1.2 ms over Gemma's 262,144, a quarter of
    a 270M model's decode step; this 24 and 91 us), while the block sums are vectorized; the draws
    differ from a flat running sum's only where the uniform falls within float64 rounding of a
    boundary (tools/bench_sampling.py: the same token for 20,000 of 20,000 uniforms)."""
    generator = generator if generator is not None else new_generator()
    probs = np.asarray(probs).reshape(-1)
    n = probs.shape[0]
    whole = n - n % DRAW_BLOCK
    sums = np.empty(whole // DRAW_BLOCK + (whole < n), dtype=np.float64)
    sums[:whole // DRAW_BLOCK] = probs[:whole].reshape(-1, DRAW_BLOCK).sum(axis=1, dtype=np.float64)
    if whole < n:
        sums[-1] = probs[whole:].sum(dtype=np.float64)
    cumulative = np.cumsum(sums)
    total = cumulative[-1] if len(cumulative) else 0.0
    if not total > 0:
        raise ValueError("cannot draw from a distribution with no mass")
    at = generator.random() * total
    block = int(np.searchsorted(cumulative, at, side="right"))
    if block >= len(sums):  # the uniform's rounding reached the total: the last block with mass
        block = int(np.flatnonzero(sums > 0)[-1])
    start = block * DRAW_BLOCK
    entries = probs[start:start + DRAW_BLOCK]
    running = np.cumsum(entries, dtype=np.float64)
    index = int(np.searchsorted(running, at - (cumulative[block - 1] if block else 0.0), side="right"))
    if index >= len(entries):  # rounding between the block's sum and its running sum: its last entry with mass
        index = int(np.flatnonzero(entries)[-1])
    return start + index


def greedy_token(logits: np.ndarray) -> int:
    """The greedy choice; the first maximum wins (the same rule speculative verification uses)."""
    return int(np.argmax(host_array(logits)))


def sample_token(logits: np.ndarray, params: SamplingParams, generator: np.random.Generator) -> int:
    """One token from the target alone (no speculation)."""
    if params.greedy:
        return greedy_token(logits)
    return draw(target_distribution(logits, params.temperature, params.top_k, params.top_p), generator)
