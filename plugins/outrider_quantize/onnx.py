"""Int8 quantization of an ONNX embedding model with ONNX Runtime, gated on embedding quality.

    quantize:
      mode: int8
      method: dynamic            # or static (QDQ, calibrated on CALIBRATION_SENTENCES)
      per_channel: true
      keep_sensitive: true       # FFN output projections stay float...
      outlier_channels: 16       # ...or are quantized but for their 16 largest input channels
      smooth_alpha: 0.5          # SmoothQuant before dynamic quantization (calibrated)
      weights: auto              # int8 on VNNI CPUs, uint8 elsewhere (see below)
      by_cpu:                    # what differs on one class of CPU
        avx2: {weights: int7, outlier_channels: 64}
      gate: {min_cosine: 0.99, on_fail: fail}

Only the "linear" MatMuls (those whose B input is a weight initializer) are quantized; the
attention score MatMuls, LayerNorm, GELU, Softmax, the residual Adds and the pooling stay in
float, as optimum leaves them. On top of that the FFN output projections (the MatMul fed by
the GELU) stay in float by default: their input is the GELU output, whose long positive tail
is what per-tensor uint8 activations represent worst (see `sensitive_matmuls`). That tail
sits in a few channels (one channel's calibrated max is 14-25 in MiniLM's first four layers,
the next largest 5-7), so `outlier_channels: N` quantizes those MatMuls after all, except their
N largest input channels, which stay float beside them (`split_outlier_channels`). With
`smooth_alpha`, SmoothQuant first divides the few huge LayerNorm-output channels out of each
quantized MatMul's input (a Mul before its DynamicQuantizeLinear) and multiplies them into its
weight rows, so the per-tensor activation scale no longer wastes its 256 levels on them.

The nodes to quantize are passed to ONNX Runtime as an explicit `nodes_to_quantize` list, and
the written graph is checked afterwards: `quantize_dynamic` renames nodes it rewrites
(onnxruntime#19503, Gemm), which silently defeats `nodes_to_exclude`; a list of what to
quantize plus a check of what came out cannot drift that way.

The same int8 graph does not compute the same thing on every CPU. ONNX Runtime's u8s8 MatMul
(uint8 activations, int8 weights) runs vpdpbusd on VNNI CPUs, with 32-bit sums; on x86 without
VNNI it runs vpmaddubsw, which adds each pair of u8 x s8 products in 16 bits and saturates
(2 x 255 x 127 > 32767): MiniLM's recipe that scores min cosine 0.994 on a VNNI CPU scores 0.963
there. So the recipe is chosen per class of CPU (`cpu_class`: vnni, avx2, arm, other) from
`weights` and `by_cpu` (`recipe_for`), and the class, the recipe and onnxruntime's version are in
the artifact's cache key: a cache copied from another machine never lends its gate figures.

onnxruntime and onnx are imported inside functions: importing this module costs nothing.
"""

from __future__ import annotations

import fnmatch
import logging
import platform
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from outrider.artifacts import Artifact, file_sha256, package_version
from outrider.errors import ArtifactError, ManifestError, QualityGateError
from outrider.hardware import cpu_flags

from .config import CpuClass, QuantizeConfig

if TYPE_CHECKING:
    import onnx

log = logging.getLogger("outrider.quantize")

Feeds = dict[str, np.ndarray]
#: ops whose output feeds an FFN output projection (GELU in its exported or fused forms)
_ACTIVATIONS = ("Erf", "Gelu", "FastGelu", "BiasGelu", "Tanh", "Relu")
#: where the walk back from a MatMul's input stops: nodes that mix values across a row or rows
_BARRIERS = ("MatMul", "Gemm", "LayerNormalization", "SkipLayerNormalization", "Softmax", "ReduceMean")
_ACTIVATION_HOPS = 6
#: bump when the quantization recipe changes in a way the cache options cannot see
RECIPE = 1

# Two disjoint sets: static quantization calibrates on the first, the quality gate measures on the
# second, so the gate never scores sentences the scales were fitted to. Both mix lengths, code,
# other languages, emoji, questions and odd punctuation, because a quantized model fails first on
# inputs unlike the ones it was tuned on.
CALIBRATION_SENTENCES: tuple[str, ...] = (
    "The cat sat on the mat.",
    "How do I reset my password?",
    "Stock markets fell sharply after the central bank raised interest rates by half a point.",
    "def add(a, b):\n    return a + b",
    "Der Zug nach München hat heute zwanzig Minuten Verspätung.",
    "I love this song so much 😍🎶",
    "What is the capital of Australia?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name;",
    "ok",
    "Please find attached the quarterly report for your review before Monday's meeting.",
    "Ich habe keine Ahnung, wovon du sprichst.",
    "Why is the sky blue during the day but red at sunset?",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "The quick brown fox jumps over the lazy dog.",
    "Our new espresso machine makes a surprisingly good flat white. ☕",
    "In 1969, Apollo 11 landed the first humans on the Moon.",
    "Can you recommend a good Italian restaurant near the train station?",
    "The patient presented with acute chest pain radiating to the left arm.",
    "import numpy as np\nx = np.linspace(0, 1, 100)",
    "Wie viel kostet eine Fahrkarte nach Berlin?",
    "Terms and conditions apply. Offer valid while stocks last.",
    "The mitochondria is the powerhouse of the cell.",
    "lol that's hilarious 😂😂😂",
    "Error: connection refused (ECONNREFUSED) at 127.0.0.1:5432",
    "She walked along the beach, collecting shells as the tide went out and the gulls circled overhead.",
    "Is it safe to eat raw cookie dough?",
    "A recursive function calls itself until it reaches a base case.",
    "Le chat dort sur le canapé depuis ce matin.",
    "The committee will vote on the proposal next Thursday.",
    "git rebase -i HEAD~3",
    "Climate change is increasing the frequency of extreme weather events around the world.",
    "Thanks!",
    "How many legs does a spider have?",
    "Das Wetter ist heute schön, aber morgen soll es regnen.",
    "The violinist played the final movement with astonishing precision and warmth.",
    "{\"id\": 42, \"name\": \"widget\", \"tags\": [\"a\", \"b\"]}",
    "My flight got cancelled and the airline won't refund me. 😡",
    "Neural networks learn representations by adjusting weights through gradient descent.",
    "Where can I buy fresh sourdough bread on Sundays?",
    "The museum's new exhibition explores the history of early photography.",
    "x = [i ** 2 for i in range(10) if i % 2 == 0]",
    "Happy birthday!!! 🎉🎂",
    "The contract terminates automatically if either party fails to pay within thirty days.",
    "Kannst du mir bitte das Salz reichen?",
    "Who wrote the novel 'One Hundred Years of Solitude'?",
    "Regular exercise reduces the risk of heart disease and improves mood.",
    "The server returned HTTP 503 Service Unavailable for every request after the deploy.",
    "A single sentence can carry a surprising amount of meaning when every word is chosen with care.",
    "What's the difference between a list and a tuple in Python?",
    "Volcanic eruptions can cool the global climate for several years.",
    "The kids built a snowman in the garden this morning. ⛄",
    "rm -rf node_modules && npm install",
    "Die Konferenz findet im großen Saal im dritten Stock statt.",
    "Please do not reply to this automated message.",
    "The hikers reached the summit just before the storm rolled in from the west.",
    "Which vaccine schedule is recommended for infants?",
    "class Stack:\n    def __init__(self):\n        self.items = []",
    "Honestly the sequel was better than the original.",
    "The company reported record revenue but warned of slower growth next year.",
    "¿Dónde está la biblioteca?",
    "Bees communicate the location of flowers through a waggle dance.",
    "I can't believe it's already December 🎄",
    "Tokenization splits text into subword units before the model sees it.",
    "When the river flooded last spring, the whole village worked through the night to fill sandbags, "
    "move the animals to higher ground and carry the elderly out of their homes, and by morning the "
    "water had reached the church steps but not a single person had been hurt.",
)

HELDOUT_SENTENCES: tuple[str, ...] = (
    "A man is playing the guitar on a street corner.",
    "How long should I boil an egg for a runny yolk?",
    "The government announced a new tax on sugary drinks starting next year.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Ich würde gerne einen Tisch für zwei Personen reservieren.",
    "Best day ever at the beach 🏖️☀️",
    "What is the boiling point of water at high altitude?",
    "Enzymes speed up chemical reactions without being consumed.",
    "UPDATE orders SET status = 'shipped' WHERE id = 1017;",
    "yes",
    "Kindly confirm your attendance at the annual general meeting by Friday.",
    "Warum ist die Banane krumm?",
    "Why do cats purr when they are happy?",
    "while (node != NULL) { node = node->next; count++; }",
    "Five boxing wizards jump quickly.",
    "Just finished a 10k run, legs are jelly 🏃‍♀️💦",
    "The Berlin Wall fell in November 1989.",
    "Could you explain how a mortgage works?",
    "The MRI showed a small tear in the rotator cuff.",
    "import pandas as pd\ndf = pd.read_csv('data.csv')",
    "Wann öffnet das Schwimmbad am Wochenende?",
    "Batteries not included.",
    "DNA carries the genetic instructions for the development of living organisms.",
    "omg no way 😱",
    "Traceback (most recent call last): KeyError: 'user_id'",
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp, "
    "even after the ships had stopped coming.",
    "Is coffee bad for your health?",
    "A hash table maps keys to values using a hash function.",
    "Nous allons au marché tous les samedis matin.",
    "The board approved the merger after a lengthy debate.",
    "docker run -p 8080:80 nginx",
    "Rising sea levels threaten coastal cities across the globe.",
    "Cheers mate",
    "How far is the Moon from the Earth?",
    "Morgen früh fahre ich mit dem Fahrrad zur Arbeit.",
    "The orchestra's performance of the symphony received a standing ovation.",
    "[1, 2, 3].map(x => x * 2).filter(x => x > 2)",
    "Worst customer service I have ever experienced 👎",
    "Transformers use self-attention to weigh the importance of each token.",
    "Where is the nearest pharmacy that is open late?",
    "The gallery is showing a retrospective of the painter's late works.",
    "sorted(items, key=lambda item: item.price, reverse=True)",
    "Congratulations on your graduation! 🎓",
    "The tenant must give two months' notice before vacating the property.",
    "Hast du schon die neuen Nachrichten gelesen?",
    "Who painted the ceiling of the Sistine Chapel?",
    "Drinking enough water helps regulate body temperature.",
    "Latency spiked to 900 ms at p99 after we enabled TLS on the load balancer.",
    "Sometimes the smallest kindness makes the biggest difference in someone's day.",
    "What does the 'yield' keyword do in Python?",
    "Earthquakes occur when tectonic plates suddenly slip past each other.",
    "Our dog learned to open the fridge 🐶",
    "kubectl get pods --all-namespaces",
    "Der Vortrag beginnt um halb neun im Hörsaal B.",
    "This email was sent from an unmonitored address.",
    "The sailors watched the storm clouds gather on the horizon.",
    "What are the symptoms of vitamin D deficiency?",
    "struct Point { double x; double y; };",
    "The food was fine but the music was way too loud.",
    "Inflation slowed for the third consecutive month.",
    "Il pleut depuis trois jours sans arrêt.",
    "Octopuses have three hearts and blue blood.",
    "Can't wait for the weekend 🙌",
    "Quantization maps floating point values to a small set of integers.",
    "After three years of planning, the city finally opened the new library, a bright building of glass "
    "and timber with a children's floor, quiet reading rooms, a makerspace full of 3D printers and a "
    "rooftop garden where volunteers grow vegetables for the food bank down the street.",
)


# -- which kernels will run -----------------------------------------------------------------------

_X86 = ("x86_64", "amd64", "i386", "i486", "i586", "i686", "x86")
_ARM = ("aarch64", "arm64", "armv8l", "armv8b")


def cpu_class(flags: Optional[Iterable[str]] = None, machine: Optional[str] = None) -> CpuClass:
    """The class of ONNX Runtime's int8 MatMul kernels on this CPU (or on the one described).

    vnni: x86 with AVX512-VNNI or AVX-VNNI, where MLAS's u8s8 kernels sum in 32 bits (vpdpbusd;
    AMX CPUs have AVX512-VNNI too); avx2: other x86 with AVX2, AVX-512 without VNNI included,
    whose u8s8 kernels add pairs of products in 16 bits and saturate (vpmaddubsw); arm: aarch64;
    other: x86 without AVX2 (SSE4.1 also uses the saturating pmaddubsw) or any other machine.
    Flags are the kernel's view of CPUID (outrider.hardware.cpu_flags), which also drops what the
    OS does not enable, as MLAS's own XGETBV check does.
    """
    arch = (machine if machine is not None else platform.machine()).lower()
    if arch in _ARM:
        return "arm"
    if arch not in _X86:
        return "other"
    have = frozenset(cpu_flags() if flags is None else flags)
    if "avx512_vnni" in have or "avx_vnni" in have:
        return "vnni"
    return "avx2" if "avx2" in have else "other"


def recipe_for(config: QuantizeConfig, cpu: CpuClass) -> QuantizeConfig:
    """The recipe that runs on `cpu`: the section's fields, then `by_cpu[cpu]`'s, `weights` resolved.

    `weights: auto` is int8 on VNNI CPUs and uint8 on the others: u8u8 sums are exact on every
    ONNX Runtime kernel (x86 widens to 16-bit products and sums in 32 bits, ARM uses udot), so it
    gives there what int8 gives on VNNI, where int8 would saturate (x86 without VNNI) or run a
    kernel this recipe was never measured on (ARM). `int7` keeps the faster u8s8 kernel on x86
    without VNNI at the cost of one bit of weight precision, so a manifest asks for it by name,
    with figures measured on that class.
    """
    data = config.model_dump()
    override = config.by_cpu.get(cpu)
    if override is not None:
        data.update(override.model_dump(exclude_unset=True))
    data["by_cpu"] = {}
    if data["weights"] == "auto":
        data["weights"] = "int8" if cpu == "vnni" else "uint8"
    return QuantizeConfig.model_validate(data)


def _weight_options(weights: str) -> dict[str, Any]:
    """quantize_dynamic / quantize_static arguments for a resolved `weights` encoding."""
    from onnxruntime.quantization import QuantType

    if weights == "uint8":
        return {"weight_type": QuantType.QUInt8}
    if weights in ("int8", "int7"):
        return {"weight_type": QuantType.QInt8, "reduce_range": weights == "int7"}
    raise ManifestError(f"field 'quantize.weights': expected int8, int7 or uint8 once resolved, got {weights!r}")


# -- graph inspection ----------------------------------------------------------------------------


def _linear_nodes(model: "onnx.ModelProto") -> list[tuple[str, Any]]:
    weights = {init.name for init in model.graph.initializer}
    linear = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    if any(not n.name for n in linear):
        raise ManifestError("the ONNX graph has unnamed MatMul nodes; cannot name the ones to quantize")
    return [(n.name, n) for n in linear]


def linear_matmuls(model: "onnx.ModelProto") -> list[str]:
    """Names of MatMul nodes whose B input is a weight initializer (the model's linear layers)."""
    return [name for name, _ in _linear_nodes(model)]


def sensitive_matmuls(model: "onnx.ModelProto") -> list[str]:
    """Linear MatMuls whose input comes from an activation: the FFN output projections.

    Found by structure, not by name, so any exporter's naming works: walk back from the MatMul's
    input through elementwise nodes (GELU is Div, Erf, Add, Mul, Mul when exported from torch)
    and stop at anything that mixes values (MatMul, Gemm, LayerNorm, Softmax). Their input is
    the GELU output, whose long positive tail dynamic per-tensor uint8 covers worst.
    """
    producer = {out: node for node in model.graph.node for out in node.output}
    found = []
    for name, node in _linear_nodes(model):
        frontier, seen = [node.input[0]], set()
        for _ in range(_ACTIVATION_HOPS):
            upstream = [producer[t] for t in frontier if t in producer and t not in seen]
            seen.update(frontier)
            if any(p.op_type in _ACTIVATIONS for p in upstream):
                found.append(name)
                break
            frontier = [t for p in upstream if p.op_type not in _BARRIERS for t in p.input]
    return found


def choose_nodes(model: "onnx.ModelProto", config: QuantizeConfig) -> tuple[list[str], list[str]]:
    """(nodes to quantize, linear nodes kept in float) for this graph and config."""
    linear = linear_matmuls(model)
    keep = set(sensitive_matmuls(model)) if config.keep_sensitive else set()
    unmatched = [p for p in config.exclude if not any(fnmatch.fnmatchcase(n, p) for n in linear)]
    if unmatched:
        # A pattern that matches nothing is a typo or a renamed graph: quantizing more than the
        # manifest meant to is exactly the silent failure this module guards against.
        raise ManifestError(
            f"field 'quantize.exclude': patterns {unmatched} match no quantizable MatMul node; "
            f"the graph's are named like {linear[:3]}"
        )
    keep |= {n for n in linear if _excluded(n, config)}
    return [n for n in linear if n not in keep], [n for n in linear if n in keep]


def _float_linear(model: "onnx.ModelProto") -> set[str]:
    weights = {init.name: init for init in model.graph.initializer}
    return {n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights
            and weights[n.input[1]].data_type in (1, 10, 16)}  # FLOAT, FLOAT16, BFLOAT16


def check_quantized(path: Path, quantized: Sequence[str], kept: Sequence[str]) -> None:
    """Raise unless every `kept` node is still a float MatMul and no `quantized` one is."""
    import onnx

    still_float = _float_linear(onnx.load(str(path), load_external_data=False))
    lost = sorted(set(kept) - still_float)
    leaked = sorted(set(quantized) & still_float)
    if lost or leaked:
        raise QualityGateError(
            f"quantized graph {path} does not match the plan: expected float MatMuls {lost} "
            f"(renamed or quantized), expected quantized {leaked} (still float)"
        )


# -- quantization --------------------------------------------------------------------------------


class _Calibration:
    """A CalibrationDataReader over a list of feeds (built lazily so onnxruntime loads late)."""

    def __new__(cls, feeds: list[Feeds], input_names: Sequence[str]):  # type: ignore[misc]
        from onnxruntime.quantization import CalibrationDataReader

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self._it = iter([{k: v for k, v in f.items() if k in input_names} for f in feeds])

            def get_next(self) -> Optional[Feeds]:
                return next(self._it, None)

        return Reader()


def activation_ranges(src: Union[Path, "onnx.ModelProto"], tensors: Sequence[str],
                      feeds: Iterable[Feeds]) -> dict[str, np.ndarray]:
    """Per-channel max |x| of each named tensor of `src` over the feeds (last axis = channels)."""
    import onnx

    if isinstance(src, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(src)  # the outputs added below stay out of the caller's graph
    else:
        model = onnx.load(str(src))
    have = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                              for t in tensors if t not in have)
    import onnxruntime

    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    amax: dict[str, np.ndarray] = {}
    for batch in feeds:
        outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {n: batch[n] for n in names})))
        for t in tensors:
            # Padded positions included: in a batch, their values enter the dynamic range too.
            value = np.abs(outputs[t].reshape(-1, outputs[t].shape[-1])).max(axis=0)
            amax[t] = np.maximum(amax[t], value) if t in amax else value
    if not amax:
        raise ManifestError("quantize.smooth_alpha needs calibration feeds; none were given")
    return amax


def _smooth_weights(model: "onnx.ModelProto", nodes: Sequence[str], amax: dict[str, np.ndarray],
                    alpha: float) -> dict[str, np.ndarray]:
    """Scale the weights of `nodes` in place by s per input channel; return {input tensor: s}."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list[Any]] = {}
    for node in model.graph.node:
        if node.name in nodes:
            groups.setdefault(node.input[0], []).append(node)
    scales = {}
    for tensor, consumers in groups.items():
        weights = [numpy_helper.to_array(inits[c.input[1]]) for c in consumers]
        if len({id(inits[c.input[1]]) for c in consumers}) != len(consumers):
            raise ManifestError(f"quantize.smooth_alpha: MatMuls reading {tensor} share a weight; cannot smooth")
        # Q, K and V read one LayerNorm output: one s for all three, from their joint weight range.
        wmax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
        s = (np.maximum(amax[tensor], 1e-5) ** alpha / np.maximum(wmax, 1e-5) ** (1 - alpha)).astype(np.float32)
        for c, w in zip(consumers, weights):
            inits[c.input[1]].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(np.float32), c.input[1]))
        scales[tensor] = s
    return scales


def split_outlier_channels(model: "onnx.ModelProto", nodes: Sequence[str], amax: dict[str, np.ndarray],
                           channels: int) -> tuple[list[str], list[str]]:
    """Split each MatMul y = x W in `nodes` in two, in place: the `channels` input channels with
    the largest max |x| (`amax`, calibrated) go through a float MatMul of their own, and the
    rest (x with those channels zeroed) through the original weight, which is then quantized:
    y = (x * mask) W + x[..., idx] W[idx]. This is LLM.int8()'s decomposition: dynamic int8
    activations have one scale per tensor, and a single channel ten times larger than the others
    (BERT's FFN output projections have them) would spend most of the 256 levels on itself.
    Returns (the inlier MatMuls, to quantize; the outlier MatMuls, to keep in float)."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    readers = Counter(name for n in model.graph.node for name in n.input)
    inliers, outliers = [], []
    rewritten = []
    for node in model.graph.node:
        if node.name not in nodes:
            rewritten.append(node)
            continue
        if readers[node.input[1]] != 1:
            raise ManifestError(f"quantize.outlier_channels: the weight of {node.name} is shared; cannot split it")
        x, weight = node.input[0], numpy_helper.to_array(inits[node.input[1]])
        if channels >= weight.shape[0]:
            raise ManifestError(f"field 'quantize.outlier_channels': {channels} is not fewer than the "
                                f"{weight.shape[0]} input channels of {node.name}")
        index = np.sort(np.argsort(amax[x])[::-1][:channels]).astype(np.int64)
        mask = np.ones(weight.shape[0], np.float32)
        mask[index] = 0.0
        p = node.name
        inlier_weight = weight.copy()
        inlier_weight[index] = 0.0  # read only through zeros; left out, they no longer widen a column's scale
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(inlier_weight, node.input[1]))
        model.graph.initializer.extend([
            numpy_helper.from_array(mask, f"{p}_inlier_mask"),
            numpy_helper.from_array(index, f"{p}_outlier_index"),
            numpy_helper.from_array(np.ascontiguousarray(weight[index]), f"{p}_outlier_weight"),
        ])
        rewritten += [
            helper.make_node("Mul", [x, f"{p}_inlier_mask"], [f"{p}_inlier_x"], name=f"{p}_inlier_Mul"),
            helper.make_node("MatMul", [f"{p}_inlier_x", node.input[1]], [f"{p}_inlier_y"], name=f"{p}_inlier"),
            helper.make_node("Gather", [x, f"{p}_outlier_index"], [f"{p}_outlier_x"], name=f"{p}_outlier_Gather",
                             axis=-1),
            helper.make_node("MatMul", [f"{p}_outlier_x", f"{p}_outlier_weight"], [f"{p}_outlier_y"],
                             name=f"{p}_outlier"),
            helper.make_node("Add", [f"{p}_inlier_y", f"{p}_outlier_y"], list(node.output), name=f"{p}_sum"),
        ]
        inliers.append(f"{p}_inlier")
        outliers.append(f"{p}_outlier")
    del model.graph.node[:]
    model.graph.node.extend(rewritten)
    return inliers, outliers


def _insert_smoothing(path: Path, scales: dict[str, np.ndarray]) -> None:
    """Put x * (1/s) in front of each DynamicQuantizeLinear that reads a smoothed tensor."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    # Done after quantize_dynamic, not before: ORT's own topological sort rejects the graph when
    # the Mul is already there, and this way the residual path keeps reading the unscaled x.
    for tensor, s in scales.items():
        quant = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear" and n.input[0] == tensor]
        if len(quant) != 1:
            raise QualityGateError(f"expected one DynamicQuantizeLinear reading {tensor}, found {len(quant)}")
        smoothed = f"{tensor}_smoothed"
        model.graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), f"{smoothed}_inv_scale"))
        index = list(model.graph.node).index(quant[0])
        model.graph.node.insert(index, helper.make_node("Mul", [tensor, f"{smoothed}_inv_scale"], [smoothed],
                                                        name=f"{smoothed}_Mul"))
        quant[0].input[0] = smoothed
    onnx.save(model, str(path))


def quantize_onnx(src: Path, dst: Path, config: QuantizeConfig,
                  calibration_feeds: Optional[Iterable[Feeds]] = None) -> dict[str, Any]:
    """Write `src` quantized to int8 at `dst`; return the method, per_channel and nodes kept in float."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static

    if config.weights == "auto" or config.by_cpu:
        config = recipe_for(config, cpu_class())  # not resolved by the caller: this CPU's recipe
    check_config(config)
    model = onnx.load(str(src))
    quantize, kept = choose_nodes(model, config)
    if not quantize:
        raise ManifestError(f"{src}: no MatMul with a weight initializer to quantize (op types: MatMul)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    feeds = list(calibration_feeds or [])
    split: Optional[dict[str, Any]] = None
    if config.outlier_channels is not None:
        if not feeds:
            raise ManifestError("quantize.outlier_channels needs calibration feeds; none were given")
        # keep_sensitive is on (check_config), so what is kept and not excluded is the sensitive set.
        sensitive = [n for n in kept if not _excluded(n, config)]
        inputs = sorted({n.input[0] for n in model.graph.node if n.name in sensitive})
        amax = activation_ranges(model, inputs, feeds)
        inliers, outliers = split_outlier_channels(model, sensitive, amax, config.outlier_channels)
        quantize = quantize + inliers
        kept = [n for n in kept if n not in sensitive] + outliers
        split = {"split_nodes": len(inliers), "outlier_channels": config.outlier_channels}
    weights = config.weights
    common = dict(op_types_to_quantize=["MatMul"], per_channel=config.per_channel, nodes_to_quantize=quantize,
                  **_weight_options(weights))
    quiet = logging.getLogger()
    level = quiet.level
    quiet.setLevel(max(level, logging.ERROR))  # ORT's "consider pre-processing" warning, once per build
    scales: dict[str, np.ndarray] = {}
    try:
        if config.method == "dynamic":
            source: Union[Path, "onnx.ModelProto"] = src if split is None else model
            if config.smooth_alpha is not None:
                inputs = sorted({n.input[0] for n in model.graph.node if n.name in quantize})
                scales = _smooth_weights(model, quantize, activation_ranges(model, inputs, feeds), config.smooth_alpha)
                source = model
            quantize_dynamic(source, dst, **common, extra_options={"MatMulConstBOnly": True})
            if scales:
                _insert_smoothing(dst, scales)
        else:
            if not feeds:
                raise ManifestError("quantize.method 'static' needs calibration feeds; none were given")
            names = [i.name for i in model.graph.input]
            quantize_static(src, dst, _Calibration(feeds, names), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QUInt8, calibrate_method=CalibrationMethod.MinMax,
                            extra_options={"MatMulConstBOnly": True, "WeightSymmetric": True}, **common)
    finally:
        quiet.setLevel(level)
    check_quantized(dst, quantize, kept)
    return {"method": config.method, "per_channel": config.per_channel, "op_types": ["MatMul"], "weights": weights,
            "smooth_alpha": config.smooth_alpha, "quantized_nodes": len(quantize), "float_nodes": kept,
            **(split or {})}


def _excluded(node: str, config: QuantizeConfig) -> bool:
    return any(fnmatch.fnmatchcase(node, p) for p in config.exclude)


def check_config(config: QuantizeConfig) -> None:
    """ManifestError for ONNX quantize options that cannot go together."""
    check_mode(config)
    if config.smooth_alpha is not None and config.method != "dynamic":
        raise ManifestError(f"field 'quantize.smooth_alpha': applies to method 'dynamic' only, got method "
                            f"{config.method!r}; remove it or use method: dynamic")
    if config.outlier_channels is not None:
        if config.method != "dynamic":
            raise ManifestError(f"field 'quantize.outlier_channels': applies to method 'dynamic' only, got "
                                f"method {config.method!r}; remove it or use method: dynamic")
        if not config.keep_sensitive:
            raise ManifestError("field 'quantize.outlier_channels': splits the sensitive MatMuls that "
                                "keep_sensitive holds back; it needs keep_sensitive: true")


def calibration_feeds(feeds: Callable[[list[str]], Feeds], count: int = len(CALIBRATION_SENTENCES)) -> list[Feeds]:
    """The first `count` calibration sentences (cycled), alone and in padded batches of 16."""
    sentences = [CALIBRATION_SENTENCES[i % len(CALIBRATION_SENTENCES)] for i in range(count)]
    return batches(sentences, feeds, 1) + batches(sentences, feeds, 16)


def needs_calibration(config: QuantizeConfig) -> bool:
    """Whether the recipe reads calibration sentences (their number is then part of the cache key)."""
    return config.method == "static" or config.smooth_alpha is not None or config.outlier_channels is not None


def check_mode(config: QuantizeConfig) -> str:
    """The effective mode for ONNX ('auto' -> 'int8'); ManifestError for any other."""
    mode = "int8" if config.mode == "auto" else config.mode
    if mode != "int8":
        raise ManifestError(
            f"field 'quantize.mode': ONNX Runtime quantization supports int8 (or auto -> int8), got {config.mode!r}"
        )
    return mode


# -- quality -------------------------------------------------------------------------------------


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


def batches(sentences: Sequence[str], feeds: Callable[[list[str]], Feeds], batch_size: int) -> list[Feeds]:
    """The sentences as ONNX feeds, `batch_size` at a time."""
    return [feeds(list(sentences[i:i + batch_size])) for i in range(0, len(sentences), batch_size)]


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


# -- the accelerator -----------------------------------------------------------------------------


class OnnxQuantizer:
    """Artifact transform: an fp32 ONNX file -> its int8 version, cached and quality-gated."""

    kind = "onnx-int8"
    #: the quantized graph carries its own quantize/dequantize nodes: nothing for a backend to choose
    weight_format = None

    def __init__(self, manifest: Any, config: QuantizeConfig, cpu: Optional[CpuClass] = None) -> None:
        self.manifest = manifest
        self.config = config
        #: the class of CPU whose kernels this artifact is built and gated for (detected by default)
        self.cpu: CpuClass = cpu or cpu_class()
        where = getattr(manifest, "source_file", None) or getattr(manifest, "name", "<manifest>")
        try:
            # Every class's recipe is checked at start, not only this CPU's: a manifest that is
            # wrong for an ARM box should not wait for one to say so.
            for cls in ("vnni", "avx2", "arm", "other"):
                check_config(recipe_for(config, cls))  # type: ignore[arg-type]
            #: the recipe that runs here: the section with by_cpu[this class] applied, weights resolved
            self.recipe = recipe_for(config, self.cpu)
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc.message}") from None

    def options(self) -> dict[str, Any]:
        """What shapes the built model and its figures (part of the cache key): the recipe that
        runs here, and the class of CPU it runs on. onnxruntime's version is keyed by `apply`."""
        c = self.recipe
        return {"mode": check_mode(c), "method": c.method, "per_channel": c.per_channel, "exclude": sorted(c.exclude),
                "keep_sensitive": c.keep_sensitive, "smooth_alpha": c.smooth_alpha,
                "outlier_channels": c.outlier_channels, "weights": c.weights, "cpu_class": self.cpu,
                "recipe": RECIPE, "calibration_sentences": c.calibration_sentences if needs_calibration(c) else None}

    def apply(self, artifact: Artifact, context: Any) -> Artifact:
        """Quantize `artifact` (kind 'onnx', a .onnx file) through the cache; check the gate."""
        if artifact.kind != "onnx" or not Path(artifact.path).is_file():
            raise ManifestError(f"quantize: expected an 'onnx' artifact that is a .onnx file, got "
                                f"{artifact.kind!r} at {artifact.path}")
        for name in ("feeds", "postprocess"):
            if not callable(context.helpers.get(name)):
                raise ManifestError(f"quantize: backend {context.backend!r} gives no '{name}' helper, "
                                    "which the quality gate needs")
        src = Path(artifact.path)
        feeds, postprocess = context.helpers["feeds"], context.helpers["postprocess"]

        recipe = self.recipe

        def build(directory: Path, progress: Any) -> dict[str, Any]:
            progress.set_total(2)
            calibration = None
            if needs_calibration(recipe):
                calibration = calibration_feeds(feeds, recipe.calibration_sentences)
            done = quantize_onnx(src, directory / "model.onnx", recipe, calibration)
            progress.update(1, "quantized")
            quality = embedding_quality(src, directory / "model.onnx", HELDOUT_SENTENCES, feeds=feeds,
                                        postprocess=postprocess)
            progress.update(1, "measured")
            return {**done, **quality, "heldout_sentences": len(HELDOUT_SENTENCES), "cpu_class": self.cpu,
                    "onnxruntime": package_version("onnxruntime"),
                    "model_sha256": file_sha256(directory / "model.onnx", context.cache.root)}

        built = context.cache.get_or_build(
            self.kind, build, label=f"{self.manifest.name} int8", sources=[src],
            versions=["onnxruntime", "onnx"], device=context.device, options=self.options(),
        )
        self._check_entry(built, context.cache.root)
        figures = {k: built.provenance[k] for k in ("min_cosine", "mean_cosine") if k in built.provenance}
        failures = recipe.gate.failures(figures)
        verdict = "passed" if not failures else "failed: " + "; ".join(failures)
        context.reports.append({"transform": "quantize", "mode": "int8", **figures, "gate": verdict,
                                "cpu_class": self.cpu, "weights": recipe.weights})
        if failures:
            message = (f"model {self.manifest.name!r}: int8 ({recipe.method}, {recipe.weights} weights, for "
                       f"{self.cpu} CPUs) missed its quality gate on {len(HELDOUT_SENTENCES)} held-out sentences: "
                       f"{'; '.join(failures)} (measured {figures}; artifact {built.path})")
            if recipe.gate.on_fail == "fail":
                raise QualityGateError(message)
            log.warning("%s; serving it anyway (quantize.gate.on_fail: warn)", message)
        return Artifact(built.path / "model.onnx", "onnx", built.provenance)

    def _check_entry(self, built: Artifact, root: Path) -> None:
        """ArtifactError unless the cache entry holds the model its provenance describes, with the
        figures the gate reads: an entry damaged on disk, or copied half, must not be served, and a
        gate that finds no figure to check would pass it."""
        where = f"model {self.manifest.name!r}: cached int8 artifact {built.path}"
        fix = f"remove that directory (or run `outrider cache clear --kind {self.kind}`) and restart to rebuild it"
        model = built.path / "model.onnx"
        if not model.is_file():
            raise ArtifactError(f"{where} has no model.onnx; {fix}")
        missing = [k for k in ("min_cosine", "mean_cosine", "model_sha256") if k not in built.provenance]
        if missing:
            raise ArtifactError(f"{where}: its provenance.json lacks {missing}; {fix}")
        found = file_sha256(model, root)
        if found != built.provenance["model_sha256"]:
            raise ArtifactError(f"{where}: model.onnx has sha256 {found[:12]}..., its provenance says "
                                f"{str(built.provenance['model_sha256'])[:12]}... (changed or truncated); {fix}")
