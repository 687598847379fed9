"""The serving metrics (`engine/metrics.py`): a request's latencies and exit layers are observed
at once, and render as prometheus_client's own histogram renders the same values one by one."""

import types

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from eejax.engine.metrics import LATENCY_BUCKETS, BatchedHistogram, ServeMetrics


def test_a_batched_histogram_renders_as_prometheus_clients_histogram():
    values = [0.005, 0.0049, 0.3, 61.0, 0.01, 1e-9, 2.5, 0.3]  # on a bound, under, above every bound
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("latency_seconds", "doc", registry=theirs, buckets=LATENCY_BUCKETS)
    for v in values:
        histogram.observe(v)
    batched = BatchedHistogram("latency_seconds", "doc", LATENCY_BUCKETS, ours)
    batched.observe(values[:3])
    batched.observe(values[3])
    batched.observe(values[4:])
    batched.observe([])
    want = [line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == want


def test_a_finished_request_feeds_its_latencies_and_exit_layers():
    metrics = ServeMetrics(num_layers=4)
    seq = types.SimpleNamespace(
        finish_reason="length",
        token_times=[1.0, 1.02, 1.5],
        submitted_at=0.9,
        exit_layers=[4, 2, 4],
        tokens=[5, 6, 7],
        drafted=0,
        accepted=0,
    )
    metrics.finished(seq)
    text = generate_latest(metrics.registry).decode()
    assert 'eejax_inter_token_latency_seconds_bucket{le="0.025"} 1.0' in text
    assert 'eejax_inter_token_latency_seconds_bucket{le="0.5"} 2.0' in text
    assert 'eejax_exit_layer_bucket{le="2.0"} 1.0' in text and "eejax_exit_layer_count 3.0" in text
    assert "eejax_time_to_first_token_seconds_count 1.0" in text and "eejax_generated_tokens_total 3.0" in text
