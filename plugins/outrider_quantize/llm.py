"""Weight quantization of Llama-shaped LLMs ("llama-weights" artifacts) with a measured quality gate.

An artifact transform: the `llm` backend hands over its fp32 "llama-weights" directory
(weights.safetensors, tokenizer.json, meta.json) and gets back another one whose linear weights
are stored quantized, in the format of `outrider.generation.weights` (which the backend's kernels
read); bf16 mode stores the linear weights in bf16 and says "dtype": "bf16" in meta.json.

Imports numpy, safetensors and `outrider.*` only (an accelerator never imports a backend plugin),
and torch only where it quantizes: a start whose quantized artifact is cached imports no torch, so
a backend that serves it without torch (the llm backend's native runtime) keeps torch out of the
process. The backend passes what the gate needs as `context.helpers`: `build_model(artifact) ->
CausalLM` (the model that will serve: the gate measures it) and `tokenize(text) -> list[int]`.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from outrider.accelerators import WeightFormat
from outrider.artifacts import Artifact
from outrider.errors import ManifestError, QualityGateError
from outrider.manifest import Manifest
from outrider.generation.contract import Chunk
from outrider.generation.sampling import host_array
from outrider.hardware import cpu_has_bf16_instructions

if TYPE_CHECKING:
    import torch

log = logging.getLogger("outrider.quantize")

WEIGHTS_FILE, TOKENIZER_FILE, META_FILE = "weights.safetensors", "tokenizer.json", "meta.json"
KIND = "llama-weights"
EMBEDDINGS = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
MODES = ("int4", "int8", "bf16")
HEAD_MODES = (*MODES, "float")
# Tokens per forward when measuring quality: bounds the attention masks' memory on long texts.
QUALITY_CHUNK = 128

# Held-out texts for the quality gate, written for this module (not taken from tests or benches).
HELD_OUT_CODE = '''\
import heapq
from collections import defaultdict


def shortest_paths(graph, source):
    """Dijkstra over a dict of {node: [(neighbour, weight), ...]}; returns {node: distance}."""
    distance = defaultdict(lambda: float("inf"))
    distance[source] = 0
    frontier = [(0, source)]
    while frontier:
        cost, node = heapq.heappop(frontier)
        if cost > distance[node]:
            continue
        for neighbour, weight in graph.get(node, []):
            candidate = cost + weight
            if candidate < distance[neighbour]:
                distance[neighbour] = candidate
                heapq.heappush(frontier, (candidate, neighbour))
    return dict(distance)


class RingBuffer:
    def __init__(self, capacity):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.items = [None] * capacity
        self.start = 0
        self.size = 0

    def push(self, value):
        end = (self.start + self.size) % len(self.items)
        self.items[end] = value
        if self.size < len(self.items):
            self.size += 1
        else:
            self.start = (self.start + 1) % len(self.items)

    def __iter__(self):
        for i in range(self.size):
            yield self.items[(self.start + i) % len(self.items)]
'''

HELD_OUT_PROSE = """\
The ferry left the harbour a little after six, when the fog was still lying low over the water
and the gulls had not yet started their quarrelling. Most of the passengers stayed inside, where
the windows were fogged and someone had switched on the small television above the bar. Marta
went out on deck instead. She liked the cold at that hour, the smell of diesel and salt, and the
way the town slowly disappeared behind them until only the church tower was left, and then not
even that.

Her grandmother had made the same crossing every summer for forty years. She used to say that
the island was not a place you visited but a place you returned to, even the first time. Marta
had never understood what she meant. Now, with the engine humming under her feet and the grey
line of the coast appearing ahead, she thought she was beginning to.

When they docked, the harbour master was already waiting with his clipboard, counting cars and
bicycles as if the numbers might have changed during the night. A boy sold newspapers from a
wooden cart. The bakery on the corner had its door open, and the first loaves of the day were
cooling on a rack in the window. Marta bought two rolls, ate one on the way up the hill, and
kept the other for later, although she already knew she would not manage to keep it long.
"""


# ---- quantization ---------------------------------------------------------------------------


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """A 2-D `.weight` other than the input embeddings: a projection or the LM head."""
    return name.endswith(".weight") and tensor.dim() == 2 and name != EMBEDDINGS


def int4_from_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    """GGUF Q4_1 blocks (w = q * d + m, q packed as int4.q) as int4: scale = d, zero = m + 8 d, exact in fp32."""
    import torch

    d, m = d.float(), m.float()
    return {"q": q.to(torch.uint8), "scale": d, "zero": m + 8 * d}


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-output-channel symmetric int8 of an fp32 [out, in] weight: {q, scale}."""
    import torch

    weight = weight.float()
    scale = weight.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"q": q, "scale": scale}


def quantize_state_dict(
    state_dict: dict[str, torch.Tensor], mode: str, group_size: int = 32, head_mode: Optional[str] = None
) -> dict[str, torch.Tensor]:
    """Linear weights of a Hugging Face Llama state dict in `mode` ("int4" | "int8" | "bf16").

    int4 copies GGUF Q4_1 blocks (`N.q4_1.q/d/m`) exactly when present and group_size is 32, and
    rounds fp32 to nearest (min/max per group) otherwise; int8 is per-channel symmetric; bf16
    casts the linear weights to bf16. A tied head (no `lm_head.weight`) is quantized from the
    embeddings and stored as `lm_head.weight.*`. The raw `*.q4_1.*` blocks and the fp32 copies of
    quantized weights are dropped; embeddings and norms stay fp32.

    `head_mode` (default: `default_head_mode(mode)`) treats the LM head apart: it is the most
    sensitive matrix. SmolLM2 teacher-forced top-1 agreement with fp32, on the held-out texts,
    int4 layers fixed: int4 head 0.881 (ppl ratio 1.035), int8 head 0.979 (0.999). "float" leaves
    it unquantized: the model runs it in its compute dtype (bf16 next to packed int4 kernels), or
    next to w4a8 layers as block-wise int8 (see `default_head_mode`).
    """
    import torch

    from outrider.generation.weights import quantize_int4

    if mode not in MODES:
        raise ValueError(f"quantize_state_dict: mode must be one of {MODES}, got {mode!r}")
    head_mode = head_mode or default_head_mode(mode)
    if head_mode not in HEAD_MODES or (head_mode == "bf16") != (mode == "bf16"):
        raise ValueError(f"quantize_state_dict: head_mode must be int4, int8 or float (bf16 only with mode bf16), "
                         f"got {head_mode!r} for mode {mode!r}")
    raw = {k for k in state_dict if ".q4_1." in k}
    out = {k: v for k, v in state_dict.items() if k not in raw}
    names = [k for k, v in out.items() if is_linear_weight(k, v)]
    sources = {name: out[name] for name in names}
    if head_mode == "float":
        sources.pop(HEAD, None)
    elif HEAD not in sources and EMBEDDINGS in out and mode != "bf16":
        # Tied: the head gets its own quantized copy (in bf16 the model casts the fp32 embeddings).
        sources[HEAD] = out[EMBEDDINGS]
    for name, weight in sources.items():
        if name in out:
            del out[name]
        this = head_mode if name == HEAD else mode
        if this == "bf16":
            out[name] = weight.to(torch.bfloat16)
            continue
        if this == "int8":
            parts = quantize_int8(weight)
        elif group_size == 32 and f"{name}.q4_1.q" in state_dict:
            parts = int4_from_q4_1(*(state_dict[f"{name}.q4_1.{k}"] for k in ("q", "d", "m")))
        else:
            parts = quantize_int4(weight, group_size)
        for key, value in parts.items():
            out[f"{name}.{this}.{key}"] = value.contiguous()
    return out


# ---- quality -------------------------------------------------------------------------------


def _logits(model: Any, tokens: list[int]) -> np.ndarray:
    """Teacher-forced fp32 logits [n, vocab] of `tokens`, fed in chunks through the model's KV cache
    (numpy chunks: every CausalLM takes them, a torch model converts them)."""
    cache = model.new_cache(1, len(tokens))
    rows = []
    for start in range(0, len(tokens), QUALITY_CHUNK):
        part = tokens[start : start + QUALITY_CHUNK]
        chunk = Chunk(0, np.asarray(part, dtype=np.int64), np.arange(start, start + len(part), dtype=np.int64))
        rows.append(np.array(host_array(model.forward(cache, [chunk]).logits), dtype=np.float32))
        cache.commit(0, list(range(len(part))))
    return np.concatenate(rows)


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum over rows of -log softmax(row)[target], in fp64."""
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))
    return float((log_z - x[np.arange(len(targets)), targets]).sum())


def llm_quality(reference: Any, candidate: Any, token_ids_list: list[list[int]]) -> dict[str, float]:
    """Teacher-forced top-1 agreement and perplexity ratio (candidate / reference) of two `CausalLM`s
    (either array API: torch or numpy).

    Both models see the same tokens; agreement counts positions whose argmax next tokens match,
    perplexity is exp(mean negative log-likelihood of the actual next tokens) over all texts.
    """
    agree = total = 0
    nll_ref = nll_cand = 0.0
    for tokens in token_ids_list:
        tokens = [int(t) for t in tokens]
        if len(tokens) < 2:
            continue
        ref, cand = _logits(reference, tokens), _logits(candidate, tokens)
        target = np.asarray(tokens[1:], dtype=np.int64)
        agree += int((ref[:-1].argmax(-1) == cand[:-1].argmax(-1)).sum())
        total += len(tokens) - 1
        nll_ref += _nll(ref[:-1], target)
        nll_cand += _nll(cand[:-1], target)
    if total == 0:
        raise ValueError("llm_quality needs at least one text of 2 or more tokens")
    return {
        "top1_agreement": agree / total,
        "ppl_ratio": math.exp((nll_cand - nll_ref) / total),
        "ppl_reference": math.exp(nll_ref / total),
        "ppl_candidate": math.exp(nll_cand / total),
        "tokens": total,
    }


# ---- mode: auto ------------------------------------------------------------------------------


def default_head_mode(mode: str, kernel: str = "auto", tied: bool = True) -> str:
    """How the LM head is stored next to `mode` weights run by `kernel` (quantize.kernel).

    Next to int4 layers on the w4a8 kernels, a tied head: unquantized ("float"). The model then
    runs it as the embedding table in blocks of 32 int8 values with int8 activations on the same
    native kernels (a GGUF's Q8_0 table exactly as the file holds it): the same bits on every CPU,
    and the form the torch-free native runtime serves too.
    Next to other int4 layers: unquantized ("float", so bf16 at run time) where the CPU multiplies
    bf16 natively: as accurate as int8 and faster at every row count there (SmolLM2's 576 x 49152
    head, Xeon with AMX, 2 threads: bf16 1.6 ms at 1 row and flat to 32 rows; int8 2.6 ms at 1 row
    and ~linear in rows), else int8. Other modes: the same as the layers.
    """
    if mode == "int4":
        if kernel == "w4a8" and tied:
            return "float"
        return "float" if cpu_has_bf16_instructions() else "int8"
    return mode


def resolve_mode(mode: str) -> str:
    """The concrete mode for `mode`; "auto" is bf16 where the CPU multiplies bf16 natively
    (avx512_bf16 / AMX), else int4 (the backend then measures its kernels for those weights at load,
    and dequantizes to a dense kernel where the packed ones lose)."""
    if mode in MODES:
        return mode
    if mode != "auto":
        raise ManifestError(f"{mode!r} is not supported for LLM weights on this backend (use one of {MODES} or auto)")
    return "bf16" if cpu_has_bf16_instructions() else "int4"


# ---- the transform ---------------------------------------------------------------------------


class LlmWeightQuantizer:
    """`artifact_transform` for "llama-weights": quantize the linear weights, gate on measured quality."""

    def __init__(self, manifest: Manifest, config: Any) -> None:
        """`config` is the manifest's validated `quantize` section (`QuantizeConfig`)."""
        self.manifest = manifest
        self.config = config
        self.weight_format = WeightFormat(str(config.mode), int(config.group_size), str(config.kernel))
        try:  # at start, not at load: a mode these weights cannot take fails before anything loads
            resolve_mode(config.mode)
        except ManifestError as exc:
            where = manifest.where
            raise ManifestError(f"{where}: field 'quantize.mode': {exc.message}") from None

    def apply(self, artifact: Artifact, context: Any) -> Artifact:
        """A "llama-weights" artifact with quantized weights, built once per input and options."""
        if artifact.kind != KIND:
            raise ValueError(f"the LLM weight quantizer takes a {KIND!r} artifact, got {artifact.kind!r}")
        for helper in ("build_model", "tokenize"):
            if helper not in context.helpers:
                raise ValueError(f"the LLM weight quantizer needs context.helpers[{helper!r}] from the backend")
        config = self.config
        mode = resolve_mode(config.mode)
        group_size = int(config.group_size)
        source = Path(artifact.path) / WEIGHTS_FILE
        source_meta = json.loads((Path(artifact.path) / META_FILE).read_text())
        tied = bool(source_meta.get("config", {}).get("tie_word_embeddings", True))
        head_mode = default_head_mode(mode, config.kernel, tied)  # see quantize_state_dict

        def build(directory: Path, progress: Any) -> dict:
            from safetensors.torch import load_file, save_file

            state_dict = load_file(str(source))
            quantized = quantize_state_dict(state_dict, mode, group_size, head_mode)
            del state_dict
            save_file(quantized, str(directory / WEIGHTS_FILE))
            del quantized
            shutil.copyfile(Path(artifact.path) / TOKENIZER_FILE, directory / TOKENIZER_FILE)
            meta = dict(source_meta)
            meta["quantize"] = {"mode": mode, "head_mode": head_mode, "group_size": group_size if mode == "int4" else None}
            if mode == "bf16":
                meta["dtype"] = "bf16"
            (directory / META_FILE).write_text(json.dumps(meta))
            figures = self._measure(artifact, Artifact(directory, KIND), context)
            figures["weights_bytes"] = (directory / WEIGHTS_FILE).stat().st_size
            return figures

        built = context.cache.get_or_build(
            f"{KIND}-{mode}", build, label=f"{self.manifest.name} weights -> {mode}",
            # The kernel that computes the model here is part of the key (the backend says which, as
            # far as it changes the result): the gate measures the model as that kernel computes it
            # (w4a8 quantizes activations too), and its figures live in the provenance.
            sources=[source], versions=["torch"],
            # The float artifact's own format too: quantized weights carry its layout and meta, so
            # a conversion that changes (its format bumped) must not meet quantized weights of the old.
            options={"mode": mode, "group_size": group_size, "head_mode": head_mode, "kernel": config.kernel,
                     "weights_format": source_meta.get("format"),
                     "computed_by": context.helpers["kernel_key"](mode) if "kernel_key" in context.helpers else None},
        )
        built = Artifact(built.path, KIND, built.provenance)  # what the backend loads is a llama-weights dir
        figures = {k: built.provenance[k] for k in ("top1_agreement", "ppl_ratio") if k in built.provenance}
        failures = config.gate.failures(figures)
        report = {"transform": "quantize", "mode": mode, **figures,
                  "gate": "passed" if not failures else "failed: " + "; ".join(failures)}
        context.reports.append(report)
        if failures:
            message = (f"{mode} weights missed the quality gate: {'; '.join(failures)} "
                       f"(measured {json.dumps(figures)}; artifact {built.path})")
            if config.gate.on_fail != "warn":
                raise QualityGateError(message)
            log.warning("%s; serving anyway (gate.on_fail: warn)", message)
        return built

    @staticmethod
    def _measure(reference: Artifact, candidate: Artifact, context: Any) -> dict:
        """Quality of `candidate` against `reference` on the held-out code and prose."""
        tokens = [list(context.helpers["tokenize"](text)) for text in (HELD_OUT_CODE, HELD_OUT_PROSE)]
        started = time.monotonic()
        ref_model = context.helpers["build_model"](reference)
        cand_model = context.helpers["build_model"](candidate)
        figures = llm_quality(ref_model, cand_model, tokens)
        figures["gate_seconds"] = round(time.monotonic() - started, 2)
        return figures
