"""Prometheus metrics of the API process (``GET /metrics``): vLLM's ``vllm:NAME`` as
``latentserve_NAME`` (``vllm/v1/metrics/loggers.py``), labelled ``model_name``.
Design notes: docs/internals.md, "latentserve.server.metrics"."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    return tuple(m * 10 ** e for e in range(len(str(max_value))) for m in (1, 2, 5)
                 if m * 10 ** e <= max_value)


class RequestGroup:
    """One prompt's ``n`` engine requests; the last to finish observes the most tokens."""

    def __init__(self, metrics, n: int):
        self.metrics, self.n, self.left, self.most = metrics, n, n, 0

    def finished(self, num_tokens: int) -> None:
        self.most = max(self.most, num_tokens)
        self.left -= 1
        if self.left == 0:
            self.metrics.max_generation_tokens.observe(self.most)
            self.metrics.params_n.observe(self.n)


class RequestTimer:
    """Times one engine request that arrived at ``arrival`` (monotonic seconds; None: now)
    in ``metrics`` (:meth:`MetricsRegistry.for_model`'s); :meth:`finish` counts once."""

    def __init__(self, metrics, arrival: float | None = None,
                 group: RequestGroup | None = None, max_tokens: int | None = None):
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        self.group = group
        self.max_tokens = max_tokens
        self.first: float | None = None
        self.last: float | None = None
        self.queued_at: float | None = None
        self.scheduled_at: float | None = None
        self.num_tokens = 0
        self.done = False

    def scheduled(self, times: tuple[float, float] | None) -> None:
        """``(queued_at, scheduled_at)`` monotonic seconds from the engine, or None."""
        if times is not None:
            self.queued_at, self.scheduled_at = times

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_tokens += n

    def latent(self, steps: int, stats: dict | None) -> None:
        """Count a finished request's ``steps`` latent steps (a compression head's ``stats``
        steps instead); one that thought none (a head's thinking off) is not counted."""
        if stats is not None:
            steps = stats["steps"] if stats.get("thinking") else 0
        if steps > 0:
            self.metrics.latent_steps.inc(steps)
            self.metrics.latent_steps_per_request.observe(steps)

    def finish(self, finish_reason: str | None, num_prompt_tokens: int) -> None:
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        m = self.metrics
        m.e2e.observe(now - self.arrival)
        if self.first is not None and self.num_tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.num_tokens - 1))
        m.prompt_tokens.inc(num_prompt_tokens)
        m.generation_tokens.inc(self.num_tokens)
        m.request_prompt_tokens.observe(num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)
        if self.max_tokens is not None:
            m.params_max_tokens.observe(self.max_tokens)
        if self.scheduled_at is not None:
            end = self.last if self.last is not None else now
            m.queue_time.observe(max(self.scheduled_at - self.queued_at, 0.0))
            m.prefill_time.observe(max((self.first or end) - self.scheduled_at, 0.0))
            m.decode_time.observe(end - self.first if self.first is not None else 0.0)
            m.inference_time.observe(max(end - self.scheduled_at, 0.0))
        m.shared.finished.labels(m.model_name, finish_reason or "unknown").inc()
        if self.group is not None:
            self.group.finished(self.num_tokens)


class MetricsRegistry:
    """The metric families of one ``/metrics`` body, in a registry of their own; token
    histograms' buckets go up to ``max_model_len``."""

    def __init__(self, max_model_len: int):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = reg = CollectorRegistry()
        token_buckets = buckets_1_2_5(max_model_len)
        for attr, (name, doc, buckets) in _HISTOGRAMS.items():
            setattr(self, attr, Histogram(f"latentserve_{name}", doc, ["model_name"],
                                          buckets=buckets or token_buckets, registry=reg))
        for attr, (name, doc) in _COUNTERS.items():
            setattr(self, attr, Counter(f"latentserve_{name}", doc, ["model_name"],
                                        registry=reg))
        self.finished = Counter("latentserve_request_success", "Finished requests by reason",
                                ["model_name", "finished_reason"], registry=reg)
        self.engines: list[tuple[str, Callable[[], dict | None]]] = []
        reg.register(self)  # collect(): the engine families

    def for_model(self, model_name: str, get_stats: Callable[[], dict | None]):
        """One served model's children of these families (``shared``: this registry);
        ``get_stats()``: its latest engine stats."""
        self.engines.append((model_name, get_stats))
        return SimpleNamespace(shared=self, model_name=model_name, **{
            name: getattr(self, name).labels(model_name) for name in (*_HISTOGRAMS, *_COUNTERS)})

    def collect(self):
        """``_ENGINE_FAMILIES`` from each model's latest ``LLMEngine.stats()``."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rows = [(name, stats) for name, get in self.engines if (stats := get())]
        for kind, name, doc, value in _ENGINE_FAMILIES if rows else ():
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = cls(f"latentserve_{name}", doc, labels=["model_name"])
            for model_name, stats in rows:
                family.add_metric([model_name], value(stats) if callable(value) else stats[value])
            yield family


# Attribute -> (name after "latentserve_", help, buckets; None: 1-2-5 up to max_model_len).
_HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Time to first token, seconds", _LATENCY_BUCKETS),
    "itl": ("inter_token_latency_seconds", "Time between consecutive output tokens, seconds",
            _LATENCY_BUCKETS),
    "tpot": ("time_per_output_token_seconds",
             "Mean time per output token after the first, per request, seconds",
             _LATENCY_BUCKETS),
    "e2e": ("e2e_request_latency_seconds", "End-to-end request latency, seconds", _E2E_BUCKETS),
    "queue_time": ("request_queue_time_seconds",
                   "Time waiting in the engine before first scheduled, seconds", _E2E_BUCKETS),
    "prefill_time": ("request_prefill_time_seconds",
                     "Time from first scheduled to the first token, seconds", _E2E_BUCKETS),
    "decode_time": ("request_decode_time_seconds",
                    "Time from the first to the last token, seconds", _E2E_BUCKETS),
    "inference_time": ("request_inference_time_seconds",
                       "Time from first scheduled to the last token, seconds", _E2E_BUCKETS),
    "request_prompt_tokens": ("request_prompt_tokens", "Prompt tokens per request", None),
    "request_generation_tokens": ("request_generation_tokens", "Generated tokens per request",
                                  None),
    "max_generation_tokens": ("request_max_num_generation_tokens",
                              "Most tokens generated by one of a prompt's n choices", None),
    "params_n": ("request_params_n", "The n request parameter", (1, 2, 5, 10, 20)),  # vLLM's
    "params_max_tokens": ("request_params_max_tokens",
                          "The max_tokens request parameter (when set)", None),
    "latent_steps_per_request": ("latent_steps_per_request",
                                 "Latent steps per request that ran some",
                                 (1, 2, 4, 8, 16, 32, 64, 128, 256)),
}
_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens received"),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
    "latent_steps": ("latent_steps", "Latent steps run (feedback, looped-block and "
                     "compression-head requests)"),
}


# Engine samples of ``LLMEngine.stats()``: (family kind, name after "latentserve_", help,
# one model's stats key or a function of its stats).
_ENGINE_FAMILIES = (
    ("gauge", "num_requests_running", "Requests admitted in the engine", "num_running"),
    ("gauge", "num_requests_waiting", "Requests queued in the engine", "num_waiting"),
    ("gauge", "kv_slots_total", "KV pool size, tokens", "kv_slots_total"),
    ("gauge", "kv_slots_free", "Free KV slots", "kv_slots_free"),
    ("gauge", "kv_slots_cached", "KV slots held by the prefix cache", "kv_slots_cached"),
    ("gauge", "kv_cache_usage_perc", "Fraction of KV slots neither free nor evictable",
     lambda s: (s["kv_slots_total"] - s["kv_slots_free"] - s["kv_slots_evictable"])
     / (s["kv_slots_total"] or 1)),
    ("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
     "prefix_cache_queries"),
    ("counter", "prefix_cache_hits", "Prompt tokens served by the prefix cache",
     "prefix_cache_hits"),
    ("gauge", "prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since start-up",
     lambda s: s["prefix_cache_hits"] / s["prefix_cache_queries"]
     if s["prefix_cache_queries"] else 0.0),
    ("counter", "num_preemptions", "Requests preempted", "num_preemptions"),
)
