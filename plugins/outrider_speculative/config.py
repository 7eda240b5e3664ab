"""The manifest's `speculative` section: knobs, defaults, and errors that name the field.

    speculative:
      drafters: [ngram]        # drafters asked each step; their trees are merged
      max_draft_tokens: 16     # most tree nodes per sequence per step
      min_draft_tokens: 2      # the adaptive budget never drops below this (keeps probing)
      max_depth: 8             # longest drafted path
      prob_threshold: 0.05     # nodes whose drafter probability is lower are not drafted
      max_children: 4          # most candidates under one node
      adaptive: true           # adapt each sequence's budget to its recent acceptance
      batch_draft_tokens: 64   # draft nodes per step across all active sequences
      cost_gate: true          # per sequence, speculate only while it yields more tokens per second than plain
      max_verify_cost: 1.5     # cap max_draft_tokens where verifying them costs more plain steps, and a step's
                               # draft rows across its sequences likewise (measured at attach; 0: off)
      ngram: {max_ngram: 4}    # options of one drafter, under its name

This module imports no torch: a manifest can be checked without loading a framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from outrider.errors import ManifestError


class OptionError(ValueError):
    """A bad option value; `field` is its name inside the section that was being read."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"field '{field}': {message}")
        self.field = field
        self.message = message


def known_options(options: Optional[Mapping[str, Any]], known: Sequence[str], drafter: str) -> dict[str, Any]:
    """A drafter's options as a dict, or OptionError naming the first one it does not know."""
    options = dict(options or {})
    for name in options:
        if name not in known:
            raise OptionError(name, f"unknown {drafter} option (misspelled?); expected one of {list(known)}")
    return options


def path_drafter_options(options: Optional[Mapping[str, Any]], known: Sequence[str], drafter: str,
                         expected: str) -> tuple[dict[str, Any], str]:
    """(options, the required `path`) of a drafter made from a file: unknown options and a missing
    path are OptionErrors naming the field."""
    options = known_options(options, known, drafter)
    return options, read_path(options, expected)


def read_path(options: Mapping[str, Any], expected: str) -> str:
    """The required `path` option, or OptionError saying what it should name."""
    path = options.get("path")
    if not isinstance(path, str) or not path:
        raise OptionError("path", f"expected {expected}, got {path!r}")
    return path


def read_int(options: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    """An integer option in [low, high], or OptionError naming it."""
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OptionError(name, f"expected an integer from {low} to {high} (got {value!r})")
    return value


def read_float(options: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    """A number option in [low, high], or OptionError naming it."""
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise OptionError(name, f"expected a number from {low} to {high} (got {value!r})")
    return float(value)


def read_bool(options: Mapping[str, Any], name: str, default: bool) -> bool:
    """A true/false option, or OptionError naming it."""
    value = options.get(name, default)
    if not isinstance(value, bool):
        raise OptionError(name, f"expected true or false (got {value!r})")
    return value


def _read_verify_cost(section: Mapping[str, Any]) -> float:
    """`max_verify_cost`: 0 (no cap), or how many one-row steps a full budget's step may cost (>= 1)."""
    value = read_float(section, "max_verify_cost", SpeculativeConfig.max_verify_cost, 0.0, 1e6)
    if 0 < value < 1:
        raise OptionError("max_verify_cost", f"expected 0 (no cap) or a ratio of at least 1, the cost of a "
                                             f"one-row step (got {value!r})")
    return value


KNOBS = (
    "drafters", "max_draft_tokens", "min_draft_tokens", "max_depth", "prob_threshold",
    "max_children", "adaptive", "batch_draft_tokens", "cost_gate", "max_verify_cost",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """The validated `speculative` section."""

    drafters: tuple[str, ...] = ("ngram",)
    max_draft_tokens: int = 16
    min_draft_tokens: int = 2
    max_depth: int = 8
    prob_threshold: float = 0.05
    max_children: int = 4
    adaptive: bool = True
    batch_draft_tokens: int = 64
    cost_gate: bool = True
    max_verify_cost: float = 1.5
    drafter_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_section(cls, section: Optional[Mapping[str, Any]], where: str = "manifest") -> "SpeculativeConfig":
        """Validate a manifest's `speculative` mapping; ManifestError names 'speculative.<field>'."""
        try:
            return cls._read(section)
        except OptionError as exc:
            raise ManifestError(f"{where}: field 'speculative.{exc.field}': {exc.message}") from None

    @classmethod
    def _read(cls, section: Optional[Mapping[str, Any]]) -> "SpeculativeConfig":
        section = {} if section is None else section
        if not isinstance(section, Mapping):
            raise OptionError("(section)", f"expected a mapping of settings (got {section!r:.80})")
        drafters = section.get("drafters", list(cls.drafters))
        if isinstance(drafters, str):
            drafters = [drafters]
        if (not isinstance(drafters, (list, tuple)) or not drafters
                or not all(isinstance(d, str) and d for d in drafters) or len(set(drafters)) != len(drafters)):
            raise OptionError("drafters", f"expected a non-empty list of distinct drafter names (got {drafters!r})")
        max_draft = read_int(section, "max_draft_tokens", cls.max_draft_tokens, 1, 1024)
        min_draft = read_int(section, "min_draft_tokens", min(cls.min_draft_tokens, max_draft), 0, max_draft)
        options: dict[str, dict[str, Any]] = {}
        for key, value in section.items():
            if key in KNOBS:
                continue
            if key not in drafters:
                raise OptionError(key, f"unknown field (misspelled?); expected one of {list(KNOBS)}, "
                                       f"or options under the name of a drafter listed in 'drafters' {list(drafters)}")
            if value is None:
                value = {}
            if not isinstance(value, Mapping):
                raise OptionError(key, f"expected a mapping of options for drafter {key!r} (got {value!r:.80})")
            options[key] = dict(value)
        return cls(
            drafters=tuple(drafters),
            max_draft_tokens=max_draft,
            min_draft_tokens=min_draft,
            max_depth=read_int(section, "max_depth", cls.max_depth, 1, 256),
            prob_threshold=read_float(section, "prob_threshold", cls.prob_threshold, 0.0, 1.0),
            max_children=read_int(section, "max_children", cls.max_children, 1, 1024),
            adaptive=read_bool(section, "adaptive", cls.adaptive),
            batch_draft_tokens=read_int(section, "batch_draft_tokens", cls.batch_draft_tokens, 0, 1 << 20),
            cost_gate=read_bool(section, "cost_gate", cls.cost_gate),
            max_verify_cost=_read_verify_cost(section),
            drafter_options=options,
        )

    def options_for(self, drafter: str) -> dict[str, Any]:
        """A drafter factory's options: the shared limits, overridden by the drafter's own section."""
        shared = {"max_depth": self.max_depth, "max_children": self.max_children, "prob_threshold": self.prob_threshold}
        return {**shared, **self.drafter_options.get(drafter, {})}
