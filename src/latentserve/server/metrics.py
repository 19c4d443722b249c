"""Prometheus metrics of the API process (``GET /metrics``), with vLLM's names and labels
under our prefix: ``vllm:NAME`` is ``latentserve_NAME`` (``vllm/v1/metrics/loggers.py``;
the rule that turns a vLLM Grafana dashboard into ours), every sample labelled
``model_name`` (the first served name).

Design notes: docs/internals.md, "latentserve.server.metrics".
"""

from __future__ import annotations

import time
from collections.abc import Callable

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n buckets
DEFAULT_MAX_TOKENS_BUCKET = 1 << 20  # token histograms' last finite bucket without a model


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class RequestGroup:
    """The ``n`` engine requests of one prompt of a client request: when the last one
    finishes, the most tokens any of them generated goes to
    ``latentserve_request_max_num_generation_tokens`` and ``n`` to
    ``latentserve_request_params_n``."""

    def __init__(self, metrics: ServerMetrics, n: int):
        self.metrics = metrics
        self.n = n
        self.left = n
        self.most = 0

    def finished(self, num_tokens: int) -> None:
        self.most = max(self.most, num_tokens)
        self.left -= 1
        if self.left == 0:
            self.metrics.max_generation_tokens.observe(self.most)
            self.metrics.params_n.observe(self.n)


class RequestTimer:
    """Times one engine request; :meth:`tokens` on every output carrying tokens,
    :meth:`scheduled` once the engine's queue and schedule times are known,
    :meth:`finish` once at the end (later calls are ignored). ``max_tokens``: the
    request's ``max_tokens`` as the client set it (None: unset)."""

    def __init__(self, metrics: ServerMetrics, arrival: float,
                 group: RequestGroup | None = None, max_tokens: int | None = None):
        self.metrics = metrics
        self.arrival = arrival
        self.group = group
        self.max_tokens = max_tokens
        self.first: float | None = None
        self.last: float | None = None
        self.queued_at: float | None = None
        self.scheduled_at: float | None = None
        self.num_tokens = 0
        self.done = False

    def scheduled(self, times: tuple[float, float] | None) -> None:
        """``(queued_at, scheduled_at)`` from the engine process (monotonic seconds), or
        None while unknown."""
        if times is not None:
            self.queued_at, self.scheduled_at = times

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
        m.finished.labels(finished_reason=finish_reason or "unknown").inc()
        if self.group is not None:
            self.group.finished(self.num_tokens)


class MetricsRegistry:
    """The metric families of one ``/metrics`` body, shared by every model a server serves
    (each sample carries its ``model_name`` label); :meth:`model` gives one model's
    :class:`ServerMetrics`. Its own registry: several apps may live in one process (tests).
    ``max_model_len``: the token histograms' buckets go up to it (1-2-5 steps, as vLLM's).
    """

    def __init__(self, max_model_len: int | None = None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        reg = self.registry
        token_buckets = buckets_1_2_5(max_model_len or DEFAULT_MAX_TOKENS_BUCKET)

        def hist(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=reg)

        def counter(name, doc, labels=("model_name",)):
            return Counter(name, doc, list(labels), registry=reg)

        self.ttft = hist("latentserve_time_to_first_token_seconds",
                         "Time to first token, seconds", _LATENCY_BUCKETS)
        self.itl = hist("latentserve_inter_token_latency_seconds",
                        "Time between consecutive output tokens, seconds", _LATENCY_BUCKETS)
        self.tpot = hist("latentserve_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request, seconds",
                         _LATENCY_BUCKETS)
        self.e2e = hist("latentserve_e2e_request_latency_seconds",
                        "End-to-end request latency, seconds", _E2E_BUCKETS)
        self.queue_time = hist("latentserve_request_queue_time_seconds",
                               "Time waiting in the engine before first scheduled, seconds",
                               _E2E_BUCKETS)
        self.prefill_time = hist("latentserve_request_prefill_time_seconds",
                                 "Time from first scheduled to the first token, seconds",
                                 _E2E_BUCKETS)
        self.decode_time = hist("latentserve_request_decode_time_seconds",
                                "Time from the first to the last token, seconds",
                                _E2E_BUCKETS)
        self.inference_time = hist("latentserve_request_inference_time_seconds",
                                   "Time from first scheduled to the last token, seconds",
                                   _E2E_BUCKETS)
        self.request_prompt_tokens = hist("latentserve_request_prompt_tokens",
                                          "Prompt tokens per request", token_buckets)
        self.request_generation_tokens = hist("latentserve_request_generation_tokens",
                                              "Generated tokens per request", token_buckets)
        self.max_generation_tokens = hist(
            "latentserve_request_max_num_generation_tokens",
            "Most tokens generated by one of a prompt's n choices", token_buckets)
        self.params_n = hist("latentserve_request_params_n", "The n request parameter",
                             _N_BUCKETS)
        self.params_max_tokens = hist("latentserve_request_params_max_tokens",
                                      "The max_tokens request parameter (when set)",
                                      token_buckets)
        self.prompt_tokens = counter("latentserve_prompt_tokens", "Prompt tokens received")
        self.generation_tokens = counter("latentserve_generation_tokens", "Tokens generated")
        self.latent_steps = counter("latentserve_latent_steps",
                                    "Latent steps run by compression-head requests")
        self.latent_steps_per_request = hist(
            "latentserve_latent_steps_per_request",
            "Latent steps per compression-head request (thinking on)",
            (1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.finished = counter("latentserve_request_success", "Finished requests by reason",
                                ("model_name", "finished_reason"))
        self.engines: list[tuple[str, Callable[[], dict | None]]] = []
        reg.register(_EngineCollector(self.engines))

    def model(self, model_name: str, get_stats: Callable[[], dict | None]) -> ServerMetrics:
        """The metrics of one served model, whose latest engine stats ``get_stats()``
        returns (None: none yet)."""
        return ServerMetrics(model_name, get_stats, registry=self)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ServerMetrics attributes that are one model's child of a MetricsRegistry family.
_PER_MODEL = ("ttft", "itl", "tpot", "e2e", "queue_time", "prefill_time", "decode_time",
              "inference_time", "request_prompt_tokens", "request_generation_tokens",
              "max_generation_tokens", "params_n", "params_max_tokens", "prompt_tokens",
              "generation_tokens", "latent_steps", "latent_steps_per_request")


class ServerMetrics:
    """One served model's metrics: its labelled children of a :class:`MetricsRegistry`'s
    families (a registry of its own when ``registry`` is None). ``get_stats()`` returns the
    latest engine stats dict or None; :meth:`render` is the ``/metrics`` body (Prometheus
    text format, every model of the registry)."""

    def __init__(self, model_name: str, get_stats: Callable[[], dict | None],
                 registry: MetricsRegistry | None = None):
        shared = MetricsRegistry() if registry is None else registry
        self.shared = shared
        self.registry = shared.registry
        self.model_name = model_name
        for name in _PER_MODEL:
            setattr(self, name, getattr(shared, name).labels(model_name))
        finished = shared.finished

        class _Finished:
            @staticmethod
            def labels(finished_reason: str):
                return finished.labels(model_name, finished_reason)

        self.finished = _Finished
        shared.engines.append((model_name, get_stats))

    def timer(self, arrival: float | None = None, group: RequestGroup | None = None,
              max_tokens: int | None = None) -> RequestTimer:
        """A timer for one engine request that arrived at ``arrival`` (monotonic s), one
        of ``group``'s, whose client set ``max_tokens`` (None: unset)."""
        return RequestTimer(self, time.monotonic() if arrival is None else arrival, group,
                            max_tokens)

    def group(self, n: int) -> RequestGroup:
        """The group of one prompt's ``n`` engine requests."""
        return RequestGroup(self, n)

    def render(self) -> bytes:
        return self.shared.render()


class _EngineCollector:
    """Engine gauges and counters from each model's latest ``LLMEngine.stats()`` (one
    sample per model that has stats)."""

    def __init__(self, engines: list[tuple[str, Callable[[], dict | None]]]):
        self.engines = engines

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rows = [(name, stats) for name, get in self.engines if (stats := get())]
        if not rows:
            return

        def family(kind, name, doc, value):
            f = kind(name, doc, labels=["model_name"])
            for model_name, stats in rows:
                f.add_metric([model_name], value(stats))
            return f

        def gauge(name, doc, value):
            return family(GaugeMetricFamily, name, doc, value)

        def counter(name, doc, value):
            return family(CounterMetricFamily, name, doc, value)

        def usage(stats):
            total = stats["kv_slots_total"] or 1
            busy = (stats["kv_slots_total"] - stats["kv_slots_free"]
                    - stats["kv_slots_evictable"])
            return busy / total

        def hit_rate(stats):
            queries = stats["prefix_cache_queries"]
            return stats["prefix_cache_hits"] / queries if queries else 0.0

        yield gauge("latentserve_num_requests_running", "Requests admitted in the engine",
                    lambda s: s["num_running"])
        yield gauge("latentserve_num_requests_waiting", "Requests queued in the engine",
                    lambda s: s["num_waiting"])
        yield gauge("latentserve_kv_slots_total", "KV pool size, tokens",
                    lambda s: s["kv_slots_total"])
        yield gauge("latentserve_kv_slots_free", "Free KV slots", lambda s: s["kv_slots_free"])
        yield gauge("latentserve_kv_slots_cached", "KV slots held by the prefix cache",
                    lambda s: s["kv_slots_cached"])
        yield gauge("latentserve_kv_cache_usage_perc",
                    "Fraction of KV slots neither free nor evictable", usage)
        yield counter("latentserve_prefix_cache_queries",
                      "Prompt tokens looked up in the prefix cache",
                      lambda s: s["prefix_cache_queries"])
        yield counter("latentserve_prefix_cache_hits",
                      "Prompt tokens served by the prefix cache",
                      lambda s: s["prefix_cache_hits"])
        yield gauge("latentserve_prefix_cache_hit_rate",
                    "prefix_cache_hits / prefix_cache_queries since start-up", hit_rate)
        yield counter("latentserve_num_preemptions", "Requests preempted",
                      lambda s: s["num_preemptions"])
