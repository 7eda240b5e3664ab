#!/usr/bin/env python3
"""SmolLM2 w4a8 forward on every native kernel set this CPU runs, beside llama.cpp, in one run.

  python tools/bench_native.py                                   outrider's kernel sets only
  python tools/bench_native.py --llama-cpp /work/lcp/avx2,/work/lcp/native   + two llama.cpp builds
  python tools/bench_native.py --repeat 30 --context 512 --threads 2

Outrider columns: `smollm2-int8`'s model as the server builds it (`quantize.kernel: w4a8`, the
shipped Q4_1 blocks as int4 weights, int8 activations; tools/bench_llm_forward.py's
`quantized_models`), once, with each kernel set of `native.kernel_sets()` forced in turn by
`native.select` right before each of its calls (the sets are bit-identical and share the packed
weights, so one model serves every column). "scalar" (the reference, no SIMD) comes last and runs
only `--scalar-repeat` times: it is slow.

llama.cpp columns (with --llama-cpp DIR[,DIR...]: llama-cpp-python target dirs, e.g. one built
for AVX2 only and one with AVX-512): each build runs in its own worker subprocess with DIR first on
sys.path (so two builds compare in one run, and a build the CPU cannot run costs its columns, not
the table), on the same GGUF (the shipped Q4_1, `smollm2_gguf_path()`) and on a Q4_0 of the same
model made here by llama.cpp's own quantizer (`llama_model_quantize`, allow_requantize: the Q4_1
blocks requantized, into a temp dir deleted at exit; llama.cpp repacks Q4_0 for AVX2 at load, its
best path on x86). Its context: n_ctx = context + 256, n_batch = n_ubatch = 512, the given thread
count for one token and for batches, flash attention off (llama-cpp-python's default); the
system-info line says which instruction sets the build uses.

Cases, all after `--context` committed tokens (the same token ids on both sides):
  decode 1     one token, logits for it (a plain decode step);
  verify 8     8 rows with logits for all 8 (what checking a draft takes): outrider a draft tree
               (the pending token + a 7-node tree, DraftTree mask), llama.cpp a chain of 8 tokens;
  prefill 128  128 new tokens, logits for the last one only (a prompt chunk).
How each call is undone: outrider feeds slot 0 at the committed length and never commits, so the
next call overwrites the tentative K/V. llama.cpp feeds one llama_batch (low-level API, sequence 0,
positions from the committed length) through llama_decode; before every call the worker removes
whatever the previous call appended (llama_memory_seq_rm(mem, 0, committed, -1), untimed), so each
call again sees exactly the committed context. The worker times llama_decode + llama_synchronize
itself (no pipe in the figure); outrider's figure is the forward call from Python.

Times are medians of calls taken round-robin over all columns (as `interleaved_ms` in
bench_llm_forward.py, so load from elsewhere hits every column alike), with `--gap-ms` of sleep
before each call: OpenMP threads of the process that ran last spin for a few ms after their
parallel region, and without the gap they would steal a core from the next column's call (2 cores
here). Ratio columns: llama.cpp time / outrider time (above 1: outrider faster), against the best
kernel set and against avx2. Absolute numbers differ between machines; read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

CASES = [("decode 1", "decode"), ("verify 8", "verify"), ("prefill 128", "prefill")]
VERIFY_ROWS = 8
PREFILL_TOKENS = 128


def context_tokens(n: int) -> list[int]:
    return [(11 * i) % 2000 + 100 for i in range(n)]  # as bench_llm_forward.py


def prefill_tokens(n: int) -> list[int]:
    return [(7 * i) % 1000 + 100 for i in range(n)]


# ---- llama.cpp worker (a subprocess; DIR first on sys.path) --------------------------------------


def _worker(build: str, gguf: str, context: int, threads: int) -> None:
    import ctypes

    sys.path.insert(0, build)
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=context + 256, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=False, verbose=False)
    ctx = llm._ctx.ctx
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], start: int, logits: set[int]) -> float:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i in logits
        llama_cpp.llama_memory_seq_rm(mem, 0, start, -1)  # back to the committed context (untimed)
        begin = time.perf_counter()
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        llama_cpp.llama_synchronize(ctx)
        return time.perf_counter() - begin

    for i in range(0, context, 256):  # the committed context
        chunk = context_tokens(context)[i:i + 256]
        decode(chunk, i, {len(chunk) - 1})
    verify = [123] + [(17 * i) % 1000 + 105 for i in range(VERIFY_ROWS - 1)]
    cases: dict[str, Callable[[], float]] = {
        "decode": lambda: decode([123], context, {0}),
        "verify": lambda: decode(verify, context, set(range(VERIFY_ROWS))),
        "prefill": lambda: decode(prefill_tokens(PREFILL_TOKENS), context, {PREFILL_TOKENS - 1}),
    }
    info = {"system": llama_cpp.llama_print_system_info().decode().strip(),
            "version": getattr(llama_cpp, "__version__", "?")}
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llm._model.model, desc, 256)
    info["model"] = desc.value.decode()
    print("ready " + json.dumps(info), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            break
        print(json.dumps(cases[name]()), flush=True)


def _quantize_worker(build: str, source: str, target: str, threads: int, ftype: str = "Q4_0") -> None:
    import ctypes

    if build:  # "": the installed llama-cpp-python
        sys.path.insert(0, build)
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")


class LlamaCppColumn:
    """One llama.cpp build on one GGUF, in a worker process asked one call at a time."""

    def __init__(self, build: str, gguf: Path, label: str, context: int, threads: int) -> None:
        self.label, self.build = label, build
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", build, str(gguf), str(context), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.proc.wait()
            err = self.proc.stderr.read().strip().splitlines()
            raise RuntimeError(f"{label}: worker failed (exit {self.proc.returncode}): {' / '.join(err[-3:])}")
        self.info = json.loads(line[6:])

    def call(self, case: str) -> Callable[[], float]:
        def run() -> float:
            self.proc.stdin.write(case + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

        return run

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ---- outrider -------------------------------------------------------------------------------------


class OutriderColumn:
    """The shared w4a8 model with kernel set `isa` forced for each of its calls."""

    def __init__(self, runner, isa: str) -> None:
        import torch

        self.runner, self.isa, self.label = runner, isa, f"outrider {isa}"
        model, cache, length = runner.model, runner.cache, runner.length
        verify = runner.verify(VERIFY_ROWS)
        prefill = runner._chain(0, prefill_tokens(PREFILL_TOKENS), length)
        last = torch.tensor([PREFILL_TOKENS - 1])
        self.cases = {"decode": runner.decode(), "verify": verify,
                      "prefill": lambda: model.forward(cache, [prefill], logit_rows=last)}

    def call(self, case: str) -> Callable[[], float]:
        from outrider_llm import native

        fn = self.cases[case]

        def run() -> float:
            native.select(self.isa)
            begin = time.perf_counter()
            fn()
            return time.perf_counter() - begin

        return run


def interleaved(fns: list[Callable[[], float]], repeats: list[int], warmup: int, gap: float) -> list[float]:
    """Median ms per column, calls round-robin (column c only in its first repeats[c] rounds); each
    fn returns its own seconds. A column of fewer repeats than the rest warms up once."""
    for fn, repeat in zip(fns, repeats):
        for _ in range(warmup if repeat == max(repeats) else 1):
            time.sleep(gap)
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for round_ in range(max(repeats)):
        for fn, repeat, out in zip(fns, repeats, samples):
            if round_ < repeat:
                time.sleep(gap)
                out.append(fn())
    return [statistics.median(out) * 1e3 for out in samples]


def q4_0_file(build: str, source: Path, tmp: str, threads: int) -> Path:
    return quantized_file(build, source, tmp, threads, "Q4_0")


def quantized_file(build: str, source: Path, directory: str, threads: int, ftype: str) -> Path:
    """`source` requantized by llama.cpp's own quantizer into `ftype` ("Q4_0", "Q8_0", "Q4_K_M",
    "Q6_K": a LLAMA_FTYPE_MOSTLY_* name) in `directory`; kept there if it exists already."""
    target = Path(directory) / source.name.replace(".Q4_1.", f".{ftype}.")
    if not target.exists():
        partial = target.with_suffix(".partial")
        subprocess.run([sys.executable, __file__, "--quantize-worker", build, str(source), str(partial), str(threads),
                        ftype], check=True, capture_output=True, text=True, cwd=ROOT)
        partial.rename(target)
    return target


def gguf_types(path: Path) -> str:
    """'Q4_0 x 210, F32 x 61, ...': tensor types of a GGUF, with the file size."""
    from collections import Counter

    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    return f"{path.stat().st_size / 1e6:.0f} MB; " + ", ".join(f"{k} x {v}" for k, v in counts.most_common())


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    if len(sys.argv) in (6, 7) and sys.argv[1] == "--quantize-worker":
        _quantize_worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), *sys.argv[6:7])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", default="", help="comma-separated llama-cpp-python target dirs (one "
                        "worker each); none: the llama.cpp columns are left out")
    parser.add_argument("--repeat", type=int, default=20, help="calls per case and column (prefill: a quarter, min 3)")
    parser.add_argument("--scalar-repeat", type=int, default=3, help="calls per case for the scalar kernel set")
    parser.add_argument("--context", type=int, default=256, help="committed tokens before each call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gap-ms", type=float, default=10.0, help="sleep before each timed call")
    parser.add_argument("--isa", default="", help="comma-separated kernel sets to run (default: all this CPU runs)")
    args = parser.parse_args()

    import torch

    from bench_llm_forward import Ours, quantized_models
    from outrider_llm import native
    from outrider_llm.loading import read_artifact_weights
    from outrider_llm.conversion import load_weights_artifact
    from outrider_llm.artifact import read_artifact_meta, smollm2_gguf_path
    from outrider_llm.model import LlamaConfig
    from outrider_llm.heap import tune_malloc

    torch.set_num_threads(args.threads)
    loaded, why = native.library()
    if not loaded:
        raise SystemExit(f"outrider's native kernels are not loaded: {why}")
    sets = native.kernel_sets()
    if args.isa:
        wanted = args.isa.split(",")
        unknown = [s for s in wanted if s not in sets]
        if unknown:
            raise SystemExit(f"--isa {','.join(unknown)}: not run by this CPU (it runs {', '.join(sets)})")
        sets = [s for s in sets if s in wanted]
    sets = [s for s in sets if s != "scalar"] + [s for s in sets if s == "scalar"]  # scalar last

    gguf = smollm2_gguf_path()
    tune_malloc()
    artifact = load_weights_artifact(gguf)
    config = LlamaConfig.from_dict(read_artifact_meta(artifact)["config"])
    raw = read_artifact_weights(artifact, raw_blocks=True)
    [(_, model)] = quantized_models(config, raw, ["w4a8"])
    del raw
    runner = Ours(model, context_tokens(args.context))
    columns: list = [OutriderColumn(runner, s) for s in sets]

    notes: list[str] = []
    builds = [b for b in args.llama_cpp.split(",") if b]
    tmp = tempfile.TemporaryDirectory(prefix="bench-native-")
    workers: list[LlamaCppColumn] = []
    try:
        if builds:
            try:
                q4_0 = q4_0_file(builds[0], gguf, tmp.name, args.threads)
                notes.append(f"Q4_0 made by llama.cpp's quantizer ({Path(builds[0]).name} build, allow_requantize "
                             f"from the Q4_1): {gguf_types(q4_0)}")
            except subprocess.CalledProcessError as exc:
                q4_0 = None
                notes.append(f"no Q4_0 file: the quantizer failed ({exc.stderr.strip()[-300:]})")
            notes.append(f"shipped Q4_1 {gguf.name}: {gguf_types(gguf)}")
            for build in builds:
                for kind, path in (("Q4_1", gguf), ("Q4_0", q4_0)):
                    if path is None:
                        continue
                    label = f"llama.cpp {Path(build).name} {kind}"
                    try:
                        workers.append(LlamaCppColumn(build, path, label, args.context, args.threads))
                    except RuntimeError as exc:
                        notes.append(str(exc))
            for w in workers:
                notes.append(f"{w.label}: {w.build}, llama-cpp-python {w.info['version']}, model '{w.info['model']}'; "
                             f"{w.info['system']}")
        else:
            notes.append("no llama.cpp columns: pass --llama-cpp DIR[,DIR] (llama-cpp-python target dirs)")
        columns += workers

        print(f"CPU: {cpu_model()}")
        print(f"CPU features (native.cpu_features()): {native.cpu_features()}")
        print(f"outrider kernel sets this CPU runs (best first): {', '.join(native.kernel_sets())}; "
              f"columns ran: {', '.join(sets)} (forced with native.select)")
        print(f"SmolLM2-135M, {args.context} committed tokens, {args.threads} threads, torch {torch.__version__}, "
              f"median of {args.repeat} calls ({max(3, args.repeat // 4)} for prefill; scalar {args.scalar_repeat}), "
              f"round-robin over columns, {args.gap_ms:g} ms gap")
        for note in notes:
            print(f"# {note}")

        best, avx2 = sets[0], ("avx2" if "avx2" in sets else None)
        refs = [(f"outrider {best}", 0)] + ([("outrider avx2", sets.index("avx2"))] if avx2 and avx2 != best else [])
        ratio_cols = [(w, ref) for w in range(len(sets), len(columns)) for ref in refs]
        ratio_names = [f"{columns[w].label.removeprefix('llama.cpp ')} / {name.removeprefix('outrider ')}"
                       for w, (name, _) in ratio_cols]
        names = [c.label for c in columns]
        widths = [max(12, len(n)) for n in names] + [max(10, len(n)) for n in ratio_names]
        header = "| case        | " + " | ".join(f"{n:>{w}}" for n, w in zip(names + ratio_names, widths)) + " |"
        rows_out = [header, "|" + "|".join("-" * len(p) for p in header.split("|")[1:-1]) + "|"]
        print()
        print(header)
        print(rows_out[1])
        for label, case in CASES:
            repeat = args.repeat if case != "prefill" else max(3, args.repeat // 4)
            repeats = [min(args.scalar_repeat, repeat) if getattr(c, "isa", "") == "scalar" else repeat
                       for c in columns]
            ms = interleaved([c.call(case) for c in columns], repeats, warmup=2, gap=args.gap_ms / 1e3)
            cells = [f"{v:.2f} ms" for v in ms]
            cells += [f"{ms[w] / ms[ref]:.2f}x" for w, (_, ref) in ratio_cols]
            print("| " + f"{label:<11}" + " | " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) + " |",
                  flush=True)
        if ratio_cols:
            print(f"\nRatio columns: llama.cpp column's time / outrider's (above 1: outrider faster); "
                  f"'/ {best}' = against outrider {best} (the best kernel set here)"
                  + (", '/ avx2' = against outrider avx2" if avx2 and avx2 != best else "") + ".")
    finally:
        for w in workers:
            w.close()
        tmp.cleanup()


def cpu_model() -> str:
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        name = fields.get("model name") or fields.get("Model") or fields.get("CPU part", "?")
        family = f", family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields else ""
        return f"{name}{family} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
