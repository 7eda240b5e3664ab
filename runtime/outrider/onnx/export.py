"""Export a task's torch module to ONNX with dynamic batch and sequence axes.

    python -m outrider.onnx.export --model-dir DIR --task sentence-embedding --out FILE

In the core (it was `outrider_torch.onnx_export`) because the ONNX Runtime and TensorRT backends
both serve its output (through `outrider.onnx.artifact`), and a plugin may not import another.
`outrider.onnx.artifact` runs it in a subprocess so that torch is never imported into the server;
torch and onnx are imported inside `export` only, so importing this module for its constants
costs nothing. The result is written to a temporary file and renamed, so a reader never sees half
a model, and checked with `onnx.checker` before the rename.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

DEFAULT_OPSET = 17
#: bump when the export changes in a way the cache key cannot see (shapes, names, options, the
#: module's graph). 2: the sentence embedder pools with a running sum (batch-invariant bits).
EXPORT_FORMAT = 2


def export(model_dir: Path, task: str, out: Path, opset: int = DEFAULT_OPSET) -> float:
    """Write the ONNX graph for `task` to `out` (atomically); return the seconds it took."""
    import onnx
    import torch

    from outrider.torch_modules import build_model

    start = time.perf_counter()
    model = build_model(task, model_dir)
    names = list(model.input_names)
    # Two rows of different lengths, so the trace cannot specialize on batch 1 or on no padding.
    input_ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102], [101, 7592, 102, 0, 0, 0, 0]])
    attention_mask = (input_ids != 0).to(torch.int64)
    token_type_ids = torch.zeros_like(input_ids)
    dynamic = {name: {0: "batch", 1: "sequence"} for name in names}
    dynamic[model.output_name] = {0: "batch"}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # same directory, so the rename is atomic
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            # The TorchScript exporter needs no onnxscript; torch 2.9+ calls it legacy.
            warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
            # transformers' mask code branches on `mask length > sequence length`; our mask always
            # spans the sequence, so the constant the tracer records is right for every shape.
            warnings.filterwarnings("ignore", message="Converting a tensor to a Python boolean")
            # The mask's advanced indexing uses arange indices, never negative ones.
            warnings.filterwarnings("ignore", message="Exporting aten::index operator of advanced indexing")
            torch.onnx.export(
                model,
                (input_ids, attention_mask, token_type_ids),
                str(tmp),
                dynamo=False,
                input_names=names,
                output_names=[model.output_name],
                dynamic_axes=dynamic,
                opset_version=opset,
                do_constant_folding=True,
            )
        onnx.checker.check_model(str(tmp))  # by path: also works for graphs with external data
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: export, print where and how long, exit 0 on success."""
    parser = argparse.ArgumentParser(prog="python -m outrider.onnx.export", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True, type=Path, help="directory with config.json and weights")
    parser.add_argument("--task", required=True, help="e.g. sentence-embedding")
    parser.add_argument("--out", required=True, type=Path, help="the .onnx file to write")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    args = parser.parse_args(argv)
    seconds = export(args.model_dir, args.task, args.out, args.opset)
    print(f"exported {args.task} from {args.model_dir} to {args.out} in {seconds:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
