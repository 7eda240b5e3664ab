"""The torch-free model's packed form on disk ("llama-native-tiles"): every array it computes with,
in the kernels' layouts, in one file (TILES_FILE, each array aligned and raw) and how to put them
together (TILES_INDEX). `save_tiles` writes it on a first start; `read_tiles` maps it read-only on
every later one (native_model.load_tiles), so a warm start packs nothing and copies nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .artifact import TILES_FILE, TILES_INDEX
from .config import LlamaConfig
from .native_c_layers import Layer, LayerStack
from .native_c_weights import Part
from .native_model_weights import DenseRows, PackedWeights, PartRows, parts_of

# The packed model, mapped at start: its kernels' tiles as one file (see `native_model.load_tiles`).
TILES_KIND = "llama-native-tiles"
TILES_FORMAT = 2  # part of that artifact's key: bumped when what `save_tiles` writes changes (2: the torch model's fingerprint)
ALIGN = 64  # bytes: every array in the tiles file starts on a cache line


def save_tiles(model: Any, directory: Path) -> None:
    """Every array of `model` (a `NativeLlama`) into TILES_FILE (aligned, raw) and how to put it together
    into TILES_INDEX."""
    offset = 0
    arrays: list[tuple[int, np.ndarray]] = []

    def ref(a: Optional[np.ndarray]) -> Optional[list]:
        nonlocal offset
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        offset = -(-offset // ALIGN) * ALIGN
        arrays.append((offset, a))
        out = [offset, a.dtype.str, list(a.shape)]
        offset += a.nbytes
        return out

    def part(p: Part) -> dict:
        return {"w": ref(p.w), "d": ref(p.d), "m": ref(p.m), "bits": int(p.bits), "group": int(p.group)}

    layers = []
    for layer in model.layers.layers:
        entry = {name: ref(getattr(layer, name)) for name in ("attn_norm", "mlp_norm", "qkv_bias", "q_norm", "k_norm",
                                                              "attn_post_norm", "mlp_post_norm")}
        entry.update(q_scale=float(layer.q_scale), activation=layer.activation, rope_table=int(layer.rope_table),
                     window=int(layer.window), attn_softcap=float(layer.attn_softcap))
        for name in ("qkv", "o", "gate_up", "down"):
            entry[name] = [part(p) for p in parts_of(getattr(layer, name))]
        layers.append(entry)
    head = part(model.head)
    rows = model.embed_rows
    embed = "head" if rows.part is model.head else {"table": ref(rows.table)} if rows.part is None else part(rows.part)
    index = {"config": model.config.to_dict(), "fingerprint": model.fingerprint(), "weight_bytes": model.weight_bytes(),
             "layers": layers, "final_norm": ref(model.final_norm), "head": head, "embed": embed,
             "embed_shape": [model.embed_rows.rows, model.embed_rows.columns]}
    with open(directory / TILES_FILE, "wb") as f:
        for at, a in arrays:
            f.seek(at)
            f.write(memoryview(a).cast("B"))
    (directory / TILES_INDEX).write_text(json.dumps(index))



def read_tiles(directory: Path) -> tuple[LlamaConfig, PackedWeights]:
    """The config and weights of a tiles artifact (`NativeLlama.from_tiles`), its arrays read-only
    views of the mapped file."""
    index = json.loads((directory / TILES_INDEX).read_text())
    mapped = np.memmap(directory / TILES_FILE, dtype=np.uint8, mode="r")

    def get(r: Optional[list]) -> Optional[np.ndarray]:
        if r is None:
            return None
        at, dtype, shape = r
        return np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=mapped, offset=at)

    def part(p: dict) -> Part:
        return Part(get(p["w"]), get(p["d"]), get(p["m"]), p["bits"], p["group"])

    def matrix(parts: list) -> Any:
        return part(parts[0]) if len(parts) == 1 else [part(p) for p in parts]

    cfg = LlamaConfig.from_dict(index["config"])
    layers = [Layer(attn_norm=get(e["attn_norm"]), mlp_norm=get(e["mlp_norm"]), qkv=matrix(e["qkv"]),
                    o=matrix(e["o"]), gate_up=matrix(e["gate_up"]), down=matrix(e["down"]),
                    qkv_bias=get(e["qkv_bias"]), q_norm=get(e["q_norm"]), k_norm=get(e["k_norm"]),
                    q_scale=float(e.get("q_scale", 0.0)), attn_post_norm=get(e.get("attn_post_norm")),
                    mlp_post_norm=get(e.get("mlp_post_norm")), activation=e.get("activation", "silu"),
                    rope_table=int(e.get("rope_table", 0)), window=int(e.get("window", 0)),
                    attn_softcap=float(e.get("attn_softcap", 0.0)))
              for e in index["layers"]]
    stack = LayerStack(layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       eps=cfg.rms_norm_eps)
    head = part(index["head"])
    if index["embed"] == "head":
        embed: Any = PartRows(head, *index["embed_shape"])
    elif "table" in index["embed"]:
        embed = DenseRows(get(index["embed"]["table"]))
    else:
        embed = PartRows(part(index["embed"]), *index["embed_shape"])
    return cfg, PackedWeights(stack, get(index["final_norm"]), head, embed, index["fingerprint"], index["weight_bytes"])

