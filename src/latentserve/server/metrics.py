"""Prometheus metrics of the API process (``GET /metrics``), in vLLM's spirit.

Latencies are measured in the API process, per engine request (each of a request's ``n``
choices), from the moment the HTTP handler started (seconds, ``time.monotonic``):

* ``latentserve_time_to_first_token_seconds``: to the first generated token's arrival;
* ``latentserve_inter_token_latency_seconds``: between consecutive token arrivals;
* ``latentserve_time_per_output_token_seconds``: per request, (last - first arrival) /
  (tokens - 1), for requests with at least two tokens;
* ``latentserve_e2e_request_latency_seconds``: to the final output.

Counters: ``latentserve_prompt_tokens_total``, ``latentserve_generation_tokens_total``,
``latentserve_request_success_total{finish_reason}``; compression heads:
``latentserve_latent_steps_total`` and the histogram ``latentserve_latent_steps_per_request``.
Engine state, read from
``LLMEngine.stats()`` at scrape time: ``latentserve_num_requests_running`` / ``_waiting``,
``latentserve_kv_slots_{total,free,cached}``, ``latentserve_kv_cache_usage_perc`` (slots not
free and not evictable, over the total), ``latentserve_prefix_cache_{queries,hits}_total``
(prompt tokens), ``latentserve_prefix_cache_hit_rate`` and ``latentserve_num_preemptions_total``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class RequestTimer:
    """Times one engine request; :meth:`tokens` on every output carrying tokens,
    :meth:`finish` once at the end (later calls are ignored)."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0
        self.done = False

    def tokens(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_tokens += n

    def latent(self, stats: dict) -> None:
        """A compression-head request's final ``latent_stats``: its latent steps go to
        ``latentserve_latent_steps_total`` and ``latentserve_latent_steps_per_request``
        (thinking-on requests only)."""
        if stats.get("thinking"):
            self.metrics.latent_steps.inc(stats["steps"])
            self.metrics.latent_steps_per_request.observe(stats["steps"])

    def finish(self, finish_reason: str | None, num_prompt_tokens: int,
               now: float | None = None) -> None:
        if self.done:
            return
        self.done = True
        now = time.monotonic() if now is None else now
        m = self.metrics
        m.e2e.observe(now - self.arrival)
        if self.first is not None and self.num_tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.num_tokens - 1))
        m.prompt_tokens.inc(num_prompt_tokens)
        m.generation_tokens.inc(self.num_tokens)
        m.finished.labels(finish_reason=finish_reason or "unknown").inc()


class ServerMetrics:
    """The API process's metrics, in their own registry (several apps may live in one
    process, e.g. in tests). ``get_stats()`` returns the latest engine stats dict or None;
    :meth:`render` is the ``/metrics`` body (Prometheus text format)."""

    def __init__(self, model_name: str, get_stats: Callable[[], dict | None]):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        reg = self.registry

        def hist(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=reg).labels(model_name)

        self.ttft = hist("latentserve_time_to_first_token_seconds",
                         "Time to first token, seconds", _LATENCY_BUCKETS)
        self.itl = hist("latentserve_inter_token_latency_seconds",
                        "Time between consecutive output tokens, seconds", _LATENCY_BUCKETS)
        self.tpot = hist("latentserve_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request, seconds",
                         _LATENCY_BUCKETS)
        self.e2e = hist("latentserve_e2e_request_latency_seconds",
                        "End-to-end request latency, seconds", _E2E_BUCKETS)
        self.prompt_tokens = Counter("latentserve_prompt_tokens", "Prompt tokens received",
                                     ["model_name"], registry=reg).labels(model_name)
        self.generation_tokens = Counter("latentserve_generation_tokens",
                                         "Tokens generated", ["model_name"],
                                         registry=reg).labels(model_name)
        self.latent_steps = Counter("latentserve_latent_steps",
                                    "Latent steps run by compression-head requests",
                                    ["model_name"], registry=reg).labels(model_name)
        self.latent_steps_per_request = hist(
            "latentserve_latent_steps_per_request",
            "Latent steps per compression-head request (thinking on)",
            (1, 2, 4, 8, 16, 32, 64, 128, 256))
        finished = Counter("latentserve_request_success", "Finished requests by reason",
                           ["model_name", "finish_reason"], registry=reg)

        class _Finished:
            @staticmethod
            def labels(finish_reason: str):
                return finished.labels(model_name, finish_reason)

        self.finished = _Finished
        reg.register(_EngineCollector(model_name, get_stats))

    def timer(self, arrival: float | None = None) -> RequestTimer:
        """A timer for one engine request that arrived at ``arrival`` (monotonic s)."""
        return RequestTimer(self, time.monotonic() if arrival is None else arrival)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _EngineCollector:
    """Engine gauges and counters from the latest ``LLMEngine.stats()``."""

    def __init__(self, model_name: str, get_stats: Callable[[], dict | None]):
        self.model_name = model_name
        self.get_stats = get_stats

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.get_stats()
        if not stats:
            return
        label = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        total = stats["kv_slots_total"] or 1
        busy = stats["kv_slots_total"] - stats["kv_slots_free"] - stats["kv_slots_evictable"]
        queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
        yield gauge("latentserve_num_requests_running", "Requests admitted in the engine",
                    stats["num_running"])
        yield gauge("latentserve_num_requests_waiting", "Requests queued in the engine",
                    stats["num_waiting"])
        yield gauge("latentserve_kv_slots_total", "KV pool size, tokens",
                    stats["kv_slots_total"])
        yield gauge("latentserve_kv_slots_free", "Free KV slots", stats["kv_slots_free"])
        yield gauge("latentserve_kv_slots_cached", "KV slots held by the prefix cache",
                    stats["kv_slots_cached"])
        yield gauge("latentserve_kv_cache_usage_perc",
                    "Fraction of KV slots neither free nor evictable", busy / total)
        yield counter("latentserve_prefix_cache_queries",
                      "Prompt tokens looked up in the prefix cache", queries)
        yield counter("latentserve_prefix_cache_hits",
                      "Prompt tokens served by the prefix cache", hits)
        yield gauge("latentserve_prefix_cache_hit_rate",
                    "prefix_cache_hits / prefix_cache_queries since start-up",
                    hits / queries if queries else 0.0)
        yield counter("latentserve_num_preemptions", "Requests preempted",
                      stats["num_preemptions"])
