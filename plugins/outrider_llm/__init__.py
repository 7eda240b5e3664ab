"""`llm` backend: Llama-shaped text generation (SmolLM2 from its GGUF) with continuous batching.

Loads the GGUF once (dequantized weights are cached on disk), runs the compact forward in
`model.py` over a slot KV cache, and drives `engine.GenerationEngine` from the model's queue.
Speculative decoding comes from the `speculative` accelerator when the manifest turns it on.

Manifest options (`LlmOptions`, validated at start): `max_sequences` (slots, default 8),
`max_length` (context per slot, default 2048), `threads` (default: the cores this process may
use), `dtype` (float32 | bfloat16 | auto: the matmul precision of unquantized weights).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from outrider import hookimpl
from outrider.backend import Availability, Backend, require_packages, torch_device
from outrider.errors import BadRequestError
from outrider.manifest import Manifest

__version__ = "0.1.0"

log = logging.getLogger("outrider.llm")


@hookimpl
def outrider_register_backends(register: Callable[[type], None]) -> None:
    """Register the `llm` backend."""
    register(LlmBackend)


class LlmOptions(BaseModel):
    """The `options` section of an `llm` manifest."""

    model_config = ConfigDict(extra="forbid")

    max_sequences: int = Field(8, ge=1, le=256)
    max_length: int = Field(2048, ge=16, le=131072)
    threads: Optional[int] = Field(None, ge=1, le=1024)
    dtype: Literal["float32", "fp32", "bfloat16", "bf16", "auto"] = "float32"


class LlmBackend(Backend):
    """Text generation; infer requests are refused, generate requests go to the engine."""

    name = "llm"
    generates = True
    device_kinds = ("cpu", "cuda")
    options_model = LlmOptions

    @classmethod
    def availability(cls, manifest: Optional[Manifest] = None, device: str = "auto") -> Availability:
        base = super().availability(manifest, device)
        if not base.available:
            return base
        return require_packages(("torch", "transformers", "gguf"), "llm")

    @classmethod
    def resolve_device(cls, device: str) -> str:
        return torch_device(device)

    @classmethod
    def make_scheduler(cls, manifest: Manifest) -> Any:
        from outrider.generation.engine import GenerationScheduler

        return GenerationScheduler(manifest)

    def load(self) -> None:
        import torch

        from outrider.generation.engine import GenerationEngine

        from .loading import artifact_tokenizer, load_weights_artifact, model_from_artifact

        options = self.options
        threads = options.threads or _physical_cores()
        torch.set_num_threads(threads)
        started = time.perf_counter()
        kernel = self._kernel()
        weights = load_weights_artifact(self.manifest.model_path())
        # Quantization runs here, before the model is built: its quality gate builds the float
        # and the quantized model through these helpers (a transform never imports this plugin).
        tokenizer = artifact_tokenizer(weights)
        weights = self.transform_artifact(
            weights,
            build_model=lambda artifact: model_from_artifact(artifact, device=self.device, kernel=kernel)[0],
            tokenize=tokenizer.encode,
        )
        # A quantized artifact says in which dtype it computes; `options.dtype` is for float weights.
        dtype = None if self.manifest.quantize is not None else options.dtype
        self.model, self.tokenizer = model_from_artifact(weights, dtype=dtype, device=self.device, kernel=kernel)
        log.info("model %s: weights ready in %.2fs (%d threads)", self.manifest.name,
                 time.perf_counter() - started, threads)
        strategy = getattr(self.accelerators, "decode_strategy", None)
        if strategy is not None:
            strategy = strategy.for_instance()  # drafter state is per engine, not per model
        self.engine = GenerationEngine(
            self.model, self.tokenizer, strategy=strategy,
            max_sequences=options.max_sequences, max_length=options.max_length, stats=self.stats,
        )
        if self.engine.strategy is not None:
            self.engine.strategy.attach(self.model, self.tokenizer)

    def _kernel(self) -> str:
        """The quantized matmul kernel the manifest asks for (`quantize.kernel`, default auto)."""
        config = getattr(self.accelerators, "configs", {}).get("quantize")
        return config.kernel if config is not None else "auto"

    def warmup(self) -> None:
        """Generate a few tokens through the whole engine (prefill, drafts, verification)."""
        prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
        for _ in range(max(1, self.manifest.warmup.iterations)):
            self.engine.warm_up(self.tokenizer.encode(prompt), max_tokens=8)

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise BadRequestError(f"model {self.manifest.name!r} generates text; send a generate request")

    def health(self) -> dict[str, Any]:
        engine = getattr(self, "engine", None)
        if engine is None:
            return {"healthy": False, "reason": "not loaded"}
        return {"healthy": True, "device": self.device, "active_sequences": len(engine.active),
                "waiting": len(engine.waiting), "free_slots": len(engine.free_slots)}

    def metadata(self) -> dict[str, Any]:
        engine = getattr(self, "engine", None)
        return {"max_sequences": engine.max_sequences, "max_length": engine.max_length} if engine else {}

    def unload(self) -> None:
        self.engine = None
        self.model = None


def _physical_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1
