"""The graph saved in the forms ORT opens fastest, built once into the artifact cache: the CPU
session form (`session_form`) and the portable mapped form `outrider bake` ships (`mapped_form`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from outrider.artifacts import ArtifactCache
from outrider.hardware import cpu_fingerprint

from .providers import CPU

#: part of the saved forms' keys ("onnx-session", "onnx-mapped"): bumped when what `_saved_form` writes changes
SESSION_FORM = 2
SESSION_DATA = "model.data"
#: a graph file smaller than this opens fast as it is: its initializers are in a side file already
#: (a baked or saved form), or there is little to copy
SESSION_FORM_MIN_BYTES = 1 << 20


def session_form(onnx_path: Path, cache: Optional[ArtifactCache] = None) -> Path:
    """The graph as a CPU session opens it fastest, built once into the artifact cache ("onnx-session"):
    optimized at ORT's EXTENDED level (the CPU provider's fusions; the layout passes of ENABLE_ALL
    still run at each start) and saved with its initializers in a side file, which ORT maps instead
    of copying out of the protobuf, and with the MatMul weights already packed for this CPU's
    kernels (`session.save_external_prepacked_constant_initializers`), mapped too, so no start packs
    them again. Packed layouts differ between CPU classes, so the entry is keyed by this CPU's
    features (outrider.hardware.cpu_fingerprint). MiniLM's session start: 0.13 -> 0.045 s here
    with mapped initializers, 0.052 -> 0.034 s (another machine) with packed ones; the packed
    weights are shared page cache rather than each process's heap. The same graph, the same
    fusions, the same packing: the outputs are the original file's, bit for bit."""
    return _saved_form(onnx_path, "onnx-session", "extended", cache)


def mapped_form(onnx_path: Path, cache: Optional[ArtifactCache] = None) -> Path:
    """The graph unoptimized (any provider may open it), its initializers in a side file that ORT maps:
    what `outrider bake` writes, so a baked model opens fast with nothing built at start."""
    return _saved_form(onnx_path, "onnx-mapped", "none", cache)


def _saved_form(onnx_path: Path, kind: str, level: str, cache: Optional[ArtifactCache]) -> Path:
    import onnxruntime

    levels = {"extended": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "none": onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL}
    # The CPU form carries this CPU's packed weights; the unoptimized one stays portable (any
    # provider, any machine: what `outrider bake` ships).
    prepacked = level != "none"
    keyed = {"format": SESSION_FORM, "level": level, **({"cpu": cpu_fingerprint()} if prepacked else {})}

    def build(directory: Path, progress: Any) -> dict:
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = levels[level]
        options.optimized_model_filepath = str(directory / "model.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", SESSION_DATA)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        if prepacked:
            options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        options.intra_op_num_threads = 1
        onnxruntime.InferenceSession(str(onnx_path), options, providers=[CPU])
        data = directory / SESSION_DATA
        if not data.exists():  # nothing was large enough to move: an empty side file keeps the layout whole
            data.touch()
        return {"graph_bytes": (directory / "model.onnx").stat().st_size, "initializer_bytes": data.stat().st_size}

    artifact = (cache or ArtifactCache()).get_or_build(
        kind, build, label=f"{onnx_path.name} -> {kind}", sources=[onnx_path], versions=["onnxruntime"],
        device="cpu" if prepacked else "any", options=keyed)
    return artifact.file("model.onnx")
