"""`speculative` accelerator: draft trees and the lossless accept rule for speculative decoding.

Registers the accelerator for the manifest section `speculative` (factory(manifest) returns a
`SpeculativeStrategy`), the drafter "ngram" (prompt lookup over prompt + generated text, as a
tree) and the drafter "eagle" (a small trained draft head over the target's hidden states; its
weights ship in `weights/`). The generation engine drives the loop; this plugin only proposes
and verifies:

- `strategy.py`  SpeculativeStrategy (budget, propose, verify, release) and BudgetController
- `config.py`    the `speculative` section's knobs, validated (no torch import)
- `drafters.py`  NgramDrafter and its incremental per-sequence index
- `eagle.py`     DraftHead, its weights file (tied to the target by fingerprint), EagleDrafter
- `tree.py`      SpecTree (sampled candidates), prune_tree, merge_trees, build_dynamic_tree
- `verify.py`    Verdict and the accept rule (greedy; multi-candidate speculative sampling), on
                 the target distribution plain decoding defines (outrider.generation.sampling)

Importing this package imports no torch; the factories do, when a manifest asks for them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from outrider import hookimpl

__version__ = "0.1.0"


def make_strategy(manifest: Any):
    """Accelerator factory: the SpeculativeStrategy for a manifest's `speculative` section."""
    from .strategy import SpeculativeStrategy

    return SpeculativeStrategy.from_manifest(manifest)


def make_ngram_drafter(model: Any, options: Optional[Mapping[str, Any]] = None):
    """Drafter factory: an NgramDrafter from its manifest options."""
    from .drafters import make_ngram_drafter as make

    return make(model, options)


def make_eagle_drafter(model: Any, options: Optional[Mapping[str, Any]] = None):
    """Drafter factory: an EagleDrafter over `model` (option `weights`: default the shipped head)."""
    from .eagle import make_eagle_drafter as make

    return make(model, options)


@hookimpl
def outrider_register_accelerators(register: Callable[[str, Any], None]) -> None:
    """Register the speculative-decoding strategy for the manifest section `speculative`."""
    register("speculative", make_strategy)


@hookimpl
def outrider_register_drafters(register: Callable[[str, Any], None]) -> None:
    """Register the n-gram (prompt lookup) drafter as "ngram" and the trained draft head as "eagle"."""
    register("ngram", make_ngram_drafter)
    register("eagle", make_eagle_drafter)
