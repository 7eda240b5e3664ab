"""`speculative` accelerator: draft trees and the lossless accept rule for speculative decoding.

Registers the accelerator for the manifest section `speculative` (factory(manifest) returns a
`SpeculativeStrategy`), the drafter "ngram" (prompt lookup over prompt + generated text, as a
tree) and the drafter "eagle" (a small trained draft head over the target's hidden states; its
weights ship in `weights/`). The generation engine drives the loop; this plugin only proposes
and verifies:

- `strategy.py`  SpeculativeStrategy (start, propose, observe, finish: the budget) and BudgetController
- `cost_gate.py` CostGate: drafting only while it pays, measured per sequence and per step
- `config.py`    the `speculative` section's knobs, validated (no torch import)
- `drafters.py`  NgramDrafter and its incremental per-sequence index
- `draft_model.py` DraftModelDrafter: a small model of the same vocabulary, its own KV cache
- `eagle.py`     DraftHead, its weights file (tied to the target by fingerprint), EagleDrafter
- `eagle3.py`    Eagle3Drafter: EAGLE-3 heads as published (SafeAILab/EAGLE, SpecForge safetensors)
- `eagle3_files.py` reading such a head's folder: config.json, safetensors on numpy, tensor names
- `draft_head.py` the head file, the fingerprint check and the tree growth both head drafters
                 share, and HostEagleDrafter (numpy, for a target without torch)
- `tree.py`      SpecTree (sampled candidates), prune_tree, merge_trees, build_dynamic_tree

The head's trainer is not part of this plugin: it is the tooling package `outrider_draft_training`
(tools/train_draft.py is its command line), which imports this one, never the other way round.

Importing this package imports no torch; the factories do, when a manifest asks for them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from outrider import hookimpl
from outrider.accelerators import AcceleratorSpec

__version__ = "0.1.0"


class SpeculativeSection(BaseModel):
    """The `speculative` section as pydantic sees it (config.py documents the knobs).

    Knobs are typed here so a mistake is reported at start as 'speculative.<field>'; options
    under a drafter's name are checked by that drafter's factory when the model loads.
    """

    model_config = ConfigDict(extra="allow", defer_build=True)  # schema built on first use

    drafters: Union[str, list[str]] = ["ngram"]
    max_draft_tokens: StrictInt = Field(16, ge=1, le=1024)
    min_draft_tokens: Optional[StrictInt] = Field(None, ge=0, le=1024)
    max_depth: StrictInt = Field(8, ge=1, le=256)
    prob_threshold: Union[StrictInt, StrictFloat] = Field(0.05, ge=0.0, le=1.0)
    max_children: StrictInt = Field(4, ge=1, le=1024)
    adaptive: StrictBool = True
    batch_draft_tokens: StrictInt = Field(64, ge=0, le=1 << 20)

    @model_validator(mode="after")
    def _drafter_sections(self) -> "SpeculativeSection":
        from .config import SpeculativeConfig

        # Cross-field rules and drafter sub-sections: the same checks the strategy applies
        # (an OptionError is a ValueError naming the sub-field, which the core adds to the path).
        SpeculativeConfig._read(self.section())
        return self

    def section(self) -> dict[str, Any]:
        """The section as given (unset knobs left out, so the strategy applies its defaults)."""
        return self.model_dump(exclude_unset=True)


def make_strategy(manifest: Any, section: Optional[SpeculativeSection] = None):
    """Accelerator factory: the SpeculativeStrategy for a manifest's `speculative` section."""
    from .strategy import SpeculativeStrategy

    return SpeculativeStrategy.from_manifest(manifest)


def make_ngram_drafter(model: Any, options: Optional[Mapping[str, Any]] = None, context: Any = None):
    """Drafter factory: an NgramDrafter from its manifest options."""
    from .drafters import make_ngram_drafter as make

    return make(model, options)


def make_draft_model_drafter(model: Any, options: Optional[Mapping[str, Any]] = None, context: Any = None):
    """Drafter factory: a small model of the target's vocabulary drafting a tree (draft_model.py)."""
    from .draft_model import make_draft_model_drafter as make

    return make(model, options, context)


def make_eagle_drafter(model: Any, options: Optional[Mapping[str, Any]] = None, context: Any = None):
    """Drafter factory: an EagleDrafter over `model` (option `weights`: default the shipped head,
    relative to the manifest's folder as every drafter's file); for a model without torch
    (`array_api = "numpy"`), the same head drafting on numpy (draft_head.py)."""
    weights = (options or {}).get("weights")
    if context is not None and isinstance(weights, str):
        options = {**options, "weights": str(context.resolve(weights))}
    if model is not None and model.array_api == "numpy":  # no model: the torch factory says what is missing
        from .draft_head import make_host_eagle_drafter as make
    else:
        from .eagle import make_eagle_drafter as make

    return make(model, options)


def make_eagle3_drafter(model: Any, options: Optional[Mapping[str, Any]] = None, context: Any = None):
    """Drafter factory: a published EAGLE-3 head over the target's captured layers (eagle3.py)."""
    from .eagle3 import make_eagle3_drafter as make

    return make(model, options, context)


@hookimpl
def outrider_register_accelerators(register: Callable[..., None]) -> None:
    """Register speculative decoding: the decode strategy of the section `speculative`, for generating backends."""
    register(AcceleratorSpec(
        name="speculative-decoding", role="decode_strategy", section="speculative", factory=make_strategy,
        backends=("*",), config=SpeculativeSection, uses_drafters=True,  # any backend that generates (the core checks)
        description="draft trees (n-gram, trained draft head) verified losslessly in one target forward",
    ))


@hookimpl
def outrider_register_drafters(register: Callable[[str, Any], None]) -> None:
    """Register the n-gram (prompt lookup) drafter as "ngram", the trained draft head as "eagle", a
    draft model (a small GGUF of the target's vocabulary) as "model" and published EAGLE-3 heads as
    "eagle3"."""
    register("ngram", make_ngram_drafter)
    register("eagle", make_eagle_drafter)
    register("model", make_draft_model_drafter)
    register("eagle3", make_eagle3_drafter)
