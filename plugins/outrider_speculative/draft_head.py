"""The trained draft head ("eagle") without torch: its weights file, the target check, the drafting
loop both drafters share, and `HostEagleDrafter`, which drafts on numpy through the target's own
matmuls (`CausalLM.make_linear`) for a model that has no torch (the llm backend's native CPU model).

eagle.py holds the torch side (the head as a module, training's save, `EagleDrafter`); the file
format, the fingerprint rule and how a tree grows from the head's outputs are this module's, so the
two drafters read the same file and propose by the same rules. What the head computes is eagle.py's
`DraftHead.forward` (see its docstring); here it is the same arithmetic in fp32 numpy, the matmuls
in the target's kernels (`quantize: int4`: 4-bit groups of 32, as the torch side's), so drafts
differ from the torch drafter's only by rounding, and every draft is verified by the target anyway.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from outrider.errors import ManifestError
from outrider.generation.contract import SampledChildren
from outrider.generation.sampling import host_array, is_greedy, target_distribution
from outrider.generation.verify import sampling_knobs

from .config import OptionError, known_options, read_bool, read_float, read_int
from .tree import SampledExpansion, SpecTree, build_dynamic_tree, draw_distinct

FORMAT = "outrider-eagle/1"
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "smollm2-eagle.safetensors"
TRAIN_HINT = "python tools/train_draft.py [--gguf FILE] --out PATH (then set speculative.eagle.weights: PATH)"
OPTIONS = ("weights", "max_depth", "max_children", "prob_threshold", "frontier", "dtype", "sample", "quantize")


@dataclass
class HeadConfig:
    """Shape of a draft head; stored in the weights file's metadata."""

    hidden_size: int
    intermediate_size: int
    draft_vocab_size: int
    num_blocks: int = 1
    rms_norm_eps: float = 1e-5

    def to_json(self) -> str:
        """The config as a JSON string (safetensors metadata is str -> str)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "HeadConfig":
        """Inverse of `to_json`; ignores unknown keys."""
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def target_fingerprint(model: Any) -> str:
    """The target's weights fingerprint (`CausalLM.fingerprint`): the trainer and the loader both call this."""
    return model.fingerprint()


def check_fingerprint(path: Path, metadata: Mapping[str, str], hidden_size: int, draft_vocab_max: int,
                      model: Any) -> str:
    """The target's fingerprint; ManifestError when the head was trained for other weights or shapes."""
    actual = target_fingerprint(model)
    expected = metadata.get("target_fingerprint", "")
    if expected != actual:
        trained_for = metadata.get("target") or "another model"
        raise ManifestError(
            f"eagle draft head {str(path)!r} was trained for other target weights "
            f"({trained_for}, fingerprint {expected[:16] or '(none)'}...) than the model being served "
            f"(fingerprint {actual[:16]}...): its drafts would be rejected. Retrain it for this model with "
            f"{TRAIN_HINT}, or drop 'eagle' from speculative.drafters"
        )
    if hidden_size != model.hidden_size or draft_vocab_max >= model.vocab_size:
        raise ManifestError(f"eagle draft head {str(path)!r} does not fit this model's shape")
    return actual


class HeadDrafter:
    """Grows a draft tree from a head's outputs (eagle.py's module docstring: best-first by cumulative
    probability; top-k children for greedy requests, children drawn from q for sampling ones).
    Subclasses give `_run(states, tokens) -> (features, logits)` (host numpy logits over the draft
    vocabulary), `_stack(states)` and `_root(hidden)`."""

    name = "eagle"

    def __init__(self, model: Any, draft_ids: np.ndarray, max_depth: int, max_children: int,
                 prob_threshold: float, frontier: int, sample: bool) -> None:
        self.model = model
        self.sample = sample  # draw children from q when the request samples
        self._draft_ids = np.asarray(draft_ids, dtype=np.int64)  # what sampled draws and top-k index
        self.max_depth = max_depth
        self.max_children = max_children
        self.prob_threshold = prob_threshold
        self.frontier = frontier
        self.calls = 0  # head forwards (expand calls), for benchmarks
        self._lock = threading.Lock()  # instance threads may share one drafter

    def _run(self, states: list, tokens: list[int]) -> tuple[Any, Any]:
        raise NotImplementedError

    def _top(self, logits: Any, k: int) -> tuple[list, list]:
        """Per row, the k most probable draft tokens: (probabilities, vocabulary ids), best first."""
        logits = host_array(logits)
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = shifted / shifted.sum(axis=-1, keepdims=True)
        k = min(k, probs.shape[-1])
        top = np.argpartition(-probs, k - 1, axis=-1)[:, :k]
        order = np.take_along_axis(probs, top, axis=-1).argsort(axis=-1, kind="stable")[:, ::-1]
        top = np.take_along_axis(top, order, axis=-1)
        return np.take_along_axis(probs, top, axis=-1).tolist(), self._draft_ids[top].tolist()

    def sample_children(self, logits: Any, features: Any, k: int, temperature: float, top_k: int, top_p: float,
                        generator: np.random.Generator) -> list:
        """Per node, up to k children drawn without replacement from q = the head's tempered, truncated distribution."""
        # The same function the target's p comes from, on the draft vocabulary: q then tracks p
        # (same temperature, same cuts), which is what makes min(1, p/q) accept often.
        logits = host_array(logits)
        vocab = self.model.vocab_size
        out: list = []
        for i in range(logits.shape[0]):
            row = target_distribution(logits[i], temperature, top_k, top_p)
            drawn = draw_distinct(row, k, generator)
            if not drawn:  # no usable q: no children, nothing drawn
                out.append([])
                continue
            full = np.zeros(vocab, dtype=np.float32)
            full[self._draft_ids] = row  # the exact weights the draws came from, in vocabulary ids
            tokens = self._draft_ids[drawn].tolist()
            group = SampledChildren(q=full, draws=tokens, replacement=False)
            out.append(SampledExpansion(group, [(t, float(row[d]), features[i]) for t, d in zip(tokens, drawn)]))
        return out

    def propose(self, view: Any, budget: int) -> SpecTree:
        """A best-first tree of at most `budget` nodes after the pending token (sampled children at T > 0)."""
        hidden = view.last_hidden
        if budget <= 0 or hidden is None or not view.token_ids:
            return SpecTree()
        with self._lock:
            return self._grow(view, budget, self._root(hidden))

    def _grow(self, view: Any, budget: int, root_state: Any) -> SpecTree:
        """The tree from `root_state` (the root's state for `_run`), the drafter's lock held."""
        k = self.max_children
        temperature, top_k, top_p = sampling_knobs(view.params)
        sampled = self.sample and not is_greedy(temperature)
        generator = view.generator
        pending = int(view.token_ids[-1])

        def expand_fn(nodes: list) -> list:
            # A node's state is the feature that stands for the hidden state *before* its token:
            # the target's h_t for the pending token (the root), the parent's f deeper down.
            self.calls += 1
            features, logits = self._run([node.state for node in nodes],
                                         [pending if node.token is None else node.token for node in nodes])
            if sampled:
                return self.sample_children(logits, features, k, temperature, top_k, top_p, generator)
            probs, ids = self._top(logits, k)
            return [[(t, p, features[i]) for t, p in zip(ids[i], probs[i])] for i in range(len(nodes))]

        return build_dynamic_tree(expand_fn, budget, self.max_depth, self.prob_threshold, k,
                                  root_state=root_state, batched=True, frontier=self.frontier)


# ---- on numpy -------------------------------------------------------------------------------------


def read_head_file(path: Path) -> tuple[HeadConfig, dict[str, np.ndarray], np.ndarray, dict[str, str]]:
    """(config, fp32 tensors, draft vocabulary int64, metadata) of a head file, without torch;
    ManifestError when it is missing or not an outrider eagle head."""
    from safetensors import safe_open

    if not path.is_file():
        raise ManifestError(f"eagle draft head: weights file {str(path)!r} does not exist; train one with {TRAIN_HINT}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
        config = HeadConfig.from_json(metadata["config"])
        draft_vocab = tensors.pop("draft_vocab").astype(np.int64)
        expected = {"norm_hidden", "norm_embed", "fc.weight", "norm_out",
                    *(f"blocks.{i}.{n}" for i in range(config.num_blocks) for n in ("norm", "gate_up.weight", "down.weight"))}
        if set(tensors) != expected:
            raise ValueError(f"tensors {sorted(tensors)}, expected {sorted(expected)}")
    except Exception as exc:
        raise ManifestError(f"eagle draft head: {str(path)!r} is not a usable head file ({type(exc).__name__}: {exc})") from None
    if draft_vocab.size != config.draft_vocab_size:
        raise ManifestError(f"eagle draft head: {str(path)!r} has {draft_vocab.size} draft tokens, config says "
                            f"{config.draft_vocab_size}")
    return config, {k: v.astype(np.float32) for k, v in tensors.items()}, draft_vocab, metadata


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight


class HostHead:
    """The head's forward (eagle.DraftHead.forward) in fp32 numpy, its matmuls the target's own
    (`make_linear`, 4-bit groups with `quantize="int4"`)."""

    def __init__(self, config: HeadConfig, tensors: dict[str, np.ndarray], lm_rows: np.ndarray, model: Any,
                 quantize: Optional[str]) -> None:
        self.eps, self.inter = config.rms_norm_eps, config.intermediate_size
        extra = {"quantize": quantize} if quantize else {}
        linear = lambda weight: model.make_linear(np.ascontiguousarray(weight, dtype=np.float32), **extra)  # noqa: E731
        self.norm_hidden, self.norm_embed, self.norm_out = (tensors[n] for n in ("norm_hidden", "norm_embed", "norm_out"))
        self.fc = linear(tensors["fc.weight"])
        self.blocks = [(tensors[f"blocks.{i}.norm"], linear(tensors[f"blocks.{i}.gate_up.weight"]),
                        linear(tensors[f"blocks.{i}.down.weight"])) for i in range(config.num_blocks)]
        self.lm = linear(lm_rows)

    def __call__(self, hidden: np.ndarray, embeds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(features [n, H], draft-vocabulary logits [n, K])."""
        eps, inter = self.eps, self.inter
        x = np.concatenate([rms_norm(hidden, self.norm_hidden, eps), rms_norm(embeds, self.norm_embed, eps)], axis=-1)
        x = self.fc(np.ascontiguousarray(x, dtype=np.float32))
        for norm, gate_up, down in self.blocks:
            g = gate_up(np.ascontiguousarray(rms_norm(x, norm, eps), dtype=np.float32))
            gate = g[:, :inter]
            x = down(np.ascontiguousarray(gate / (1 + np.exp(-gate)) * g[:, inter:], dtype=np.float32)) + x
        features = np.ascontiguousarray(rms_norm(x, self.norm_out, eps), dtype=np.float32)
        return features, self.lm(features)


class HostEagleDrafter(HeadDrafter):
    """The eagle drafter on numpy, for a target without torch (it needs the target's make_linear)."""

    def __init__(self, model: Any, head: HostHead, draft_ids: np.ndarray, max_depth: int = 8, max_children: int = 4,
                 prob_threshold: float = 0.05, frontier: int = 8, sample: bool = True) -> None:
        super().__init__(model, draft_ids, max_depth, max_children, prob_threshold, frontier, sample)
        self.compiled = head

    def _run(self, states: list, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return self.compiled(np.stack(states), self.model.embed(np.asarray(tokens, dtype=np.int64)))

    def _root(self, hidden: Any) -> np.ndarray:
        return host_array(hidden).reshape(-1)

    def warmup(self) -> None:
        """Run the head once per batch size it will see, so the first request pays no setup."""
        h = np.zeros(self.model.hidden_size, dtype=np.float32)
        for n in sorted({1, self.max_children, self.frontier}):
            self._run([h] * n, [0] * n)


def make_host_eagle_drafter(model: Any, options: Optional[Mapping[str, Any]] = None) -> HostEagleDrafter:
    """Drafter factory for a target without torch: the same options and checks as eagle.make_eagle_drafter."""
    import os

    options = known_options(options, OPTIONS, "eagle")
    weights = options.get("weights") or DEFAULT_WEIGHTS
    if not isinstance(weights, (str, os.PathLike)):
        raise OptionError("weights", f"expected a path to a .safetensors head (got {weights!r})")
    if options.get("dtype", "model") not in ("model", "fp32", "float32"):
        raise OptionError("dtype", f"this model computes without torch: the head runs in fp32 (model or fp32), "
                                   f"got {options['dtype']!r}")
    quantize = options.get("quantize", "none")
    if quantize not in ("none", "int4"):
        raise OptionError("quantize", f"expected 'none' or 'int4' (got {quantize!r})")
    path = Path(weights).expanduser()
    config, tensors, draft_vocab, metadata = read_head_file(path)
    check_fingerprint(path, metadata, config.hidden_size, int(draft_vocab.max()), model)
    head = HostHead(config, tensors, model.lm_head_rows(draft_vocab), model, None if quantize == "none" else quantize)
    drafter = HostEagleDrafter(model, head, draft_vocab, read_int(options, "max_depth", 8, 1, 256),
                               read_int(options, "max_children", 4, 1, 64),
                               read_float(options, "prob_threshold", 0.05, 0.0, 1.0),
                               read_int(options, "frontier", 8, 1, 256), read_bool(options, "sample", True))
    drafter.warmup()
    return drafter
