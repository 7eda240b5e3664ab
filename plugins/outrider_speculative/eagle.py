"""The EAGLE-style draft head ("eagle"): a small trained network that drafts from the target's features.

    f_{t+1} = head(h_t, embed(x_{t+1}))          h_t: the target's last hidden (after its final norm)
    q(x_{t+2}) = softmax(f_{t+1} @ E[draft_vocab].T)   E: the target's own (tied) LM head rows

The head reads the target's hidden state at the last committed position and the embedding of the
pending token, and predicts the target's *next* hidden state f (trained to regress onto it) and,
through the target's LM head restricted to a reduced draft vocabulary, the token after the pending
one. Deeper in the tree its own f replaces h: node x_{t+2}'s children come from head(f_{t+1},
embed(x_{t+2})), and so on. It shares the target's embeddings and LM head (not stored in the
weights file), so the file holds only the head's own layers (fp16) and the draft vocabulary.

Architecture (measured against alternatives by tools/train_draft.py --compare): fused input
projection Linear(2H -> H) over [rmsnorm(h), rmsnorm(e)], then `num_blocks` residual SwiGLU blocks,
then an RMSNorm. No attention: EAGLE's draft layer attends over the draft's own features at every
earlier position, but the engine hands a drafter the target's hidden state at one position per
step only (`SequenceView.last_hidden`), so there is no context to attend over; the target's h_t
already summarizes it.

The weights file is tied to the target's weights by `target_fingerprint(model)` (sha256 over the
config shape, a fixed subsample of embedding rows and every norm weight): a head trained for other
weights is refused at load with a ManifestError that names both hashes and says how to retrain.

Drafting: `EagleDrafter.propose` grows a tree best-first by cumulative draft probability
(`tree.build_dynamic_tree`), expanding up to `frontier` nodes per head call (one batched forward
per depth level).

- Greedy requests (temperature 0): a node's children are the top-k tokens of q, verified as
  deterministic candidates (greedy verification only asks whether the argmax is among them).
- Sampling requests (temperature > 0, option `sample`, on by default): a node's children are
  drawn from q itself, without replacement, with the request's own generator (so a seed
  reproduces the draws), and recorded as `SampledChildren(q, draws)`. q is the head's
  distribution put through the request's temperature, top-k and top-p (over the draft
  vocabulary) and scattered into the full vocabulary, so it approximates the target's p; the
  verifier then accepts a draw with min(1, p/q) and moves to the residual max(0, p - q), which
  keeps sum min(p, q) per draw instead of the p(c) a deterministic top-k candidate keeps. On
  SmolLM2 with the shipped head at T=1, four draws at a node are accepted about 1.5x as often
  as its top four tokens taken as deterministic candidates (0.44-0.63 against 0.30-0.43).
  Draws the tree does not take (threshold, budget) stay in the group; see tree.py.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from outrider.errors import ManifestError

from .config import OptionError, known_options, read_bool, read_float, read_int
from .draft_head import DEFAULT_WEIGHTS, FORMAT, OPTIONS, TRAIN_HINT, HeadConfig, HeadDrafter, check_fingerprint

log = logging.getLogger("outrider.speculative")
# ---- the head -------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    """x + down(silu(gate(n(x))) * up(n(x))): a Llama MLP with its pre-norm."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(hidden))
        self.gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False)


class DraftHead(torch.nn.Module):
    """(target hidden h_t, embedding of token t+1) -> feature f_{t+1} ~ the target's hidden h_{t+1}.

    Logits come from `logits(f, lm_rows)`, where lm_rows are the target's LM head rows of the
    draft vocabulary (shared, not a parameter of the head).
    """

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.norm_hidden = torch.nn.Parameter(torch.ones(h))
        self.norm_embed = torch.nn.Parameter(torch.ones(h))
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.blocks = torch.nn.ModuleList(_Block(h, config.intermediate_size) for _ in range(config.num_blocks))
        self.norm_out = torch.nn.Parameter(torch.ones(h))

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[n, H], [n, H] -> features [n, H] (on the scale of the target's normed hidden states)."""
        eps, shape = self.config.rms_norm_eps, (self.config.hidden_size,)
        x = self.fc(torch.cat([F.rms_norm(hidden, shape, self.norm_hidden, eps),
                               F.rms_norm(embeds, shape, self.norm_embed, eps)], dim=-1))
        inter = self.config.intermediate_size
        for block in self.blocks:
            gate_up = block.gate_up(F.rms_norm(x, shape, block.norm.to(x.dtype), eps))
            x = x + block.down(F.silu(gate_up[..., :inter]) * gate_up[..., inter:])
        return F.rms_norm(x, shape, self.norm_out.to(x.dtype), eps)  # (x is bf16 under training autocast)

    @staticmethod
    def logits(features: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, K] through the target's LM head rows [K, H]."""
        return features @ lm_rows.T

    def nbytes(self) -> int:
        """Parameter bytes at fp16 (what the weights file stores)."""
        return sum(p.numel() for p in self.parameters()) * 2


# ---- the weights file -----------------------------------------------------------------------------


def save_head(path: "str | Path", head: DraftHead, draft_vocab: torch.Tensor, fingerprint: str,
              summary: Optional[Mapping[str, Any]] = None, target: str = "") -> None:
    """Write a head as safetensors (fp16 layers, int32 draft vocab) with its metadata; atomic."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(torch.float16).contiguous() for name, p in head.state_dict().items()}
    tensors["draft_vocab"] = draft_vocab.to(torch.int32).contiguous()
    metadata = {
        "format": FORMAT,
        "target_fingerprint": fingerprint,
        "target": target,
        "config": head.config.to_json(),
        "summary": json.dumps(dict(summary or {}), sort_keys=True),
    }
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o644)  # safetensors writes 0600; a file that ships in a package must be readable
    os.replace(tmp, path)


@dataclass
class LoadedHead:
    """A head read from disk: module (fp32), draft vocabulary (int64) and metadata."""

    head: DraftHead
    draft_vocab: torch.Tensor
    metadata: dict[str, str]
    path: Path

    @property
    def fingerprint(self) -> str:
        return self.metadata.get("target_fingerprint", "")

    def summary(self) -> dict[str, Any]:
        """The training summary the trainer stored ({} when absent)."""
        try:
            return json.loads(self.metadata.get("summary", "{}"))
        except ValueError:
            return {}


def load_head(path: "str | Path") -> LoadedHead:
    """Read a weights file; ManifestError when it is missing or not an outrider eagle head."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ManifestError(f"eagle draft head: weights file {str(path)!r} does not exist; train one with {TRAIN_HINT}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
        config = HeadConfig.from_json(metadata["config"])
        draft_vocab = tensors.pop("draft_vocab").to(torch.long)
        head = DraftHead(config)
        head.load_state_dict({k: v.float() for k, v in tensors.items()})
    except ManifestError:
        raise
    except Exception as exc:
        raise ManifestError(f"eagle draft head: {str(path)!r} is not a usable head file ({type(exc).__name__}: {exc})") from None
    if draft_vocab.numel() != config.draft_vocab_size:
        raise ManifestError(f"eagle draft head: {str(path)!r} has {draft_vocab.numel()} draft tokens, config says {config.draft_vocab_size}")
    head.eval().requires_grad_(False)
    return LoadedHead(head, draft_vocab, metadata, path)


def check_target(loaded: LoadedHead, model: Any) -> str:
    """The target's fingerprint; ManifestError when the head was trained for other weights."""
    return check_fingerprint(loaded.path, loaded.metadata, loaded.head.config.hidden_size,
                             int(loaded.draft_vocab.max()), model)


# ---- inference ------------------------------------------------------------------------------------


class CompiledHead:
    """The head's forward for drafting, on the target's device: its linears are the target's own
    kind (`make_linear`: oneDNN-prepacked on CPU where that works, plain elsewhere), no autograd."""

    def __init__(self, head: DraftHead, lm_rows: torch.Tensor, model: Any, dtype: torch.dtype,
                 quantize: Optional[str] = None) -> None:
        cfg = head.config
        self.eps, self.shape, self.inter = cfg.rms_norm_eps, (cfg.hidden_size,), cfg.intermediate_size
        self.dtype = dtype
        self.low = dtype if dtype != torch.float32 else None
        device = torch.device(model.device)
        own = lambda p: p.detach().to(device, torch.float32).clone()  # noqa: E731
        self.norm_hidden = own(head.norm_hidden)
        self.norm_embed = own(head.norm_embed)
        self.norm_out = own(head.norm_out)
        # The target's own linear (prepacked, in its format), reached through the contract.
        # quantize="int4": the model's packed int4 kernel where it is the fastest (drafts are
        # verified, so rounding costs at most some acceptance, never correctness).
        extra = {"quantize": quantize} if quantize else {}
        linear = lambda weight: model.make_linear(weight.detach().float(), dtype, **extra)  # noqa: E731
        self.fc = linear(head.fc.weight)
        self.blocks = [(own(b.norm), linear(b.gate_up.weight), linear(b.down.weight)) for b in head.blocks]
        self.lm = linear(lm_rows)

    def _mm(self, linear: Any, x: torch.Tensor) -> torch.Tensor:
        return linear(x if self.low is None else x.to(self.low)).float()

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [n, H], draft-vocabulary logits [n, K])."""
        eps, shape, inter = self.eps, self.shape, self.inter
        x = torch.cat([F.rms_norm(hidden, shape, self.norm_hidden, eps), F.rms_norm(embeds, shape, self.norm_embed, eps)], -1)
        x = self._mm(self.fc, x)
        for norm, gate_up, down in self.blocks:
            g = self._mm(gate_up, F.rms_norm(x, shape, norm, eps))
            x = self._mm(down, F.silu(g[:, :inter]).mul_(g[:, inter:])).add_(x)
        features = F.rms_norm(x, shape, self.norm_out, eps)
        return features, self._mm(self.lm, features)


def lm_rows_for(model: Any, draft_vocab: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows of the draft vocabulary, fp32 [K, H]."""
    return model.lm_head_rows(draft_vocab)


class EagleDrafter(HeadDrafter):
    """Drafts a tree with the trained head (see the module docstring), on the target's torch device."""

    def __init__(self, model: Any, loaded: LoadedHead, max_depth: int = 8, max_children: int = 4,
                 prob_threshold: float = 0.05, frontier: int = 8, dtype: Optional[torch.dtype] = None,
                 sample: bool = True, quantize: Optional[str] = None) -> None:
        super().__init__(model, loaded.draft_vocab.cpu().numpy(), max_depth, max_children, prob_threshold, frontier,
                         sample)
        # `loaded` is not kept: its fp32 module (32 MB for SmolLM2's head) would stay resident,
        # and the compiled head below holds what drafting reads.
        self.device = torch.device(model.device)
        # Indexed by top-k results, which come back on the model's device.
        self.draft_vocab = loaded.draft_vocab.to(self.device)
        if dtype is None:
            dtype = model.dtype
        self.compiled = CompiledHead(loaded.head, lm_rows_for(model, loaded.draft_vocab), model, dtype, quantize)

    def warmup(self) -> None:
        """Run the head once per batch size it will see, so the first request pays no setup."""
        h = torch.zeros(1, self.model.hidden_size, device=self.device)
        for n in sorted({1, self.max_children, self.frontier}):
            self.compiled(h.expand(n, -1).contiguous(), self.model.embed(torch.zeros(n, dtype=torch.long)))

    def expand(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One head call for n nodes: (features [n, H], top-k probs [n, k], top-k token ids [n, k])."""
        features, logits = self.compiled(hidden, self.model.embed(tokens))
        probs = torch.softmax(logits, dim=-1)
        top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
        return features, top.values, self.draft_vocab[top.indices]

    def _run(self, states: list, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.compiled(torch.stack(states), self.model.embed(torch.tensor(tokens)))

    def _top(self, logits: torch.Tensor, k: int) -> tuple[list, list]:
        probs = torch.softmax(logits, dim=-1)
        top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
        return top.values.tolist(), self.draft_vocab[top.indices].tolist()

    def _root(self, hidden: Any) -> torch.Tensor:
        return torch.as_tensor(hidden).detach().reshape(-1).float()


def make_eagle_drafter(model: Any, options: Optional[Mapping[str, Any]] = None) -> EagleDrafter:
    """Drafter factory for `outrider_register_drafters`: loads and checks the head, warms it up."""
    options = known_options(options, OPTIONS, "eagle")
    if model is None:
        raise ValueError("the eagle drafter needs the loaded target model (its embeddings and LM head)")
    weights = options.get("weights") or DEFAULT_WEIGHTS
    if not isinstance(weights, (str, os.PathLike)):
        raise OptionError("weights", f"expected a path to a .safetensors head (got {weights!r})")
    dtype_name = options.get("dtype", "model")
    dtypes = {"model": None, "fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if dtype_name not in dtypes:
        raise OptionError("dtype", f"expected one of {list(dtypes)} (got {dtype_name!r})")
    quantize = options.get("quantize", "none")
    if quantize not in ("none", "int4"):
        raise OptionError("quantize", f"expected 'none' or 'int4' (got {quantize!r})")
    max_depth = read_int(options, "max_depth", 8, 1, 256)
    max_children = read_int(options, "max_children", 4, 1, 64)
    prob_threshold = read_float(options, "prob_threshold", 0.05, 0.0, 1.0)
    frontier = read_int(options, "frontier", 8, 1, 256)
    sample = read_bool(options, "sample", True)
    loaded = load_head(Path(weights).expanduser())
    check_target(loaded, model)
    drafter = EagleDrafter(model, loaded, max_depth, max_children, prob_threshold, frontier, dtypes[dtype_name], sample,
                           None if quantize == "none" else quantize)
    drafter.warmup()
    return drafter
