"""The trainer's command line (tools/train_draft.py): build_parser, run (collect, train, save) and
compare (a few head shapes on the same data)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from outrider_speculative.draft_head import DEFAULT_WEIGHTS, target_fingerprint
from outrider_speculative.eagle import save_head

from .collection import collect
from .features import SOURCES, Features
from .progress import log
from .report import head_ms, summary_of
from .trainer import TrainConfig, Trainer


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
