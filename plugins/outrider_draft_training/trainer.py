"""Training the draft head on collected features: the draft vocabulary, the train/held-out split,
TrainConfig and Trainer (time-budgeted, unrolled, evaluated on held-out and unseen instructions)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from outrider.hardware import cpu_has_bf16_instructions
from outrider_speculative.draft_head import HeadConfig
from outrider_speculative.eagle import DraftHead, lm_rows_for

from .features import SOURCES, Features
from .progress import log


def cpu_runs_bf16_natively() -> bool:
    """True when oneDNN can run bf16 matmuls in hardware (AVX512-BF16 or AMX): then bf16 autocast
    pays. The same test as the llm backend's `outrider_llm.linear.cpu_has_native_bf16`."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except Exception:
        return False
    return cpu_has_bf16_instructions()


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
        self.lm_rows = lm_rows_for(model, self.draft_vocab).float()  # the LM head's, as the drafter scores
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
