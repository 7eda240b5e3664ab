"""A second generating backend: transformers' LlamaForCausalLM on a tiny random config.

It shares nothing with plugins/outrider_llm: it implements the core `CausalLM` contract on top
of a stock transformers model, and the core `GenerationEngine` and the `speculative` accelerator
drive it unchanged. That is the proof that the engine and speculation are not tied to one model.

The KV cache here is deliberately naive: a slot remembers its committed token ids, and every
forward recomputes the whole prefix with a 4-D attention mask (causal over the committed
tokens, the draft tree's mask over the fed ones). Slow, but exactly the contract's semantics.

For the isolation tests it can also misbehave on request: option `chat_template` replaces the
chat template (jinja, with transformers' `raise_exception`; null: the model has none), a prompt
holding "crash" makes the shared forward raise, and the drafter "exploding" raises in `start`
or `extend` for prompts holding "boom start" or "boom extend".
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from outrider import hookimpl
from outrider.backend import GeneratingBackend
from outrider.errors import BadRequestError
from outrider.generation.contract import Chunk, ForwardOutput

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?-0123456789\n"


DEFAULT_TEMPLATE = object()  # the built-in one: contents joined by newlines


class CharTokenizer:
    """Token i <-> the i-th character of a small alphabet; no end-of-sequence token."""

    eos_token_ids: set[int] = set()
    bos_token_id = None
    vocab_size = len(ALPHABET)

    def __init__(self, chat_template: Any = DEFAULT_TEMPLATE) -> None:
        self.chat_template = "builtin" if chat_template is DEFAULT_TEMPLATE else chat_template
        self._template = None if chat_template is DEFAULT_TEMPLATE or not chat_template else _compile(chat_template)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in ALPHABET})
        if unknown:
            raise BadRequestError(f"characters {unknown} are not in this test model's alphabet")
        return [ALPHABET.index(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(ALPHABET[i] for i in ids)

    def token_text(self, token_id: int) -> Optional[str]:
        return ALPHABET[token_id] if 0 <= token_id < len(ALPHABET) else None

    def to_json(self) -> None:
        return None  # no structured output on this test tokenizer

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")  # as outrider_llm's ChatTokenizer
        if self._template is not None:
            return self._template.render(messages=messages, add_generation_prompt=True)
        return "\n".join(m["content"] for m in messages) + "\n"


def _compile(source: str) -> Any:
    """A chat template in a sandbox with `raise_exception`, as transformers renders them."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class RecomputeCache:
    """Committed token ids per slot; the last forward's fed tokens wait for `commit`."""

    def __init__(self, num_slots: int, max_length: int) -> None:
        self.num_slots, self.max_length = num_slots, max_length
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self.fed: list[list[int]] = [[] for _ in range(num_slots)]

    def length(self, slot: int) -> int:
        return len(self.tokens[slot])

    def commit(self, slot: int, keep: list[int]) -> None:
        self.tokens[slot].extend(self.fed[slot][i] for i in keep)
        self.fed[slot] = []

    def reset(self, slot: int) -> None:
        self.tokens[slot], self.fed[slot] = [], []


class HFLlama:
    """`CausalLM` over transformers' LlamaForCausalLM (fp32, CPU)."""

    device = "cpu"
    array_api = "torch"

    def __init__(self, seed: int = 0, vocab_size: int = len(ALPHABET)) -> None:
        from outrider.torch_process import from_transformers

        LlamaConfig, LlamaForCausalLM = from_transformers("LlamaConfig", "LlamaForCausalLM")

        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=True)
        config._attn_implementation = "eager"  # takes our 4-D float mask as given
        self.hf = LlamaForCausalLM(config).eval()
        self.vocab_size, self.hidden_size, self.dtype = vocab_size, config.hidden_size, torch.float32

    def new_cache(self, num_slots: int, max_length: int) -> RecomputeCache:
        return RecomputeCache(num_slots, max_length)

    @torch.no_grad()
    def forward(self, cache: RecomputeCache, chunks: list[Chunk],
                logit_rows: Optional[torch.Tensor] = None) -> ForwardOutput:
        hidden_rows = []
        for chunk in chunks:
            committed = cache.tokens[chunk.slot]
            fed = chunk.tokens.tolist()
            if "crash" in "".join(ALPHABET[i] for i in committed + fed):
                raise RuntimeError("forward crashed on purpose (the prompt holds 'crash')")
            cache.fed[chunk.slot] = fed
            n, m = len(committed), len(fed)
            ids = torch.tensor([committed + fed])
            positions = torch.cat([torch.arange(n), torch.as_tensor(chunk.positions).long()])[None]
            allowed = torch.zeros(n + m, n + m, dtype=torch.bool)
            allowed[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
            allowed[n:, :n] = True
            tree = torch.as_tensor(chunk.tree_mask) if chunk.tree_mask is not None else torch.ones(m, m, dtype=torch.bool).tril()
            allowed[n:, n:] = tree
            mask = torch.zeros(1, 1, n + m, n + m).masked_fill_(~allowed, torch.finfo(torch.float32).min)
            out = self.hf.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False)
            hidden_rows.append(out.last_hidden_state[0, n:])  # after the final norm
        hidden = torch.cat(hidden_rows)
        rows = hidden if logit_rows is None else hidden.index_select(0, torch.as_tensor(logit_rows))
        return ForwardOutput(logits=self.hf.lm_head(rows).float(), hidden=hidden)

    @torch.no_grad()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf.model.embed_tokens(tokens.reshape(-1).long()).float()

    @torch.no_grad()
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(hidden.float()).float()

    def lm_head_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head.weight.detach().index_select(0, tokens.reshape(-1).long()).float()

    def make_linear(self, weight: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Callable[[torch.Tensor], torch.Tensor]:
        weight = weight.detach().float()
        return lambda x: F.linear(x.float(), weight)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.hf.model.embed_tokens.weight.detach().numpy().tobytes()).hexdigest()


class HFLlamaBackend(GeneratingBackend):
    """Text generation on `HFLlama` through the core engine (and the speculative accelerator)."""

    name = "hf-llama"

    @classmethod
    def make_scheduler(cls, manifest: Any) -> Any:
        from outrider.generation.engine import GenerationScheduler

        return GenerationScheduler(manifest)

    def load(self) -> None:
        from outrider.generation.engine import GenerationEngine

        options = self.manifest.options
        template = options["chat_template"] if "chat_template" in options else DEFAULT_TEMPLATE
        self.model, self.tokenizer = HFLlama(int(options.get("seed", 0))), CharTokenizer(template)
        strategy = getattr(self.accelerators, "decode_strategy", None)
        if strategy is not None:
            strategy = strategy.for_instance()
            strategy.attach(self.model, self.tokenizer)
        self.engine = GenerationEngine(self.model, self.tokenizer, strategy=strategy, max_sequences=4,
                                       max_length=256, stats=self.stats)

    def warmup(self) -> None:
        self.engine.warm_up(self.tokenizer.encode("abc abc abc"), max_tokens=4)

    def health(self) -> dict[str, Any]:
        engine = self.engine
        return {"healthy": True, "active_sequences": len(engine.active), "waiting": len(engine.waiting),
                "free_slots": len(engine.free_slots)}


class ExplodingDrafter:
    """Proposes nothing; raises in `start` or `observe` for a prompt holding "boom start" / "boom observe"."""

    name = "exploding"

    @staticmethod
    def _prompt(seq: Any) -> str:
        return "".join(ALPHABET[i] for i in seq.token_ids[:seq.prompt_length])

    def start(self, seq: Any) -> None:
        if "boom start" in self._prompt(seq):
            raise RuntimeError("drafter start exploded on purpose")

    def observe(self, seq: Any, outcome: Any) -> None:
        if "boom observe" in self._prompt(seq):
            raise RuntimeError("drafter observe exploded on purpose")

    def propose(self, seq: Any, budget: int) -> Any:
        from outrider.generation.contract import DraftTree

        return DraftTree()


class PeriodDrafter:
    """A drafter written against the core's contract alone (no core edit): when the sequence's tail
    repeats with a period of 1-8 tokens, it proposes the next period as a chain. It learns from
    `observe`: after `patience` steps in a row with nothing accepted it rests for as many steps."""

    name = "period"

    def __init__(self, patience: int = 3) -> None:
        self.patience = patience
        self.misses: dict[Any, int] = {}  # seq_id -> drafted steps in a row with nothing accepted
        self.resting: dict[Any, int] = {}

    def propose(self, seq: Any, budget: int) -> Any:
        from outrider.generation.contract import DraftTree

        if self.resting.get(seq.seq_id, 0) > 0:
            self.resting[seq.seq_id] -= 1
            return DraftTree()
        ids = seq.token_ids
        for period in range(1, 9):
            if len(ids) >= 2 * period and ids[-period:] == ids[-2 * period:-period]:
                tokens = [ids[-period + i % period] for i in range(budget)]
                return DraftTree(tokens, list(range(-1, len(tokens) - 1)), [0.9 ** (i + 1) for i in range(len(tokens))])
        return DraftTree()

    def observe(self, seq: Any, outcome: Any) -> None:
        if outcome.phase != "decode" or outcome.drafted == 0:
            return
        misses = 0 if outcome.accepted else self.misses.get(seq.seq_id, 0) + 1
        self.misses[seq.seq_id] = misses
        if misses >= self.patience:
            self.misses[seq.seq_id], self.resting[seq.seq_id] = 0, self.patience

    def finish(self, seq: Any) -> None:
        self.misses.pop(seq.seq_id, None)
        self.resting.pop(seq.seq_id, None)


@hookimpl
def outrider_register_backends(register: Callable[[type], None]) -> None:
    """Register `hf-llama`."""
    register(HFLlamaBackend)


@hookimpl
def outrider_register_drafters(register: Callable[[str, Any], None]) -> None:
    """Register the drafters `exploding` and `period`."""
    register("exploding", lambda model, options, context: ExplodingDrafter())
    register("period", lambda model, options, context: PeriodDrafter(int(options.get("patience", 3))))
