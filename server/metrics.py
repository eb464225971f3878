"""/metrics in Prometheus' text format (prometheus-client): the engine core's counters as they stand, and latency
histograms the front end observes per request. Names follow vLLM's (`engine:` prefix)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 2.0)


class CoreCollector:
    """Reads the engine client's latest CoreStats at each scrape."""

    def __init__(self, engine_of):
        self.engine_of = engine_of

    def collect(self):
        e = self.engine_of()
        if e is None:
            return
        st = e.stats
        for name, text, value in [
            ("requests", "requests the engine core accepted", st.requests_total),
            ("requests_finished", "requests finished, any reason", st.requests_finished),
            ("requests_failed", "requests finished with an error", st.requests_failed),
            ("prompt_tokens", "prompt tokens put in the KV cache", st.prompt_tokens_total),
            ("prompt_tokens_shared", "prompt tokens copied from a running sequence with the same prompt",
             st.prompt_tokens_shared),
            ("prompt_tokens_cached", "prompt tokens found by prefix caching instead of prefilled",
             st.prompt_tokens_cached),
            ("prefix_cache_hits", "requests that reused a cached prompt prefix", st.prefix_cache_hits),
            ("num_preemptions", "sequences preempted for KV blocks and recomputed", st.preemptions),
            ("generation_tokens", "tokens generated", st.generated_tokens_total),
            ("steps", "scheduler steps (forward passes)", st.steps),
            ("prefill_steps", "steps that carried prompt chunks", st.prefill_steps),
            ("decode_step_seconds", "wall time of the steps with decode rows only", st.decode_step_seconds),
            ("prefill_step_seconds", "wall time of the steps with prompt chunks", st.prefill_step_seconds),
        ]:
            c = CounterMetricFamily(f"engine:{name}", text)
            c.add_metric([], value)
            yield c
        for name, text, value in [
            ("num_requests_running", "sequences prefilling or decoding", st.running),
            ("num_requests_waiting", "sequences waiting for a KV slot", st.waiting),
            ("kv_slots_free", "sequence slots free", st.kv_slots_free),
            ("kv_cache_usage_perc", "fraction of the KV blocks sequences hold (1: full)",
             st.kv_blocks_held / st.kv_blocks if st.kv_blocks else 0.0),
            ("generation_tokens_per_second", "decode rows per second of the recent steps", st.tokens_per_second),
            ("core_up", "1 while the engine core is loaded and answering", int(e.ready is not None and e.error is None)),
        ]:
            g = GaugeMetricFamily(f"engine:{name}", text)
            g.add_metric([], value)
            yield g


class ServerMetrics:
    def __init__(self, engine_of):
        self.registry = CollectorRegistry()
        self.registry.register(CoreCollector(engine_of))
        self.ttft = Histogram("engine:time_to_first_token_seconds", "request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.token_gap = Histogram("engine:inter_token_latency_seconds", "time between a request's tokens",
                                   buckets=TOKEN_GAP_BUCKETS, registry=self.registry)
        self.e2e = Histogram("engine:e2e_request_latency_seconds", "request arrival to its last byte",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("engine:request_queue_time_seconds", "time a request waited in the engine core for "
                               "a KV slot", buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe(self, ttft: float | None, token_gaps: list[float], e2e: float, queued: float | None = None) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if queued is not None:
            self.queue.observe(queued)
        for g in token_gaps:
            self.token_gap.observe(g)
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
