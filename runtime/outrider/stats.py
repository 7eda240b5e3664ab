"""Per-model counters and histograms: one source for `health --json` and Prometheus."""

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
        self.queue_seconds = Histogram(TIME_BUCKETS)
        self.compute_seconds = Histogram(TIME_BUCKETS)
        self.batch_size = Histogram(SIZE_BUCKETS)
        self.load_seconds = 0.0
        self.warmup_seconds = 0.0
        self.instance_restarts = 0
        self.extra: dict[str, float] = {}  # accelerator figures (acceptance, ...)

    def request(self) -> None:
        with self._lock:
            self.requests += 1

    def success(self, n: int = 1) -> None:
        with self._lock:
            self.successes += n

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

    def add(self, key: str, value: float) -> None:
        with self._lock:
            self.extra[key] = self.extra.get(key, 0.0) + value

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self.requests,
                "successes": self.successes,
                "failures": dict(self.failures),
                "queue_seconds": self.queue_seconds.snapshot(),
                "compute_seconds": self.compute_seconds.snapshot(),
                "batch_size": self.batch_size.snapshot(),
                "load_seconds": self.load_seconds,
                "warmup_seconds": self.warmup_seconds,
                "instance_restarts": self.instance_restarts,
                **({"extra": dict(self.extra)} if self.extra else {}),
            }


class PrometheusCollector:
    """A prometheus_client collector that reads ModelStats at scrape time (no double bookkeeping)."""

    def __init__(self, models: Any) -> None:
        self._models = models  # callable returning {name: ServedModel}

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
        hists = {
            "queue_seconds": HistogramMetricFamily("outrider_queue_seconds", "Time from arrival to execution", labels=["model"]),
            "compute_seconds": HistogramMetricFamily("outrider_compute_seconds", "Time in execute per batch", labels=["model"]),
            "batch_size": HistogramMetricFamily("outrider_batch_size", "Requests per executed batch", labels=["model"]),
        }
        for name, model in self._models().items():
            snap = model.stats.snapshot()
            req.add_metric([name], snap["requests"])
            ok.add_metric([name], snap["successes"])
            for code, n in snap["failures"].items():
                bad.add_metric([name, code], n)
            ready.add_metric([name], 1.0 if model.ready else 0.0)
            load.add_metric([name], snap["load_seconds"])
            warm.add_metric([name], snap["warmup_seconds"])
            restarts.add_metric([name], snap["instance_restarts"])
            depth.add_metric([name], model.queue_depth())
            for key, fam in hists.items():
                h = snap[key]
                fam.add_metric(
                    [name],
                    [(str(b) if b != float("inf") else "+Inf", c) for b, c in h["buckets"]],
                    sum_value=h["sum"],
                )
        yield from (req, ok, bad, ready, load, warm, restarts, depth, *hists.values())


def start_metrics_server(port: int, models: Any, addr: str = "127.0.0.1") -> None:
    """Serve Prometheus text on http://addr:port/metrics (prometheus_client's own server thread)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(PrometheusCollector(models))
    start_http_server(port, addr=addr, registry=registry)
