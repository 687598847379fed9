"""The engine's serving metrics in Prometheus format (prometheus_client, one registry per engine; fed
by admission and the step loop, rendered by the HTTP layer on /metrics)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    """Gauges read from the engine at scrape time; histograms and counters fed as requests end."""

    def __init__(self, num_layers: int):
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("eejax_queue_length", "requests waiting for a slot", registry=r)
        self.running = Gauge("eejax_running_rows", "requests decoding", registry=r)
        self.pages_used = Gauge("eejax_kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_total = Gauge("eejax_kv_pages_total", "KV cache pages", registry=r)
        self.programs = Gauge("eejax_compiled_programs", "jitted programs compiled", registry=r)
        self.ttft = Histogram(
            "eejax_time_to_first_token_seconds", "submit to first token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "eejax_inter_token_latency_seconds", "time between a request's tokens", registry=r, buckets=LATENCY_BUCKETS
        )
        self.exit_layer = Histogram(
            "eejax_exit_layer", "layers run per generated token", registry=r, buckets=tuple(range(1, num_layers + 1))
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
        self.prefill_chunk = Histogram(
            "eejax_prefill_chunk_tokens",
            "prompt tokens a row prefilled in one program",
            registry=r,
            buckets=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
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
            for a, b in zip(seq.token_times, seq.token_times[1:]):
                self.itl.observe(b - a)
        for layer in seq.exit_layers:
            self.exit_layer.observe(layer)
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
