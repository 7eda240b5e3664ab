"""What the quality gate reads: the cosine between two ONNX models' embeddings of the same inputs,
through sessions opened as the ORT backend opens them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .onnx_sentences import Feeds, batches


def session(path: Union[str, Path], threads: Optional[int] = None) -> Any:
    """A CPU InferenceSession with all graph optimizations, as the ORT backend opens one."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _embed(sess: Any, batch: Feeds, postprocess: Optional[Callable[..., Any]]) -> np.ndarray:
    names = [i.name for i in sess.get_inputs()]
    outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {n: batch[n] for n in names})))
    result = postprocess(outputs, batch) if postprocess else outputs
    if isinstance(result, dict):  # a Task's postprocess returns the manifest's outputs
        result = result.get("embedding", next(iter(result.values())))
    return np.asarray(result, dtype=np.float64)


def embedding_quality(reference_path: Union[str, Path], candidate_path: Union[str, Path],
                      feeds_or_sentences: Union[Sequence[Feeds], Sequence[str]], *,
                      feeds: Optional[Callable[[list[str]], Feeds]] = None,
                      postprocess: Optional[Callable[..., Any]] = None,
                      batch_sizes: Sequence[int] = (1, 32), threads: Optional[int] = None) -> dict[str, float]:
    """Min and mean cosine between two ONNX models' embeddings of the same inputs.

    Given sentences (and `feeds` to tokenize them), each is measured alone and in batches of
    `batch_sizes`: dynamic quantization picks activation scales per batch, padding included,
    so a row's result depends on its neighbours and the worst case must cover both.
    """
    if feeds_or_sentences and isinstance(feeds_or_sentences[0], str):
        if feeds is None:
            raise TypeError("embedding_quality: sentences need feeds=callable(list[str]) -> ONNX feeds")
        groups = [b for size in batch_sizes for b in batches(feeds_or_sentences, feeds, size)]  # type: ignore[arg-type]
    else:
        groups = list(feeds_or_sentences)  # type: ignore[arg-type]
    if not groups:
        raise ValueError("embedding_quality: no inputs to compare on")
    ref, cand = session(reference_path, threads), session(candidate_path, threads)
    cosines = []
    for batch in groups:
        a, b = _embed(ref, batch, postprocess), _embed(cand, batch, postprocess)
        a /= np.linalg.norm(a, axis=1, keepdims=True)
        b /= np.linalg.norm(b, axis=1, keepdims=True)
        cosines.append((a * b).sum(axis=1))
    values = np.concatenate(cosines)
    return {"min_cosine": round(float(values.min()), 5), "mean_cosine": round(float(values.mean()), 5),
            "compared": int(values.size)}
