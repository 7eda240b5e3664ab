"""TensorRT optimization profiles from a manifest, shared by the TensorRT provider of ONNX Runtime
and the native `tensorrt` backend (pure functions: no onnxruntime, no tensorrt).

In the core (it was `outrider_onnxruntime.profiles`) because both backends bound their engines
with it, and a plugin may not import another. How the ORT provider spells a profile in its
options stays in `outrider_onnxruntime.profiles`: only that backend reads it.

A TensorRT engine serves only the input shapes its profile bounds. The bounds come from the
manifest: the batch from `options.max_batch`, else the batch policy's `max_batch_size`, else 32; the
sequence length from `options.max_seq_length`, else the task's (the text task truncates there),
else 512. A call with more rows than the profile allows is run in pieces (`row_chunks`), as
text-embeddings-inference splits a large batch, rather than refused or rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np

from ..errors import ManifestError
from ..manifest import Manifest
from ..serving.scheduler import Scheduler

DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_SEQ = 512
#: the sequence length TensorRT tunes kernels for, at most (sentences are mostly shorter)
OPT_SEQ_CAP = 128

Dim = Union[int, str, None]


@dataclass(frozen=True)
class ProfileBounds:
    """The largest and the typical batch and sequence length an engine must serve."""

    max_batch: int
    opt_batch: int
    max_seq: int
    opt_seq: int


def profile_bounds(manifest: Manifest, task_max_length: Optional[int] = None,
                   batch_policy: Optional[Scheduler] = None) -> ProfileBounds:
    """Bounds from the manifest's options and the model's batch policy (its `max_batch_size` and
    `preferred_batch_sizes`; see the module docstring)."""
    options = manifest.options
    batching = batch_policy if batch_policy is not None and batch_policy.max_batch_size else None
    max_batch = int(options.get("max_batch") or (batching.max_batch_size if batching else DEFAULT_MAX_BATCH))
    max_seq = int(options.get("max_seq_length") or task_max_length or DEFAULT_MAX_SEQ)
    if task_max_length and max_seq < task_max_length:
        raise ManifestError(
            f"{manifest.where}: field 'options.max_seq_length': {max_seq} is shorter than "
            f"the {task_max_length} tokens the task feeds; the engine could not take its longest input"
        )
    if batching is None:
        opt_batch = 1  # without a batcher most calls carry one request
    elif batching.preferred_batch_sizes:
        opt_batch = min(max(batching.preferred_batch_sizes), max_batch)
    else:
        opt_batch = max_batch  # under load the batcher fills batches
    return ProfileBounds(max_batch, opt_batch, max_seq, min(max_seq, OPT_SEQ_CAP))


def profile_shapes(inputs: dict[str, Sequence[Dim]], bounds: ProfileBounds,
                   where: str = "the ONNX graph") -> dict[str, tuple[list[int], list[int], list[int]]]:
    """(min, opt, max) shape per input: a dynamic dim 0 is the batch, a dynamic dim 1 the sequence,
    fixed dims keep their size; any other dynamic dim cannot be bounded (ManifestError)."""
    shapes = {}
    for name, dims in inputs.items():
        low, opt, high = [], [], []
        for axis, dim in enumerate(dims):
            if isinstance(dim, int) and dim > 0:
                low.append(dim), opt.append(dim), high.append(dim)
            elif axis == 0:
                low.append(1), opt.append(bounds.opt_batch), high.append(bounds.max_batch)
            elif axis == 1:
                low.append(1), opt.append(bounds.opt_seq), high.append(bounds.max_seq)
            else:
                raise ManifestError(
                    f"field 'options.onnx': input {name!r} of {where} has a dynamic dimension {axis} ({dim!r}); "
                    "TensorRT profiles bound only the batch (0) and sequence (1) dimensions: export the graph "
                    "with that dimension fixed"
                )
        shapes[name] = (low, opt, high)
    return shapes


def row_chunks(feeds: dict[str, np.ndarray], max_rows: int) -> Iterator[dict[str, np.ndarray]]:
    """`feeds` cut along the batch axis into pieces of at most `max_rows` rows (one piece if it fits)."""
    rows = {a.shape[0] for a in feeds.values() if a.ndim}
    if len(rows) != 1 or next(iter(rows)) <= max_rows:
        yield feeds
        return
    total = rows.pop()
    for start in range(0, total, max_rows):
        yield {name: a[start:start + max_rows] for name, a in feeds.items()}


def concat_rows(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """Outputs of `row_chunks` pieces joined back along the batch axis."""
    if len(pieces) == 1:
        return pieces[0]
    return {name: np.concatenate([p[name] for p in pieces], axis=0) for name in pieces[0]}
