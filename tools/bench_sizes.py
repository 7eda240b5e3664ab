#!/usr/bin/env python3
"""The sizes edge users run, 1B to 8B, next to llama.cpp on the same file, in one run (issue 37).

  python tools/bench_sizes.py --shapes 1b --types Q4_0,Q4_K_M
  python tools/bench_sizes.py --shapes 1b,1.5b,3b,8b --types Q4_K_M,Q4_0 --make    # make missing files first
  python tools/bench_sizes.py --files a.gguf,b.gguf                              # any GGUFs instead

Files: tools/make_gguf.py's random-weight GGUFs at real shapes (~/.cache/outrider-bench/gguf/
<shape>-<type>.gguf; --make makes the missing ones, which takes minutes per shape), or --files.
llama.cpp: a CPU build with bin/llama-bench and bin/llama-server in --llama-cpp (default
$LLAMA_CPP_BUILD or /work/llamacpp-build; tools/build_llama_cpp.sh builds it).

For each file, one after the other (never both runtimes at once; --threads each, 2 by default):
  llama.cpp, llama-bench:  `llama-bench -m FILE -t 2 -p 512 -n 64 -r 3` (prefill 512, decode 64 at an
        empty context) and `llama-bench -m FILE -t 2 -p 0 -n 64 -d 4000 -r 1` (decode 64 after 4000
        tokens of context); its defaults otherwise (batch 2048, ubatch 512, flash attention auto).
  Outrider: `outrider serve` on a plain manifest (name x, backend llm, model {path: FILE}, options
        {max_sequences: 8, max_length: 4608, threads: 2}, no speculation) through bench_quantize's
        `Server` (an ipc:// socket in a temp dir). First start with a fresh OUTRIDER_CACHE_DIR (the
        file's artifacts are built), then a warm start (they are read): seconds from process start
        to every model ready (health asked every 50 ms); peak RSS during the first start (VmRSS of
        the server and every process under it, summed, sampled every 50 ms, or the server's VmHWM if
        higher); idle RSS (2 s after ready, the same sum). Then, greedy, one request at a time:
        decode at a short context (a 32-token prompt, 64 tokens, median of --runs), prefill of 512
        tokens (prompt tokens / time to first token of a 1-token request, median of --runs, each a
        new prompt so no prefix is reused), decode after 4000 tokens of context (one request), and
        aggregate decode of 1, 4 and 8 concurrent streams (48 tokens each, a 32-token prompt each,
        every stream its own thread and Client): generated tokens of all / wall time of all.
        Decode tok/s of one request = (tokens - 1) / (seconds - time to first token), as
        llama-bench's tg excludes the prefill.
  llama.cpp, llama-server: `llama-server -m FILE -t 2 -tb 2 -np 8 -c 36864` on 127.0.0.1 (8 slots of
        4608 tokens: Outrider's KV budget), start seconds to /health 200 and RSS as for Outrider,
        then the same streams (HTTP /completion, n_predict 48, temperature 0, ignore_eos,
        cache_prompt false) and, as a note, its own decode and prefill figures (timings) on the
        same prompts as Outrider's one-request rows.
Prompts are random sequences of single-token words of the files' (SmolLM2-derived) vocabulary, a
new sequence per request; the token counts the runtimes report are printed.

Read bandwidth: numpy reductions over a 2 GB array (--threads threads each over its half, best of
5) and a compiled read loop (32-byte loads, 1 GB, best of 8; where a C compiler is found), before
the first file and after the last; the tables use the highest. Bytes read per decoded token: llama.cpp, the file's
tensor bytes (less token_embd where the file has a separate output.weight: the embedding is only
gathered); Outrider, the weight bytes of its packed artifact (the tiles index in the cache; its
embedding included). "of bandwidth" = decode tok/s x bytes per token / bandwidth.

A shared machine: before each row (a start, the short decodes, the prefills, each stream count,
each llama-bench call) the tool waits up to --quiet-wait s (60) until the other processes use under
--quiet-cpus CPUs (0.25) over a second, and the table's last column gives the CPUs they used while
the row ran (Outrider / llama.cpp; from /proc/stat less this process tree's own CPU time).
llama-server allocates its whole KV cache (8 x 4608 tokens) at start; Outrider grows its cache as
sequences are admitted, so idle RSS differs by that.

Every request, start and loop is bounded; servers (and anything under them) are killed at the end,
on error too. All traffic stays on loopback (127.0.0.1) and ipc://. The numbers are from random
weights: speed and memory only. Compare within one run; a busy machine slows both columns.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

from bench_quantize import Server  # noqa: E402
from make_gguf import DEFAULT_DIR, DEFAULT_LLAMA_CPP, SHAPES, ensure, gguf_path  # noqa: E402

MODEL = "x"
MANIFEST = """name: {name}
backend: llm
model:
  path: {path}
options:
  max_sequences: {slots}
  max_length: {length}
  threads: {threads}
  kv_cache: {kv_cache}
"""
SLOTS, LENGTH = 8, 4608
IDLE_S = 2.0
POLL_S = 0.05
START_TIMEOUT_S = 1800.0
REQUEST_TIMEOUT_S = 900.0

_CHILDREN: list[subprocess.Popen] = []  # killed at exit whatever happened


def _kill_all() -> None:
    for proc in _CHILDREN:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL) if _own_group(proc) else proc.kill()
            except OSError:
                pass


def _own_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except OSError:
        return False


atexit.register(_kill_all)


# ---- processes and memory ---------------------------------------------------------------------


def _hwm_mb(pid: int) -> float:
    """The peak resident memory (VmHWM) of `pid`, in MB."""
    from outrider.harness import rss_mb

    return rss_mb(pid, "VmHWM")


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it (outrider.harness)."""
    from outrider.harness import process_tree as tree

    return tree(pid)


def tree_rss_mb(pid: int) -> float:
    """VmRSS of `pid` and every process under it, summed, in MB (outrider.harness)."""
    from outrider.harness import tree_rss_mb as read

    return read(pid)


class RssSampler:
    """Samples `tree_rss_mb(pid)` every POLL_S seconds in a thread; `peak_mb()` is the largest sum
    seen, or the top process's VmHWM where that is higher (a peak between two samples)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.hwm = pid, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_mb(self.pid))
            self.hwm = max(self.hwm, _hwm_mb(self.pid))
            self._stop.wait(POLL_S)

    def peak_mb(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return max(self.peak, self.hwm)


class OtherLoad:
    """CPU the rest of the machine uses while a block runs: every 0.5 s, busy jiffies of /proc/stat
    less those of this process and every process under it (the servers, llama-bench). `label` names
    the block the next intervals count for; `cpus(label)` is the mean other load in CPUs (of
    os.cpu_count()). Another build or test run on a 2-core machine shows here, and it slows both
    columns in turn."""

    def __init__(self) -> None:
        self.label = ""
        self.busy: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _machine_busy() -> int:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # less idle, iowait

    @staticmethod
    def _ours() -> dict[int, int]:
        out = {}
        for pid in process_tree(os.getpid()):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            out[pid] = int(fields[11]) + int(fields[12])  # utime + stime
        return out

    def _run(self) -> None:
        busy, ours, at = self._machine_busy(), self._ours(), time.monotonic()
        while not self._stop.wait(0.25):
            busy2, ours2, at2 = self._machine_busy(), self._ours(), time.monotonic()
            mine = sum(v - ours.get(pid, 0) for pid, v in ours2.items())
            other = max(busy2 - busy - mine, 0) / self._tick
            if self.label:
                self.busy[self.label] = self.busy.get(self.label, 0.0) + other
                self.wall[self.label] = self.wall.get(self.label, 0.0) + at2 - at
            busy, ours, at = busy2, ours2, at2

    @classmethod
    def now(cls, seconds: float = 1.0) -> float:
        """Other processes' CPU use over the next `seconds`, in CPUs."""
        busy, ours, at = cls._machine_busy(), cls._ours(), time.monotonic()
        time.sleep(seconds)
        busy2, ours2 = cls._machine_busy(), cls._ours()
        mine = sum(v - ours.get(pid, 0) for pid, v in ours2.items())
        return max(busy2 - busy - mine, 0) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - at)

    def cpus(self, label: str) -> Optional[float]:
        return self.busy[label] / self.wall[label] if self.wall.get(label) else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


LOAD: Optional[OtherLoad] = None
QUIET = {"seconds": 60.0, "cpus": 0.25}  # --quiet-wait, --quiet-cpus


def _label(name: str) -> None:
    if LOAD is not None:
        LOAD.label = name


def wait_quiet() -> bool:
    """Wait (at most QUIET["seconds"]) until the rest of the machine uses under QUIET["cpus"] CPUs
    over a second; whether it did."""
    end = time.monotonic() + QUIET["seconds"]
    while True:
        if OtherLoad.now(1.0) < QUIET["cpus"]:
            return True
        if time.monotonic() >= end:
            return False


@contextlib.contextmanager
def section(row: dict, *metrics: str) -> Iterator[None]:
    """Around the work of `metrics` of `row`: first wait for a quiet machine (wait_quiet), then
    count the other processes' CPU use meanwhile into row["load"][metric] (and the metric into
    row["not_quiet"] when the wait ran out)."""
    quiet = wait_quiet() if LOAD is not None and QUIET["seconds"] > 0 else True
    label = f"{id(row)}:{metrics[0]}:{time.monotonic()}"
    _label(label)
    try:
        yield
    finally:
        _label("")
        for metric in metrics:
            row.setdefault("load", {})[metric] = LOAD.cpus(label) if LOAD is not None else None
        if not quiet:
            row.setdefault("not_quiet", []).append(metrics[0])


# ---- machine --------------------------------------------------------------------------------


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), []))
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")
    return f"{model}, {os.cpu_count()} CPUs; " + " ".join(f for f in wanted if f in flags)


def outrider_kernels() -> str:
    """Outrider's native kernel set, asked in a fresh interpreter (as a server would load it)."""
    code = ("from outrider_llm import native_c as n\nok, why = n.library()\n"
            "print(why + (f'; sets this CPU runs: {\", \".join(n.kernel_sets())}; CPU features: {n.cpu_features()}' "
            "if ok else ''))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "runtime"), str(ROOT / "plugins")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return (done.stdout.strip() or done.stderr.strip()[-300:]).replace("\n", " ")


# A plain read loop (xor of 32-byte loads, 4 independent chains a thread), what the decode kernels'
# streaming is measured against; compiled here with the machine's C compiler where there is one.
_READ_LOOP = r"""
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef long long v4 __attribute__((vector_size(32)));
int main(int argc, char** argv) {
  const size_t n = (size_t)atof(argv[1]) * 1000000000ull / 128 * 128;
  const int threads = atoi(argv[2]), rounds = atoi(argv[3]);
  char* p = aligned_alloc(64, n);
  memset(p, 1, n);
  double best = 0;
  long long sink = 0;
  for (int r = 0; r < rounds; ++r) {
    const double t = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(^ : sink)
    {
      const size_t part = n / omp_get_num_threads() / 128 * 128, a = part * omp_get_thread_num();
      v4 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
      for (size_t i = a; i < a + part; i += 128) {
        s0 ^= *(const v4*)(p + i); s1 ^= *(const v4*)(p + i + 32);
        s2 ^= *(const v4*)(p + i + 64); s3 ^= *(const v4*)(p + i + 96);
      }
      v4 s = s0 ^ s1 ^ s2 ^ s3;
      sink ^= s[0] ^ s[1] ^ s[2] ^ s[3];
    }
    const double gbs = n / (omp_get_wtime() - t) / 1e9;
    if (gbs > best) best = gbs;
  }
  printf("%.3f %lld\n", best, sink);
  return 0;
}
"""


def read_bandwidth_c(threads: int, gigabytes: float = 1.0, rounds: int = 8) -> Optional[float]:
    """GB/s of a compiled read loop (`_READ_LOOP`), `threads` threads, best of `rounds`; None without a
    C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "read.c", Path(tmp) / "read"
        source.write_text(_READ_LOOP)
        built = subprocess.run([compiler, "-O2", "-mavx2" if os.uname().machine == "x86_64" else "-O2", "-fopenmp",
                                str(source), "-o", str(binary)], capture_output=True, text=True, timeout=120)
        if built.returncode != 0:
            return None
        out = subprocess.run([str(binary), str(gigabytes), str(threads), str(rounds)], capture_output=True,
                             text=True, timeout=300)
        return float(out.stdout.split()[0]) if out.returncode == 0 else None


def read_bandwidth(threads: int, gigabytes: float = 2.0, rounds: int = 5) -> float:
    """GB/s of numpy sums over a `gigabytes` array, `threads` threads each over its part, best of `rounds`."""
    words = np.ones(int(gigabytes * 1e9) // 8, dtype=np.uint64)  # written, so every page is real
    parts = np.array_split(words, threads)
    best = 0.0
    for _ in range(rounds):
        barrier = threading.Barrier(threads + 1)

        def work(part: np.ndarray) -> None:
            barrier.wait()
            np.add.reduce(part)  # numpy releases the GIL in the reduction

        pool = [threading.Thread(target=work, args=(p,)) for p in parts]
        for t in pool:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in pool:
            t.join()
        best = max(best, words.nbytes / (time.perf_counter() - start) / 1e9)
    del words, parts
    return best


# ---- files ----------------------------------------------------------------------------------


def file_bytes_per_token(path: Path) -> tuple[int, str, int]:
    """(bytes a decode step reads from the file's tensors, its tensor types, the bytes of token_embd
    where a separate output.weight is the head): all tensors, less such an embedding, which a step
    only gathers a row of. Outrider packs that embedding at its file type's bytes, so its served
    bytes less the same figure are what its step reads."""
    from collections import Counter

    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    gathered = sum(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight" and "output.weight" in names)
    total = sum(int(t.n_bytes) for t in tensors) - gathered
    types = Counter(t.tensor_type.name for t in tensors)
    return total, ", ".join(f"{k} x {v}" for k, v in types.most_common()), gathered


class Prompts:
    """Random sequences of words that are one token each in SmolLM2's vocabulary (which the
    make_gguf files carry): N words, about N tokens; a new sequence each call."""

    def __init__(self, seed: int = 37) -> None:
        from gguf import GGUFReader
        from outrider_llm.artifact import smollm2_gguf_path

        tokens = GGUFReader(str(smollm2_gguf_path())).fields["tokenizer.ggml.tokens"].contents()
        self.words = [" " + t[1:] for t in tokens[300:12000] if re.fullmatch(r"Ġ[a-z]{3,9}", t)]
        self.rng = np.random.default_rng(seed)

    def __call__(self, n: int) -> str:
        return "".join(self.rng.choice(self.words, n))


# ---- Outrider -------------------------------------------------------------------------------


def start_outrider(manifest: Path, threads: int, more: Sequence[Path] = ()) -> tuple[Server, float, float]:
    """(server, seconds from process start to ready, peak RSS MB during the start); `more`: further
    manifests the same server serves."""
    from outrider import Client

    started = time.perf_counter()
    server = Server([str(manifest), *map(str, more)], 0)  # threads come from the manifests
    _CHILDREN.append(server.proc)
    sampler = RssSampler(server.proc.pid)
    try:
        with Client(server.address, timeout=5.0) as client:
            client.wait_ready(START_TIMEOUT_S, interval=POLL_S, process=server.proc)
    except Exception as exc:
        log = Path(server.dir) / "server.log"
        server.stop()
        raise RuntimeError(f"outrider serve did not start: {exc}\n{log.read_text(errors='replace')[-3000:]}") from exc
    seconds = time.perf_counter() - started
    return server, seconds, sampler.peak_mb()


def artifact_weight_bytes(cache: Path) -> Optional[int]:
    """The packed weights' bytes of the artifact the first start built (the tiles index's
    `weight_bytes`), if there is one."""
    for index in sorted(cache.rglob("*.json"))[:2000]:
        try:
            data = json.loads(index.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("weight_bytes"), int):
            return data["weight_bytes"]
    return None


def decode_rate(stats: dict) -> float:
    """Tokens after the first / seconds after the first (llama-bench's tg excludes the prefill too)."""
    new, seconds, ttft = stats["new_tokens"], stats["seconds"], stats["time_to_first_token"]
    return (new - 1) / max(seconds - ttft, 1e-9) if new > 1 else 0.0


def streams(n: int, call: Callable[[int], int]) -> tuple[float, list[int]]:
    """`n` threads each `call(i)` (returning tokens generated) at once; (tokens/s of all, tokens each)."""
    barrier = threading.Barrier(n + 1)
    got: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            barrier.wait(60)
            got[i] = call(i)
        except Exception as exc:  # reported below, with the others' results
            got[i] = exc

    pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in pool:
        t.start()
    barrier.wait(60)
    start = time.perf_counter()
    for t in pool:
        t.join(REQUEST_TIMEOUT_S)
    wall = time.perf_counter() - start
    errors = [g for g in got if not isinstance(g, int)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed: {errors[0]!r}")
    return sum(got) / wall, got


def bench_outrider(path: Path, prompts: Prompts, args: argparse.Namespace, workdir: Path) -> dict:
    from outrider import Client

    row: dict = {}
    manifest = workdir / f"{path.stem}.yaml"
    manifest.write_text(MANIFEST.format(name=MODEL, path=path, slots=SLOTS, length=LENGTH, threads=args.threads,
                                        kv_cache=args.kv_cache))
    cache = workdir / f"cache-{path.stem}"
    os.environ["OUTRIDER_CACHE_DIR"] = str(cache)  # fresh: the first start builds the artifacts
    with section(row, "first_start", "first_peak"):
        server, row["first_start"], row["first_peak"] = start_outrider(manifest, args.threads)
    server.stop()
    with section(row, "warm_start", "warm_peak"):
        server, row["warm_start"], row["warm_peak"] = start_outrider(manifest, args.threads)
    try:
        row["weight_bytes"], row["weight_bytes_from"] = artifact_weight_bytes(cache), "the artifact's tiles index"
        row["kernel_line"] = server.kernel_line()
        with Client(server.address, timeout=REQUEST_TIMEOUT_S) as client:
            health = client.health()["models"][MODEL]["instances"][0].get("backend", {})
            row["health"] = health
            if isinstance(health.get("weights", {}).get("bytes"), int):  # newer servers say it themselves
                row["weight_bytes"], row["weight_bytes_from"] = health["weights"]["bytes"], "health"
            with section(row, "idle_rss"):
                time.sleep(IDLE_S)
                row["idle_rss"] = tree_rss_mb(server.proc.pid)

            def gen(words: int, tokens: int) -> dict:
                return client.generate(MODEL, prompt=prompts(words), max_tokens=tokens, temperature=0.0).stats

            gen(32, 8)  # warm-up
            with section(row, "decode"):
                short = [gen(32, args.tokens) for _ in range(args.runs)]
            row["decode"] = statistics.median(decode_rate(s) for s in short)
            row["short_tokens"] = (short[0]["prompt_tokens"], short[0]["new_tokens"])
            with section(row, "prefill"):
                pre = [gen(args.prefill, 1) for _ in range(args.runs)]
            row["prefill"] = statistics.median(s["prompt_tokens"] / max(s["time_to_first_token"], 1e-9) for s in pre)
            row["prefill_tokens"] = pre[0]["prompt_tokens"]
            if args.context:
                with section(row, "decode_long"):
                    long = gen(args.context, args.tokens)
                row["decode_long"] = decode_rate(long)
                row["long_prefill"] = long["prompt_tokens"] / max(long["time_to_first_token"], 1e-9)
                row["long_tokens"] = (long["prompt_tokens"], long["new_tokens"])
        for n in args.streams:
            texts = [prompts(32) for _ in range(n)]

            def one(i: int) -> int:
                with Client(server.address, timeout=REQUEST_TIMEOUT_S) as c:
                    return len(c.generate(MODEL, prompt=texts[i], max_tokens=args.stream_tokens,
                                          temperature=0.0).token_ids)

            with section(row, f"streams_{n}"):
                row[f"streams_{n}"], row[f"streams_{n}_tokens"] = streams(n, one)
        row["serving_peak"] = max(_hwm_mb(server.proc.pid), tree_rss_mb(server.proc.pid))
    finally:
        server.stop()
        shutil.rmtree(cache, ignore_errors=True)
    return row


# ---- llama.cpp ------------------------------------------------------------------------------


def kv_flags(kv_cache: str) -> list[str]:
    """llama.cpp's cache-type flags for the KV cache type both runtimes hold (Outrider's options.kv_cache)."""
    return ["-ctk", kv_cache, "-ctv", kv_cache]


def llama_bench(binary: Path, path: Path, threads: int, extra: list[str]) -> list[dict]:
    done = subprocess.run([str(binary), "-m", str(path), "-t", str(threads), "-o", "json", *extra],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench {' '.join(extra)} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def free_port() -> int:
    from outrider.harness import free_port as find

    return find()


class LlamaServer:
    """`llama-server` on 127.0.0.1 (a free port), in its own process group."""

    def __init__(self, binary: Path, path: Path, threads: int, log: Path, kv_cache: str = "f16",
                 slots: int = SLOTS, length: int = LENGTH, extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.started = time.perf_counter()
        self.log = log
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(path), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
             "-c", str(slots * length), "--host", "127.0.0.1", "--port", str(self.port),
             "--no-webui", *kv_flags(kv_cache), *extra],
            stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True)
        _CHILDREN.append(self.proc)

    def wait_ready(self) -> float:
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(POLL_S)
        raise RuntimeError("llama-server not ready in time")

    def complete(self, prompt: str, tokens: int) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        request = urllib.request.Request(self.url + "/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return json.loads(reply.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def bench_llama_cpp(path: Path, prompts: Prompts, args: argparse.Namespace, workdir: Path) -> dict:
    bin_dir = Path(args.llama_cpp) / "bin"
    row: dict = {}
    with section(row, "decode", "prefill"):
        tests = llama_bench(bin_dir / "llama-bench", path, args.threads,
                            ["-p", str(args.prefill), "-n", str(args.tokens), "-r", str(args.runs),
                             *kv_flags(args.kv_cache)])
    if args.context:
        with section(row, "decode_long"):
            tests += llama_bench(bin_dir / "llama-bench", path, args.threads,
                                 ["-p", "0", "-n", str(args.tokens), "-d", str(args.context), "-r", "1",
                                  *kv_flags(args.kv_cache)])
    for t in tests:
        depth = t.get("n_depth", 0)
        if t["n_prompt"] and not t["n_gen"]:
            row["prefill"] = t["avg_ts"]
        elif t["n_gen"] and not t["n_prompt"]:
            row["decode_long" if depth else "decode"] = t["avg_ts"]
    row["system"] = {k: tests[0].get(k) for k in ("build_commit", "cpu_info", "backends", "n_threads", "type_k",
                                                    "flash_attn", "n_batch", "n_ubatch")}
    for attempt in ("first", "warm"):
        with section(row, f"{attempt}_start", f"{attempt}_peak"):
            server = LlamaServer(bin_dir / "llama-server", path, args.threads,
                                 workdir / f"llama-server-{attempt}.log", args.kv_cache)
            sampler = RssSampler(server.proc.pid)
            try:
                row[f"{attempt}_start"] = server.wait_ready()
            except Exception:
                server.stop()
                raise
            row[f"{attempt}_peak"] = sampler.peak_mb()
        if attempt == "first":
            server.stop()
    try:
        with section(row, "idle_rss"):
            time.sleep(IDLE_S)
            row["idle_rss"] = tree_rss_mb(server.proc.pid)
        server.complete(prompts(32), 8)  # warm-up
        with section(row, "server_decode"):
            short = [server.complete(prompts(32), args.tokens)["timings"] for _ in range(args.runs)]
        row["server_decode"] = statistics.median(t["predicted_per_second"] for t in short)
        row["short_tokens"] = (short[0]["prompt_n"], short[0]["predicted_n"])
        with section(row, "server_prefill"):
            pre = [server.complete(prompts(args.prefill), 1)["timings"] for _ in range(args.runs)]
        row["server_prefill"] = statistics.median(t["prompt_per_second"] for t in pre)
        row["prefill_tokens"] = pre[0]["prompt_n"]
        for n in args.streams:
            texts = [prompts(32) for _ in range(n)]
            with section(row, f"streams_{n}"):
                row[f"streams_{n}"], row[f"streams_{n}_tokens"] = streams(
                    n, lambda i: int(server.complete(texts[i], args.stream_tokens)["tokens_predicted"]))
        row["serving_peak"] = max(_hwm_mb(server.proc.pid), tree_rss_mb(server.proc.pid))
    finally:
        server.stop()
    return row


# ---- report ---------------------------------------------------------------------------------


def table(path: Path, o: dict, c: dict, bandwidth: float, file_bpt: int, types: str, gathered: int,
          args: argparse.Namespace) -> str:
    # Served bytes less an untied embedding, of which a step reads one row (8B: ~300 MB it counted before).
    o_bpt = o["weight_bytes"] - gathered if o.get("weight_bytes") else file_bpt

    def fmt(v: Any, digits: int) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    rows = [("first start, s (Outrider: fresh artifact cache)", "first_start", 1),
            ("warm start, s", "warm_start", 1),
            ("peak RSS during first start, MB", "first_peak", 0),
            (f"idle RSS ({IDLE_S:g} s after ready), MB", "idle_rss", 0),
            ("peak RSS serving (after all rows), MB", "serving_peak", 0),
            (f"decode tok/s, {args.tokens} tokens after a 32-token prompt (l.cpp: llama-bench tg{args.tokens})",
             "decode", 1)]
    if args.context:
        rows.append((f"decode tok/s after {args.context} tokens of context (l.cpp: tg{args.tokens} @ "
                     f"d{args.context})", "decode_long", 1))
    rows.append((f"prefill tok/s, {args.prefill} tokens (l.cpp: llama-bench pp{args.prefill})", "prefill", 1))
    rows += [(f"aggregate decode tok/s, {n} stream{'s' if n > 1 else ''} x {args.stream_tokens} tokens",
              f"streams_{n}", 1) for n in args.streams]
    table_rows = [(label, o.get(key), c.get(key), digits, key) for label, key, digits in rows]
    table_rows += [("bytes read per token, MB", o_bpt / 1e6, file_bpt / 1e6, 0, ""),
                   (f"short decode, fraction of {bandwidth:.1f} GB/s read bandwidth",
                    o.get("decode") and o["decode"] * o_bpt / (bandwidth * 1e9),
                    c.get("decode") and c["decode"] * file_bpt / (bandwidth * 1e9), 2, "decode")]
    lines = [f"\n### {path.name} ({path.stat().st_size / 1e9:.2f} GB; {types})\n",
             "| metric | Outrider | llama.cpp | ratio | others' CPU (O / L) |", "|---|---:|---:|---:|---:|"]
    for label, ov, cv, digits, key in table_rows:
        ratio = f"{ov / cv:.2f}x" if ov and cv else "-"
        load = "" if not key else \
            f"{fmt(o.get('load', {}).get(key), 2)} / {fmt(c.get('load', {}).get(key), 2)}"
        lines.append(f"| {label} | {fmt(ov, digits)} | {fmt(cv, digits)} | {ratio} | {load} |")
    lines.append(f"\nratio = Outrider / llama.cpp (above 1: Outrider higher; for seconds and MB lower is better). "
                 f"others' CPU: the CPUs (of {os.cpu_count()}) other processes used while that row ran, "
                 f"each row started after waiting up to {QUIET['seconds']:g} s for under {QUIET['cpus']:g}"
                 + (f"; the wait ran out before: Outrider {o.get('not_quiet')}, llama.cpp {c.get('not_quiet')}"
                    if o.get("not_quiet") or c.get("not_quiet") else "") + ".")
    notes = []
    if o:
        health = o.get("health", {})
        served = health.get("weights", {}).get("block_types")
        kv = health.get("kv_cache")
        kv = f"; KV cache {kv.get('dtype')}, {kv.get('bytes', 0) / 1e6:.0f} MB at ready" if isinstance(kv, dict) else ""
        notes.append(f"Outrider serves: runtime {health.get('runtime', '?')}, block types {served}; "
                     f"weights {o['weight_bytes'] / 1e6:.0f} MB (from {o.get('weight_bytes_from')}){kv}"
                     if o.get("weight_bytes") else
                     f"Outrider serves: {health}; its weight bytes not found (the file's used)")
        notes.append(f"Outrider tokens: short {o.get('short_tokens')} (prompt, new), prefill {o.get('prefill_tokens')}, "
                     f"long {o.get('long_tokens')}; prefill of the long prompt {fmt(o.get('long_prefill'), 1)} tok/s; "
                     f"streams' tokens {[o.get(f'streams_{n}_tokens') for n in args.streams]}")
    if c:
        notes.append(f"llama-server on the same prompts: decode {fmt(c.get('server_decode'), 1)} tok/s "
                     f"(tokens {c.get('short_tokens')}), prefill {fmt(c.get('server_prefill'), 1)} tok/s "
                     f"({c.get('prefill_tokens')} tokens); streams' tokens {[c.get(f'streams_{n}_tokens') for n in args.streams]}")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def resolve_files(args: argparse.Namespace) -> list[Path]:
    if args.files:
        return [Path(f).expanduser().resolve() for f in args.files.split(",")]
    out = []
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        types = args.types.split(",")
        if args.make:
            ensure(shape, types, Path(args.dir), Path(args.llama_cpp), args.threads)
        for ftype in types:
            path = gguf_path(Path(args.dir), shape, ftype)
            if not path.exists():
                raise SystemExit(f"{path} is missing: make it with tools/make_gguf.py --shapes {shape} --types {ftype} "
                                 f"(or pass --make)")
            out.append(path)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--types", default="Q4_K_M,Q4_0")
    parser.add_argument("--files", default="", help="comma-separated GGUF paths instead of --shapes/--types")
    parser.add_argument("--dir", default=str(DEFAULT_DIR))
    parser.add_argument("--make", action="store_true", help="make missing files with make_gguf.py first")
    parser.add_argument("--llama-cpp", default=DEFAULT_LLAMA_CPP, help="llama.cpp build dir (bin/llama-bench, "
                        "bin/llama-server)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="repeats of the short decode and the prefill (median)")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens of the one-request rows")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--context", type=int, default=4000, help="context of the long decode row (0: skip it)")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--stream-tokens", type=int, default=48)
    parser.add_argument("--quiet-wait", type=float, default=60.0, help="before each row, wait up to this many "
                        "seconds for the rest of the machine to use under --quiet-cpus CPUs (0: no wait)")
    parser.add_argument("--quiet-cpus", type=float, default=0.25)
    parser.add_argument("--kv-cache", default="f16", choices=["f16", "q8_0", "f32"],
                        help="the KV cache type of both runtimes (Outrider's options.kv_cache, llama.cpp's -ctk/-ctv)")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-outrider", action="store_true")
    args = parser.parse_args()
    args.streams = [int(n) for n in args.streams.split(",") if n]
    QUIET.update(seconds=args.quiet_wait, cpus=args.quiet_cpus)
    if max(args.streams, default=1) > SLOTS or args.context + args.tokens > LENGTH:
        raise SystemExit(f"at most {SLOTS} streams and {LENGTH} tokens of context (the manifest's)")
    bin_dir = Path(args.llama_cpp) / "bin"
    if not args.skip_llama_cpp and not (bin_dir / "llama-bench").exists():
        raise SystemExit(f"{bin_dir}/llama-bench not found: build llama.cpp (tools/build_llama_cpp.sh), pass "
                         f"--llama-cpp DIR, or --skip-llama-cpp")
    files = resolve_files(args)
    print(f"CPU: {cpu_line()}")
    if not args.skip_outrider:
        print(f"Outrider native kernels: {outrider_kernels()}")
    bandwidth = [read_bandwidth(args.threads)]
    print(f"read bandwidth, {args.threads} threads: {bandwidth[0]:.1f} GB/s (numpy sums)", flush=True)
    looped = read_bandwidth_c(args.threads)
    if looped is not None:
        bandwidth.append(looped)
        print(f"read bandwidth, {args.threads} threads: {looped:.1f} GB/s (a compiled read loop)", flush=True)
    prompts = Prompts()
    global LOAD
    LOAD = OtherLoad()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-sizes-") as tmp:
        for path in files:
            bpt, types, gathered = file_bytes_per_token(path)
            print(f"{path.name}: llama.cpp ...", file=sys.stderr, flush=True)
            c = {} if args.skip_llama_cpp else bench_llama_cpp(path, prompts, args, Path(tmp))
            print(f"{path.name}: Outrider ...", file=sys.stderr, flush=True)
            o = {} if args.skip_outrider else bench_outrider(path, prompts, args, Path(tmp))
            results.append((path, o, c, bpt, types, gathered))
            if c.get("system"):
                print(f"llama.cpp ({path.name}): {c['system']}")
            if o.get("kernel_line"):
                print(f"Outrider server log: {o['kernel_line']}")
    bandwidth.append(read_bandwidth(args.threads))
    looped = read_bandwidth_c(args.threads)
    bandwidth += [looped] if looped is not None else []
    print(f"read bandwidth after the run: {bandwidth[-1]:.1f} GB/s; the tables use the best of "
          f"{', '.join(f'{b:.1f}' for b in bandwidth)}")
    for path, o, c, bpt, types, gathered in results:
        print(table(path, o, c, max(bandwidth), bpt, types, gathered, args))


if __name__ == "__main__":
    main()
