"""The files of a published EAGLE-3 head (eagle3.py describes them): its folder (config.json beside
.safetensors), the safetensors read on numpy without torch, and the tensor names of each published
layout mapped to SafeAILab's."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAX_HEADER_BYTES = 64 << 20  # a safetensors header larger than this is not a draft head's
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bf16", "I64": np.int64, "I32": np.int32, "BOOL": np.bool_}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, as numpy (BF16 widened to fp32); ValueError naming what is
    wrong with the file. Its header is checked against the file's size before anything is read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header of {length} bytes in a file of {size}")
        header = json.loads(f.read(length))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        kind = _DTYPES.get(info.get("dtype"))
        if kind is None:
            raise ValueError(f"tensor {name!r}: dtype {info.get('dtype')!r} (expected one of {sorted(_DTYPES)})")
        begin, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(x) for x in info["shape"])
        width = 2 if kind == "bf16" else np.dtype(kind).itemsize
        if not 0 <= begin <= end <= data.size or end - begin != width * math.prod(shape):
            raise ValueError(f"tensor {name!r}: bytes {begin}..{end} do not hold {shape} of {info['dtype']}")
        raw = data[begin:end]
        if kind == "bf16":  # the high half of an fp32
            array = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = raw.view(kind)
        out[name] = np.array(array.reshape(shape))
    return out


def _files(path: Path) -> tuple[dict, list[Path]]:
    """(config, safetensors files) of a head given as its folder or one of its .safetensors files."""
    folder = path if path.is_dir() else path.parent
    if path.is_file() and path.suffix != ".safetensors":
        raise ValueError(f"{str(path)!r} is not a .safetensors file: pickle checkpoints (.bin, .pt) are not loaded; "
                         f"convert it (safetensors.torch.save_file(torch.load(...), 'model.safetensors'))")
    weights = [path] if path.is_file() else sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (it has {', '.join(pickled)}: pickle checkpoints are not loaded; convert them to safetensors)" \
            if pickled else ""
        raise ValueError(f"no .safetensors file in {str(folder)!r}{hint}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json beside the weights in {str(folder)!r}")
    return json.loads(config_file.read_text()), weights


def _layer_name(name: str) -> str:
    """The tensor's name in SafeAILab's layout (`midlayer.`), whichever of the published ones it uses."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def read_head(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config, every tensor under SafeAILab's names) of a head given as its folder or one of its
    .safetensors files; ValueError (or OSError, KeyError) naming what is wrong."""
    config, files = _files(path)
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update({_layer_name(k): v for k, v in read_safetensors(file).items()})
    return config, tensors
