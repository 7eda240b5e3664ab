"""Per-model counters and histograms: one source for `health --json` and Prometheus.

Prometheus gets Outrider's own names (`outrider_*`) and, from the same figures, the names
existing dashboards read: Triton's `nv_inference_*` and vLLM's `vllm:*` (see docs/HTTP.md).
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Iterable

# Seconds; covers the echo model (tens of microseconds) up to slow batches.
TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    """Cumulative-bucket histogram, cheap to observe from any thread (caller holds the lock)."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            cumulative.append((bound, running))
        return {"count": self.count, "sum": self.total, "buckets": cumulative}

    def quantile(self, q: float) -> float:
        """Upper bucket bound holding quantile q (coarse, for humans)."""
        if not self.count:
            return 0.0
        target, running = q * self.count, 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            if running >= target:
                return bound
        return float("inf")


class ModelStats:
    """Everything counted for one model. Thread-safe through one small lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.successes = 0
        self.failures: dict[str, int] = {}
        #: rows answered successfully (a request of 8 sentences counts 8; a generation counts 1)
        self.inferences = 0
        self.queue_seconds = Histogram(TIME_BUCKETS)  # arrival -> execution (a generation: -> its slot)
        self.compute_seconds = Histogram(TIME_BUCKETS)
        #: each request charged its batch's compute time (Triton's per-request compute figure)
        self.request_compute_seconds = 0.0
        self.batch_size = Histogram(SIZE_BUCKETS)
        self.request_seconds = Histogram(TIME_BUCKETS)  # arrival -> final reply, every request answered
        # Generation: arrival -> first token; between two emissions to one request (a speculative
        # step emits several tokens at once, as vLLM counts it); per request, decode time per token.
        self.first_token_seconds = Histogram(TIME_BUCKETS)
        self.inter_token_seconds = Histogram(TIME_BUCKETS)
        self.per_output_token_seconds = Histogram(TIME_BUCKETS)
        self.running = 0  # sequences holding a generation slot
        self.load_seconds = 0.0
        self.warmup_seconds = 0.0
        self.instance_restarts = 0
        self.extra: dict[str, float] = {}  # accelerator figures (acceptance, ...)

    def request(self) -> None:
        with self._lock:
            self.requests += 1

    def success(self, n: int = 1, rows: int = 1) -> None:
        with self._lock:
            self.successes += n
            self.inferences += rows

    def failure(self, code: str, n: int = 1) -> None:
        with self._lock:
            self.failures[code] = self.failures.get(code, 0) + n

    def restart(self) -> None:
        with self._lock:
            self.instance_restarts += 1

    def batch(self, size: int, queue_seconds: Iterable[float], compute_seconds: float) -> None:
        with self._lock:
            self.batch_size.observe(size)
            for q in queue_seconds:
                self.queue_seconds.observe(q)
            self.compute_seconds.observe(compute_seconds)
            self.request_compute_seconds += compute_seconds * size

    def observe(self, histogram: str, seconds: float) -> None:
        """One observation of a time histogram by name (`first_token_seconds`, `queue_seconds`...)."""
        with self._lock:
            getattr(self, histogram).observe(seconds)

    def sequences(self, delta: int) -> None:
        """A generation took (+1) or gave back (-1) a slot."""
        with self._lock:
            self.running += delta

    def add(self, key: str, value: float) -> None:
        with self._lock:
            self.extra[key] = self.extra.get(key, 0.0) + value

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self.requests,
                "successes": self.successes,
                "failures": dict(self.failures),
                "inferences": self.inferences,
                "queue_seconds": self.queue_seconds.snapshot(),
                "compute_seconds": self.compute_seconds.snapshot(),
                "request_compute_seconds": self.request_compute_seconds,
                "batch_size": self.batch_size.snapshot(),
                "request_seconds": self.request_seconds.snapshot(),
                "first_token_seconds": self.first_token_seconds.snapshot(),
                "inter_token_seconds": self.inter_token_seconds.snapshot(),
                "per_output_token_seconds": self.per_output_token_seconds.snapshot(),
                "running": self.running,
                "load_seconds": self.load_seconds,
                "warmup_seconds": self.warmup_seconds,
                "instance_restarts": self.instance_restarts,
                **({"extra": dict(self.extra)} if self.extra else {}),
            }


def _buckets(h: dict[str, Any]) -> list[tuple[str, int]]:
    return [(str(b) if b != float("inf") else "+Inf", c) for b, c in h["buckets"]]


# Triton's failure reasons (REJECTED, CANCELED, BACKEND, OTHER) for Outrider's error codes.
_TRITON_REASON = {"overloaded": "REJECTED", "unavailable": "REJECTED", "model_not_ready": "REJECTED",
                  "cancelled": "CANCELED", "execution_error": "BACKEND", "internal": "BACKEND"}


class PrometheusCollector:
    """A prometheus_client collector that reads ModelStats at scrape time (no double bookkeeping).

    Besides Outrider's own families it writes the same figures under the names that Triton
    (`nv_inference_*`, labels model and version) and vLLM (`vllm:*`, label model_name)
    dashboards read, so those work unchanged; `compat=False` leaves them out.
    """

    def __init__(self, models: Any, compat: bool = True, index: Any = None) -> None:
        self._models = models  # callable returning {name: ServedModel}
        self._compat = compat
        self._index = index  # callable returning the repository index (every model, loaded or not)

    def collect(self):  # noqa: D401 - prometheus_client's interface
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        req = CounterMetricFamily("outrider_requests", "Requests received", labels=["model"])
        ok = CounterMetricFamily("outrider_request_successes", "Requests answered with outputs", labels=["model"])
        bad = CounterMetricFamily("outrider_request_failures", "Requests answered with an error", labels=["model", "code"])
        ready = GaugeMetricFamily("outrider_model_ready", "1 while the model is ready", labels=["model"])
        load = GaugeMetricFamily("outrider_model_load_seconds", "Time to load the model", labels=["model"])
        warm = GaugeMetricFamily("outrider_model_warmup_seconds", "Time to warm the model up", labels=["model"])
        restarts = CounterMetricFamily("outrider_instance_restarts", "Instances replaced after a failure", labels=["model"])
        depth = GaugeMetricFamily("outrider_queue_depth", "Requests waiting for an instance", labels=["model"])
        running = GaugeMetricFamily("outrider_running", "Requests being executed (generations holding a slot)",
                                    labels=["model"])
        tokens = CounterMetricFamily("outrider_generated_tokens", "Tokens generated", labels=["model"])
        drafted = CounterMetricFamily("outrider_draft_tokens", "Draft tokens proposed by speculative decoding",
                                      labels=["model"])
        accepted = CounterMetricFamily("outrider_accepted_tokens", "Draft tokens accepted by the model",
                                       labels=["model"])
        hists = {
            "queue_seconds": HistogramMetricFamily("outrider_queue_seconds", "Time from arrival to execution (a generation: to its slot)", labels=["model"]),
            "compute_seconds": HistogramMetricFamily("outrider_compute_seconds", "Time in execute per batch", labels=["model"]),
            "batch_size": HistogramMetricFamily("outrider_batch_size", "Requests per executed batch", labels=["model"]),
            "request_seconds": HistogramMetricFamily("outrider_request_seconds", "Time from arrival to the final reply", labels=["model"]),
            "first_token_seconds": HistogramMetricFamily("outrider_time_to_first_token_seconds", "Time from arrival to the first generated token", labels=["model"]),
            "inter_token_seconds": HistogramMetricFamily("outrider_inter_token_seconds", "Time between two emissions of tokens to one generation", labels=["model"]),
            "per_output_token_seconds": HistogramMetricFamily("outrider_time_per_output_token_seconds", "Per generation: decode time per token after the first", labels=["model"]),
        }
        compat = _CompatFamilies() if self._compat else None
        if self._index is not None:
            state = GaugeMetricFamily("outrider_model_state", "1 for the state each model of the repository is in",
                                      labels=["model", "state"])
            for item in self._index():
                for name in ("available", "loading", "ready", "unloading", "failed"):
                    state.add_metric([item["name"], name], 1.0 if item["state"] == name else 0.0)
            yield state
        for name, model in list(self._models().items()):
            snap = model.stats.snapshot()
            extra = snap.get("extra", {})
            req.add_metric([name], snap["requests"])
            ok.add_metric([name], snap["successes"])
            for code, n in snap["failures"].items():
                bad.add_metric([name, code], n)
            ready.add_metric([name], 1.0 if model.ready else 0.0)
            load.add_metric([name], snap["load_seconds"])
            warm.add_metric([name], snap["warmup_seconds"])
            restarts.add_metric([name], snap["instance_restarts"])
            queued = model.queue_depth()
            depth.add_metric([name], queued)
            active = model.running()
            running.add_metric([name], active)
            for family, key in ((tokens, "generated_tokens"), (drafted, "draft_tokens"), (accepted, "accepted_tokens")):
                family.add_metric([name], extra.get(key, 0.0))
            for key, fam in hists.items():
                fam.add_metric([name], _buckets(snap[key]), sum_value=snap[key]["sum"])
            if compat is not None:
                compat.add(name, snap, queued, active, model.generates)
        yield from (req, ok, bad, ready, load, warm, restarts, depth, running, tokens, drafted, accepted,
                    *hists.values())
        if compat is not None:
            yield from compat.families()


class _CompatFamilies:
    """Triton's and vLLM's metric names, filled from one model's snapshot at a time."""

    def __init__(self) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        tl, vl = ["model", "version"], ["model_name"]
        self.triton = {
            "success": CounterMetricFamily("nv_inference_request_success", "Successful inference requests", labels=tl),
            "failure": CounterMetricFamily("nv_inference_request_failure", "Failed inference requests",
                                           labels=[*tl, "reason"]),
            "count": CounterMetricFamily("nv_inference_count", "Inferences performed (a batch of N rows counts N)", labels=tl),
            "exec": CounterMetricFamily("nv_inference_exec_count", "Model executions (batches)", labels=tl),
            "request_us": CounterMetricFamily("nv_inference_request_duration_us", "Cumulative request duration, arrival to reply", labels=tl),
            "queue_us": CounterMetricFamily("nv_inference_queue_duration_us", "Cumulative time requests waited in the queue", labels=tl),
            "compute_us": CounterMetricFamily("nv_inference_compute_infer_duration_us", "Cumulative compute time charged to requests", labels=tl),
            "pending": GaugeMetricFamily("nv_inference_pending_request_count", "Requests waiting in the queue", labels=tl),
        }
        self.vllm = {
            "ttft": HistogramMetricFamily("vllm:time_to_first_token_seconds", "Time to first token", labels=vl),
            "itl": HistogramMetricFamily("vllm:inter_token_latency_seconds", "Inter-token latency (per emission)", labels=vl),
            "tpot": HistogramMetricFamily("vllm:request_time_per_output_token_seconds", "Per request: time per output token", labels=vl),
            "queue": HistogramMetricFamily("vllm:request_queue_time_seconds", "Time waiting for a generation slot", labels=vl),
            "e2e": HistogramMetricFamily("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels=vl),
            "running": GaugeMetricFamily("vllm:num_requests_running", "Generations holding a slot", labels=vl),
            "waiting": GaugeMetricFamily("vllm:num_requests_waiting", "Generations waiting for a slot", labels=vl),
            "prompt": CounterMetricFamily("vllm:prompt_tokens", "Prompt tokens processed", labels=vl),
            "generation": CounterMetricFamily("vllm:generation_tokens", "Tokens generated", labels=vl),
            "accepted": CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels=vl),
            "draft": CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", labels=vl),
            "drafts": CounterMetricFamily("vllm:spec_decode_num_drafts", "Speculative decode steps (per sequence)", labels=vl),
            "prefix_queries": CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                                  labels=vl),
            "prefix_hits": CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                               labels=vl),
        }

    def add(self, name: str, snap: dict[str, Any], queued: int, running: int, generates: bool) -> None:
        t, labels = self.triton, [name, "1"]
        t["success"].add_metric(labels, snap["successes"])
        reasons: dict[str, int] = {}
        for code, n in snap["failures"].items():
            reason = _TRITON_REASON.get(code, "OTHER")
            reasons[reason] = reasons.get(reason, 0) + n
        for reason, n in sorted(reasons.items()):
            t["failure"].add_metric([*labels, reason], n)
        t["count"].add_metric(labels, snap["inferences"])
        t["exec"].add_metric(labels, snap["batch_size"]["count"])
        t["request_us"].add_metric(labels, snap["request_seconds"]["sum"] * 1e6)
        t["queue_us"].add_metric(labels, snap["queue_seconds"]["sum"] * 1e6)
        t["compute_us"].add_metric(labels, snap["request_compute_seconds"] * 1e6)
        t["pending"].add_metric(labels, queued)
        if not generates:
            return
        v, labels, extra = self.vllm, [name], snap.get("extra", {})
        for key, stat in (("ttft", "first_token_seconds"), ("itl", "inter_token_seconds"),
                          ("tpot", "per_output_token_seconds"), ("queue", "queue_seconds"), ("e2e", "request_seconds")):
            v[key].add_metric(labels, _buckets(snap[stat]), sum_value=snap[stat]["sum"])
        v["running"].add_metric(labels, running)
        v["waiting"].add_metric(labels, queued)
        for key, stat in (("prompt", "prompt_tokens"), ("generation", "generated_tokens"), ("accepted", "accepted_tokens"),
                          ("draft", "draft_tokens"), ("drafts", "speculative_steps"),
                          ("prefix_queries", "prefix_cache_queries"), ("prefix_hits", "prefix_cache_hits")):
            v[key].add_metric(labels, extra.get(stat, 0.0))

    def families(self):
        yield from self.triton.values()
        yield from self.vllm.values()


def metrics_text(models: Any, index: Any = None) -> tuple[bytes, str]:
    """The Prometheus exposition of `models()` (body, content type), for fronts serving /metrics;
    `index()`: the repository's, for each model's state."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(PrometheusCollector(models, index=index))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def start_metrics_server(port: int, models: Any, addr: str = "127.0.0.1", index: Any = None) -> None:
    """Serve Prometheus text on http://addr:port/metrics (prometheus_client's own server thread)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(PrometheusCollector(models, index=index))
    start_http_server(port, addr=addr, registry=registry)
