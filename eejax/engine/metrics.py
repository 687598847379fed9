"""The engine's serving metrics in Prometheus format (prometheus_client, one registry per engine; fed
by admission and the step loop, rendered by the HTTP layer on /metrics)."""

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class BatchedHistogram:
    """A Prometheus histogram fed all of a request's values at once: one bucket search over them
    (numpy) where prometheus_client's `Histogram` takes a lock and a search per value (~300 us of
    the engine's thread for a 64-token request's latencies and exit layers). A collector on the
    registry: its buckets are rendered at scrape time, as `Histogram` renders them."""

    def __init__(self, name: str, documentation: str, buckets, registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = np.asarray(buckets, np.float64)
        self.counts = np.zeros(len(self.bounds) + 1, np.int64)  # per bucket (value <= bound), then above all
        self.sum = 0.0
        self._lock = threading.Lock()  # observed by the engine's thread, collected by the HTTP layer's
        registry.register(self)

    def observe(self, values) -> None:
        values = np.asarray(values, np.float64).reshape(-1)
        if not values.size:
            return
        counts = np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=len(self.counts))
        with self._lock:
            self.counts += counts
            for v in values.tolist():  # one at a time, as `Histogram` sums them (the same float)
                self.sum += v

    def collect(self):
        with self._lock:
            cumulative, total = np.cumsum(self.counts).tolist(), self.sum
        bounds = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        yield HistogramMetricFamily(
            self.name, self.documentation, buckets=list(zip(bounds, cumulative)), sum_value=total
        )


class ServeMetrics:
    """Gauges read from the engine at scrape time; histograms and counters fed as requests end."""

    def __init__(self, num_layers: int):
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("eejax_queue_length", "requests waiting for a slot", registry=r)
        self.running = Gauge("eejax_running_rows", "requests decoding", registry=r)
        self.pages_used = Gauge("eejax_kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_total = Gauge("eejax_kv_pages_total", "KV cache pages", registry=r)
        self.programs = Gauge("eejax_compiled_programs", "jitted programs compiled", registry=r)
        self.ttft = BatchedHistogram("eejax_time_to_first_token_seconds", "submit to first token", LATENCY_BUCKETS, r)
        self.itl = BatchedHistogram(
            "eejax_inter_token_latency_seconds", "time between a request's tokens", LATENCY_BUCKETS, r
        )
        self.exit_layer = BatchedHistogram(
            "eejax_exit_layer", "layers run per generated token", tuple(range(1, num_layers + 1)), r
        )
        self.tokens = Counter("eejax_generated_tokens", "tokens generated", registry=r)
        self.requests = Counter("eejax_requests", "requests ended", ["finish_reason"], registry=r)
        self.preemptions = Counter("eejax_preemptions", "rows preempted for pages", registry=r)
        self.prompt_tokens = Counter("eejax_prompt_tokens", "prompt tokens of admitted rows", registry=r)
        self.prefix_hits = Counter(
            "eejax_prefix_cache_hit_tokens",
            "prompt tokens whose KV pages came from the prefix cache (not prefilled)",
            registry=r,
        )
        self.prefill_chunk = BatchedHistogram(
            "eejax_prefill_chunk_tokens",
            "prompt tokens a row prefilled in one program",
            (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
            r,
        )
        self.pages_cached = Gauge(
            "eejax_kv_pages_cached", "KV pages kept by the prefix cache (held or idle)", registry=r
        )
        self.drafted = Counter("eejax_spec_drafted_tokens", "self-speculation drafts", registry=r)
        self.accepted = Counter("eejax_spec_accepted_tokens", "self-speculation drafts accepted", registry=r)
        self.acceptance = Gauge("eejax_spec_acceptance_rate", "accepted / drafted, over all requests", registry=r)
        self.tokens_per_s = Gauge(
            "eejax_tokens_per_second", "tokens generated per second of engine step time", registry=r
        )
        self.drafted_total = self.accepted_total = 0

    def finished(self, seq) -> None:
        """A request ended: its latencies, exit layers and reason."""
        self.requests.labels(seq.finish_reason or "unknown").inc()
        if seq.token_times:
            self.ttft.observe(seq.token_times[0] - seq.submitted_at)
            self.itl.observe(np.diff(seq.token_times))
        self.exit_layer.observe(seq.exit_layers)
        self.tokens.inc(len(seq.tokens))
        self.drafted.inc(seq.drafted)
        self.accepted.inc(seq.accepted)
        self.drafted_total += seq.drafted
        self.accepted_total += seq.accepted

    def render(self, engine_metrics: dict) -> bytes:
        """The Prometheus text exposition, gauges taken from `engine.metrics()`."""
        self.waiting.set(engine_metrics["waiting"])
        self.running.set(engine_metrics["running"])
        self.pages_used.set(engine_metrics["kv_pages_used"])
        self.pages_total.set(engine_metrics["kv_pages_total"])
        self.programs.set(engine_metrics["compiled_programs"])
        self.pages_cached.set(engine_metrics["kv_pages_cached"])
        self.tokens_per_s.set(engine_metrics["generated_tokens"] / max(engine_metrics["step_s"], 1e-9))
        self.acceptance.set(self.accepted_total / self.drafted_total if self.drafted_total else 0.0)
        return generate_latest(self.registry)
