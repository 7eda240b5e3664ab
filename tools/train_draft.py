#!/usr/bin/env python3
"""Train the EAGLE-style draft head ("eagle") for SmolLM2 on this CPU, from text that needs no network.

  python tools/train_draft.py                        the shipped head: ~24 minutes on 2 cores
  python tools/train_draft.py --minutes 10 --out /tmp/head.safetensors
  python tools/train_draft.py --data-cache /tmp/d.safetensors   collect once, train again faster
  python tools/train_draft.py --compare 1.5          architecture comparison (1.5 min per variant)
  python tools/train_draft.py --gguf qwen2.5-0.5b-instruct-q4_k_m.gguf --out qwen-head.safetensors
                                                     a head for another model (any the llm backend serves)

A head for another model: pass its GGUF with --gguf and point the manifest's
`speculative.eagle.weights` at the result; the drafter checks the fingerprint at load and refuses a
head trained for other weights, saying which. Budget more minutes for a larger model (collection
runs the target itself; the defaults suit a 135M model on 2 cores). The target runs in torch (fp32)
where the torch model serves the architecture, and on the native runtime (what a CPU server runs,
int8 activations over the file's blocks) where only that serves it: Gemma 2 and 3.

The trainer is the package `outrider_draft_training` (what it collects and how it trains are
described there); this tool loads the target through the llm backend and runs it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins")]


def load_target(source: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a GGUF as the trainer reads it: the torch model in fp32 (the fingerprint
    is the same for every load of the file), or the native runtime's behind `HostTarget` for an
    architecture only that runtime serves."""
    from outrider_llm.gguf_reading import NATIVE_ONLY, GGUFFile, gguf_field
    from outrider_llm.loading import load_model

    if gguf_field(GGUFFile(source), "general.architecture") in NATIVE_ONLY:
        from outrider_draft_training.host_target import HostTarget
        from outrider_llm.gguf_tiles import load_gguf_tiles
        from outrider_llm.native_model import load_tiles

        model, tokenizer = load_tiles(load_gguf_tiles(source))
        return HostTarget(model), tokenizer
    return load_model(source)


def main(argv: Optional[list[str]] = None) -> int:
    import torch
    from outrider_llm.artifact import smollm2_gguf_path
    from outrider_draft_training import cli

    args = cli.build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    run_start = time.monotonic()
    torch.set_num_threads(args.threads)
    source = Path(args.gguf) if args.gguf else smollm2_gguf_path()
    model, tokenizer = load_target(source)
    from outrider_llm import native_c

    if native_c.library()[0]:  # the native runtime's kernels (a Gemma target) take the same count
        native_c.set_threads(args.threads)
    target = f"{source.stem} ({source.name})" if args.gguf else f"SmolLM2-135M-Instruct ({source.name})"
    return cli.run(args, model, tokenizer, target, run_start)


if __name__ == "__main__":
    sys.exit(main())
