"""`llm` backend: Llama-shaped text generation (SmolLM2 from its GGUF) with continuous batching.

Loads the GGUF once (a quantized file in its own block types, see gguf_blocks.py, or dequantized;
cached on disk), runs the compact forward in
`model.py` over a slot KV cache, and drives `engine.GenerationEngine` from the model's queue.
Speculative decoding comes from the `speculative` accelerator when the manifest turns it on.

Manifest options (`LlmOptions`, validated at start): `max_sequences` (slots, default 8),
`max_length` (context per slot, default 2048), `threads` (CPU only; default: the cores this
process may use; one count per process, see `outrider.torch_process`), `dtype` (float32 |
bfloat16 | float16 | auto: the matmul precision of unquantized weights, and on CUDA of quantized
ones too, which run dequantized there), `cuda_graphs` (default true: decode and verify steps on
CUDA replay captured graphs, see `cuda_graphs.py`), `weights` (file | float, default file: a quantized
GGUF without a `quantize:` section is served in its own block types on the native kernels; float
dequantizes it to `dtype`), `prefix_cache_mb` (default 64; 0 = off: K/V of prompt prefixes kept
for later requests that start with the same tokens, see outrider.generation.prefix_cache),
`runtime` (auto | native | torch, default auto: on a CPU, a GGUF served in its own block types
runs on the native kernels' C ABI without torch in the process (native_model.py: ~260 MB and ~1 s
less than torch's import; an EAGLE draft head drafts on numpy there), and so does a `quantize:`
section of `mode: int4` with `kernel: w4a8` (its quality gate is then measured on the native model,
and a start whose quantized artifact is cached imports no torch), unless the model needs the torch
model (another `quantize:`, a float or dense matrix, CUDA); `native` insists and fails saying why
it cannot; `torch` always uses the torch model).

On CUDA a sticky CUDA error (the context is unusable) makes `health()` unhealthy for good, and
running out of GPU memory during warmup fails the load with that reason.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from outrider import hookimpl
from outrider.backend import Availability, GeneratingBackend, require_packages, torch_device
from outrider.bake import BakedFiles, BakesModel
from outrider.hardware import usable_cpus
from outrider.manifest import Manifest
from outrider.torch_process import CudaHealth, is_out_of_memory, release_cpu_threads, set_torch_threads

__version__ = "0.1.0"

log = logging.getLogger("outrider.llm")

#: seconds without a step after which freed heap (a finished request's KV cache, temporaries) goes
#: back to the OS; tune_malloc keeps it otherwise, so that a burst of requests never page-faults
RELEASE_MEMORY_AFTER_S = 1.0


@hookimpl
def outrider_register_backends(register: Callable[[type], None]) -> None:
    """Register the `llm` backend."""
    register(LlmBackend)


class LlmOptions(BaseModel):
    """The `options` section of an `llm` manifest."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # schema built on first use

    max_sequences: int = Field(8, ge=1, le=256)
    max_length: int = Field(2048, ge=16, le=131072)
    threads: Optional[int] = Field(None, ge=1, le=1024)
    dtype: Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "auto"] = "float32"
    cuda_graphs: bool = True
    #: "file": a quantized GGUF's matrices are served in their own block types on the native
    #: kernels (no fp32 copy); "float": dequantized to `dtype`. With a `quantize:` section the
    #: float weights are what it quantizes from, whatever this says.
    weights: Literal["file", "float"] = "file"
    #: Automatic prefix caching (outrider.generation.prefix_cache): K/V of prompt prefixes kept, up
    #: to this many MiB, for later requests that start with the same tokens; 0 turns it off.
    prefix_cache_mb: int = Field(64, ge=0, le=1 << 20)
    #: Which model computes (see the module docstring): "auto" the torch-free native one where it
    #: covers the model, "native" only that one, "torch" the torch one.
    runtime: Literal["auto", "native", "torch"] = "auto"
    #: What the torch-free runtime's KV cache holds (llama.cpp's --cache-type-k/v): "f16" (half the
    #: bytes a token of context, read widened to fp32 by attention), "q8_0" (ggml's blocks of 32 int8
    #: values with an fp16 scale: 17/32 of f16's bytes; head_dim a multiple of 32) or "f32". The torch
    #: model keeps its K/V in its compute dtype.
    kv_cache: Literal["f16", "q8_0", "f32"] = "f16"


class LlmBackend(GeneratingBackend, BakesModel):
    """Text generation; infer requests are refused, generate requests go to the engine."""

    name = "llm"
    device_kinds = ("cpu", "cuda")
    options_model = LlmOptions

    @classmethod
    def availability(cls, manifest: Optional[Manifest] = None, device: str = "auto") -> Availability:
        base = super().availability(manifest, device)
        if not base.available:
            return base
        if manifest is not None and _baked(manifest):
            return base  # the native runtime's tiles: numpy and tokenizers serve them (baking.py)
        return require_packages(("torch", "transformers", "gguf"), "llm")

    @classmethod
    def bake_files(cls, manifest: Manifest, raw: Any) -> BakedFiles:
        """`outrider bake`: the GGUF's packed tiles (and a draft model's) into the directory (baking.py)."""
        from .baking import bake_files

        return bake_files(manifest, raw, LlmOptions.model_validate(manifest.options), bool(raw.get("quantize")))

    @classmethod
    def resolve_device(cls, device: str) -> str:
        return torch_device(device)

    @classmethod
    def make_scheduler(cls, manifest: Manifest) -> Any:
        from outrider.generation.engine import GenerationScheduler

        return GenerationScheduler(manifest)

    def __init__(self, manifest: Manifest, device: str, task: Any = None) -> None:
        super().__init__(manifest, device, task)
        self.model: Any = None  # the CausalLM: NativeLlama (runtime "native") or LlamaModel (torch)
        self.runtime = "torch"  # or "native": chosen in source_artifact
        self.cuda_health: Optional[CudaHealth] = None  # on CUDA: faults seen, for health and recovery
        self.threads: Optional[int] = None
        self.serves_file_blocks = False  # the GGUF's own block types, not float weights
        self.block_types: dict[str, int] = {}
        self._idle_steps: Optional[int] = None  # engine.steps when the idle spell began
        self._idle_since = 0.0
        self._memory_released = False

    def source_artifact(self) -> Any:
        """The GGUF, converted once into the artifact cache: in its own block types (a quantized
        file served as it is), or as float weights (`weights: float`, and what `quantize:` starts
        from). Also sets the process's compute threads, before any transform computes."""
        from .conversion import load_native_artifact, load_weights_artifact

        options = self.options
        on_cuda = self.device.startswith("cuda")
        self.cuda_health = CudaHealth(self.device) if on_cuda else None
        if on_cuda:
            import torch

            if not torch.cuda.is_available():
                from outrider.errors import ManifestError

                raise ManifestError(f"{self.manifest.where}: field 'device': "
                                    f"{self.device} was asked for, but torch {torch.__version__} sees no CUDA GPU")
        self.runtime, self._runtime_reason = self._choose_runtime(options, on_cuda)
        # CUDA work needs no intra-op threads; on CPU the first model of the process sets them.
        self.threads = None if on_cuda else self._set_threads(options.threads or usable_cpus())
        self._loading_since = time.perf_counter()
        quantized = bool(self.accelerators.artifact_transforms)
        self.serves_file_blocks = (self.runtime == "native" and not quantized) or self._serves_file_blocks(options,
                                                                                                            on_cuda)
        path = self.manifest.model_path()
        if path.is_dir() and (self.runtime != "native" or quantized):
            from outrider.errors import ManifestError

            raise ManifestError(f"{self.manifest.where}: model.path {path} is a baked "
                                "model (`outrider bake`), which only the torch-free native runtime serves, and this "
                                f"load runs on {'a quantize: section' if quantized else self._runtime_reason}")
        if self.runtime == "native" and not quantized:
            # The file's blocks packed straight into the native model's tiles, from the mapped file.
            from .gguf_tiles import NotCovered, load_gguf_tiles

            try:
                self._source = load_gguf_tiles(path)
                return self._source
            except NotCovered as exc:
                log.info("model %s: %s: its blocks are converted into an artifact first", self.manifest.name, exc)
        # A first start converts in a child process: the conversion's heap (and its torch) leaves with it.
        load = load_native_artifact if self.serves_file_blocks else load_weights_artifact
        self._source = load(path, in_child=True)
        return self._source

    def _choose_runtime(self, options: LlmOptions, on_cuda: bool) -> tuple[str, str]:
        """("native" | "torch", why): the model that serves (`options.runtime`, see the module
        docstring). Whether the native model covers the file's weights is known once the artifact
        is read: `load` falls back to torch then (under auto)."""
        if options.runtime == "torch":
            return "torch", "options.runtime: torch"
        if on_cuda:
            why = f"device {self.device}"
        elif options.weights != "file":
            why = f"options.weights: {options.weights}"
        elif self.accelerators.artifact_transforms and not self._quantized_natively():
            why = ("a quantize: section whose kernels are the torch model's (the native runtime takes "
                   "mode: int4 with kernel: w4a8)")
        else:
            from . import native_c

            loaded, reason = native_c.library()
            if loaded:
                return "native", ""
            why = f"the native kernels' C library: {reason}"
        if options.runtime == "native":
            from outrider.errors import ManifestError

            raise ManifestError(f"{self.manifest.where}: options.runtime: native "
                                f"cannot serve this model: {why}")
        return "torch", why

    def _quantized_natively(self) -> bool:
        """Whether the `quantize:` section gives weights the native model computes as the torch
        model's w4a8 kernels would: int4 groups (whole tiles of 16 inputs) on kernel w4a8."""
        formats = [t.weight_format for t in self.accelerators.artifact_transforms]
        return (len(formats) == 1 and formats[0] is not None and formats[0].mode == "int4"
                and formats[0].kernel == "w4a8" and formats[0].group_size % 16 == 0)

    def _set_threads(self, threads: int) -> int:
        if self.runtime == "native":
            from . import native_c

            native_c.set_threads(threads)
            return threads
        return set_torch_threads(threads, f"model {self.manifest.name!r}")

    def gate_helpers(self) -> dict[str, Any]:
        """A quantization's quality gate builds the float and the quantized model through these
        (a transform never imports this plugin): the quantized one as this load will serve it, on
        the native runtime the native model. Only a gate that is measured (a first start) imports
        torch here; a cached verdict needs `tokenize` and `kernel_key` alone."""
        from .artifact import artifact_tokenizer

        kernel = self._kernel()
        source = self._source
        tokenizer: list = []
        native = self.runtime == "native"

        def build_model(artifact: Any) -> Any:
            from .artifact import read_artifact_meta
            from .loading import model_from_artifact

            if native and read_artifact_meta(artifact).get("quantize"):
                from .native_model import NativeLlama

                return NativeLlama.from_artifact(artifact)[0]
            return model_from_artifact(artifact, device=self.device, kernel=kernel)[0]

        def kernel_key(mode: str) -> str:
            if native:  # the C ABI's kernels: the same bits on every instruction set
                return f"{mode}:{kernel}:native-c"
            from .kernel_choice import kernel_key as torch_kernel_key

            return torch_kernel_key(mode, kernel, self.device)

        def tokenize(text: str) -> Any:
            # Built on the first call: a start whose gate verdict is cached never tokenizes
            # (reading SmolLM2's tokenizer.json costs ~0.1 s).
            if not tokenizer:
                tokenizer.append(artifact_tokenizer(source))
            return tokenizer[0].encode(text)

        return {"build_model": build_model, "tokenize": tokenize, "kernel_key": kernel_key}

    def load(self) -> None:
        from outrider.generation.engine import GenerationEngine

        from .artifact import read_artifact_meta

        if self.artifact is None:  # used outside the core (a test, a tool): prepare as the core would
            self.prepare_artifact()
        options = self.options
        on_cuda = self.device.startswith("cuda")
        self.block_types: dict[str, int] = {}
        if self.serves_file_blocks:
            self.block_types = read_artifact_meta(self.artifact).get("block_types", {})
        self.model = None
        if self.runtime == "native":
            self.model, self.tokenizer = self._native_model(options)
        if self.model is None:
            from .loading import model_from_artifact

            if self.serves_file_blocks:
                # A quantized GGUF without `quantize:`: its own block types on the native kernels.
                self.model, self.tokenizer = model_from_artifact(self.artifact, dtype=options.dtype,
                                                                 device=self.device)
            else:
                # A quantized artifact says in which dtype it computes on CPU; `options.dtype` is for
                # float weights, and on CUDA for quantized ones too (they are dequantized to dense there).
                dtype = None if self.accelerators.artifact_transforms and not on_cuda else options.dtype
                self.model, self.tokenizer = model_from_artifact(self.artifact, dtype=dtype, device=self.device,
                                                                 kernel=self._kernel())
        if self.runtime == "native":
            import numpy as np

            if options.kv_cache == "q8_0" and self.model.config.head_dim % 32:
                from outrider.errors import ManifestError

                raise ManifestError(f"{self.manifest.where}: options.kv_cache: q8_0 "
                                    f"needs head_dim a multiple of 32 (blocks of 32), this model's is "
                                    f"{self.model.config.head_dim}: use f16")
            self.model.kv_dtype = {"f16": np.float16, "f32": np.float32, "q8_0": "q8_0"}[options.kv_cache]
        started = self._loading_since
        threads = self.threads
        log.info("model %s: weights ready in %.2fs (%s; %s)", self.manifest.name, time.perf_counter() - started,
                 f"{threads} threads" if threads else f"{self.device}, {self.model.dtype}",
                 "torch-free native runtime" if self.runtime == "native"
                 else f"torch runtime: {self._runtime_reason}")
        strategy = self.accelerators.decode_strategy
        if strategy is not None:
            strategy = strategy.for_instance()  # drafter state is per engine, not per model
        self.engine = GenerationEngine(
            self.model, self.tokenizer, strategy=strategy,
            max_sequences=options.max_sequences, max_length=self._max_length(options.max_length), stats=self.stats,
            prefix_cache_bytes=options.prefix_cache_mb << 20,
        )
        if self.engine.strategy is not None:
            self.engine.strategy.attach(self.model, self.tokenizer)
        if on_cuda and options.cuda_graphs:
            from .cuda_graphs import use_cuda_graphs

            use_cuda_graphs(self.model, self.engine.cache)

    def _native_model(self, options: LlmOptions) -> tuple[Any, Any]:
        """(NativeLlama, tokenizer), or (None, None) where it does not cover the artifact under
        `runtime: auto` (the torch model serves then, and the log says why)."""
        from .artifact import TILES_INDEX
        from .native_model import load_tiles

        try:
            return load_tiles(self.artifact)
        except ValueError as exc:
            if options.runtime == "native" or (Path(self.artifact.path) / TILES_INDEX).is_file():
                from outrider.errors import ManifestError

                raise ManifestError(f"{self.manifest.where}: options.runtime: native "
                                    f"cannot serve this model: {exc}") from None
            self.runtime, self._runtime_reason = "torch", str(exc)
            self.threads = set_torch_threads(self.threads or usable_cpus(), f"model {self.manifest.name!r}")
            return None, None

    def _max_length(self, asked: int) -> int:
        """The context a sequence may use: `max_length`, capped at the model's sliding window (the
        forward attends over the whole context; within the window that is exactly the reference)."""
        window = self.model.config.sliding_window
        if window is None or asked <= window:
            return asked
        log.warning("model %s: max_length %d capped at %d, the model's sliding attention window (%s.attention."
                    "sliding_window): a longer context would attend over tokens the model's own attention drops",
                    self.manifest.name, asked, window, self.model.config.architecture)
        return window

    def _serves_file_blocks(self, options: LlmOptions, on_cuda: bool) -> bool:
        """Whether this load serves the GGUF's own block types: asked for (`weights: file`, the
        default), no `quantize:` section, and on a CPU whose native kernels loaded. (A file without
        quantized matrices gives the float model that way too: its dense tensors load as fp32.)"""
        if options.weights != "file" or self.accelerators.artifact_transforms or on_cuda:
            return False
        from . import native

        loaded, why = native.w4a8_kernel()
        if not loaded:
            log.warning("model %s: a GGUF's own block types need outrider's native kernels (%s): serving it "
                        "dequantized to %s", self.manifest.name, why, options.dtype)
        return loaded

    def _kernel(self) -> str:
        """The quantized matmul kernel the manifest asks for (`quantize.kernel`, default auto)."""
        formats = [t.weight_format for t in self.accelerators.artifact_transforms if t.weight_format is not None]
        return formats[-1].kernel if formats else "auto"

    def warmup(self) -> None:
        """Generate a few tokens through the whole engine (prefill, drafts, verification)."""
        prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
        try:
            tokens = max(1, min(8, self.engine.max_length // 4))
            ids = self.tokenizer.encode(prompt)[: self.engine.max_length - tokens - 1]  # a short context fits too
            for _ in range(max(1, self.manifest.warmup.iterations)):
                self.engine.warm_up(ids, max_tokens=tokens)
            from .heap import release_free_memory

            # Loading and drafter set-up leave freed temporaries in the heap, which tune_malloc
            # keeps: hand them back before the model reports ready (idle RSS on the edge).
            release_free_memory()
        except Exception as exc:
            if self.cuda_health is None:
                raise
            self.cuda_health.record(exc, "warmup")
            if is_out_of_memory(exc):
                from outrider.errors import ExecutionError

                raise ExecutionError(f"model {self.manifest.name!r}: out of GPU memory on {self.device} during "
                                     f"warmup: {str(exc).splitlines()[0]}") from exc
            raise

    def idle(self) -> None:
        """Waiting for work (called every few hundred ms while it lasts): hand this thread's OpenMP
        team back (either runtime's: the native C library and torch share one libgomp), so that a
        busy model beside this one keeps libgomp's fast path (see
        outrider.torch_process); once the spell has lasted RELEASE_MEMORY_AFTER_S, hand the heap the
        last requests freed back to the OS, so that an idle server's RSS is its model's."""
        if not self.device.startswith("cpu"):
            return
        release_cpu_threads()  # the torch model's team, or the native C library's (the same libgomp)
        engine = self.engine
        if engine is None:
            return
        now = time.monotonic()
        if engine.steps != self._idle_steps:  # it worked since: a new idle spell
            self._idle_steps, self._idle_since, self._memory_released = engine.steps, now, False
        elif not self._memory_released and now - self._idle_since >= RELEASE_MEMORY_AFTER_S:
            from .heap import release_free_memory

            release_free_memory()
            self._memory_released = True

    def health(self) -> dict[str, Any]:
        engine, cuda = self.engine, self.cuda_health
        if cuda is not None and cuda.fault is not None:  # whether or not the load finished
            return {"device": self.device, **cuda.report()}
        if engine is None:
            return {"healthy": False, "reason": "not loaded"}
        out = {"healthy": True, "device": self.device, "active_sequences": len(engine.active),
               "waiting": len(engine.waiting), "free_slots": len(engine.free_slots)}
        if self.block_types:
            out["weights"] = {"served_as": "the file's own blocks", "block_types": self.block_types}
        out.setdefault("weights", {})["bytes"] = int(self.model.weight_bytes())  # NativeLlama and LlamaModel
        out["kv_cache"] = {"dtype": engine.cache.kv_kind, "bytes": int(engine.cache.nbytes)}
        out["runtime"] = self.runtime
        if cuda is not None:
            out["dtype"] = str(self.model.dtype).replace("torch.", "")
            runner = self.model.graph_runner  # on CUDA the torch model serves (model.py)
            if runner is not None:
                out["cuda_graphs"] = runner.stats()
            out.update(cuda.report())
        return out

    def metadata(self) -> dict[str, Any]:
        engine = self.engine
        return {"max_sequences": engine.max_sequences, "max_length": engine.max_length} if engine else {}

    def unload(self) -> None:
        self.engine = None
        self.model = None  # graphs, static cache and weights go with it


def _baked(manifest: Manifest) -> bool:
    """Whether the manifest's model is a directory `outrider bake` wrote (not a GGUF file)."""
    from outrider.errors import ManifestError

    try:
        return manifest.model is not None and manifest.model_path().is_dir()
    except ManifestError:  # an unresolvable model path: the load says why
        return False
