"""``GET /metrics``: Prometheus text, every name prefixed ``zipmoe_``.

Counted by the server as it goes (:class:`Metrics`): HTTP requests by route and status
(``zipmoe_requests_total``), finished generations by reason (``zipmoe_generations_total``:
``stop``, ``length``, ``cancelled``, ``error``), prompt and generated tokens, time to first
token and time per output token (histograms, per request), the sizes of the batches stepped
and prefilled (``zipmoe_step_batch_size``: every decode step the engine ran, a lone request's
steps on the decode loop as batch 1) and requests by the path they
took (``zipmoe_requests_by_path_total{path}``: ``loop``, ``batch``, ``moved``). Read from
the runtime at each scrape (:class:`RuntimeCollector`): requests running and waiting, whether
the model is loaded, expert-cache hits per pool (``full``, ``compressed``, ``sm_only``,
``e_only``, and ``none`` for misses) from ``model.zipmoe.counters``, bytes read from the
container, the budget and the bytes held (now and at peak), and each cache pool's capacity and
use.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PATHS = ("loop", "batch", "moved")


class Metrics:
    def __init__(self, server) -> None:
        disable_created_metrics()  # no *_created series: they double the output and nothing here reads them
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("zipmoe_requests", "HTTP requests by route and status code.", ["route", "status"],
                                registry=r)
        self.generations = Counter("zipmoe_generations", "Finished generations by finish reason.", ["reason"],
                                   registry=r)
        self.prompt_tokens = Counter("zipmoe_prompt_tokens", "Prompt tokens of finished generations.", registry=r)
        self.generated_tokens = Counter("zipmoe_generated_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("zipmoe_time_to_first_token_seconds",
                              "From a request's arrival to its first token (queueing and prefill).",
                              buckets=_TIME_BUCKETS, registry=r)
        self.tpot = Histogram("zipmoe_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.step_batch = Histogram("zipmoe_step_batch_size", "Rows in each decode step.", buckets=_BATCH_BUCKETS,
                                    registry=r)
        self.step_seconds = Histogram("zipmoe_step_seconds", "Wall time of each decode step.",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.prefill_batch = Histogram("zipmoe_prefill_batch_size", "Prompts in each prefill.",
                                       buckets=_BATCH_BUCKETS, registry=r)
        self.prefill_tokens = Counter("zipmoe_prefill_tokens", "Prompt tokens prefilled.", registry=r)
        self.paths = Counter("zipmoe_requests_by_path", "Requests by the path they took: loop (alone, on the "
                             "decode loop), batch (prefilled with others, the batched forward), moved "
                             "(a lone request that left the loop when others joined it).", ["path"], registry=r)
        for kind in PATHS:  # every path shows, at 0 until taken
            self.paths.labels(kind)
        r.register(RuntimeCollector(server))

    # called by the engine, on the model thread
    def prefill(self, rows: int, tokens: int, seconds: float) -> None:
        self.prefill_batch.observe(rows)
        self.prefill_tokens.inc(tokens)

    def step(self, rows: int, seconds: float) -> None:
        self.step_batch.observe(rows)
        self.step_seconds.observe(seconds)

    def path(self, kind: str) -> None:
        """One request took path ``kind`` (``loop``, ``batch``, or ``moved``: a lone request whose
        decode-loop row went on in a batch, its cache copied into a ``DynamicCache``)."""
        self.paths.labels(str(kind)).inc()

    def finished(self, req) -> None:
        reason = "error" if req.error is not None else (req.finish_reason or "error")
        self.generations.labels(reason).inc()
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.generated_tokens.inc(len(req.token_ids))
        if req.ttft_s is not None:
            self.ttft.observe(req.ttft_s)
        if req.tpot_s is not None:
            self.tpot.observe(req.tpot_s)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RuntimeCollector:
    """Figures read from the engine and the runtime at scrape time."""

    def __init__(self, server) -> None:
        self.server = server

    def describe(self):
        return []

    def collect(self):
        s = self.server
        engine = s.engine
        yield _gauge("zipmoe_model_loaded", "1 once the model is loaded and serving.", 1 if s.ready else 0)
        yield _gauge("zipmoe_requests_running", "Requests in the running batch.", engine.running if engine else 0)
        yield _gauge("zipmoe_requests_waiting", "Requests queued for a slot.", engine.waiting if engine else 0)
        yield _gauge("zipmoe_max_batch", "Largest batch (--max-batch).", engine.max_batch if engine else 0)
        rt = getattr(s.model, "zipmoe", None) if s.model is not None else None
        if rt is None:
            return
        c = rt.counters.snapshot()
        hits = CounterMetricFamily("zipmoe_expert_cache_hits", "Expert-tensor accesses by the pool that held the "
                                   "tensor (none: a miss, read whole from the container).", labels=["pool"])
        for pool, n in c["hits"].items():
            hits.add_metric([pool], n)
        yield hits
        yield CounterMetricFamily("zipmoe_bytes_read", "Bytes of chunks read from the container.",
                                  value=c["bytes_read"])
        yield CounterMetricFamily("zipmoe_bytes_read_disk", "Bytes transferred by the container reads "
                                  "(aligned for O_DIRECT).", value=c["bytes_read_disk"])
        yield CounterMetricFamily("zipmoe_reads", "Read calls on the container.", value=c["reads"])
        yield CounterMetricFamily("zipmoe_expert_calls", "Experts computed.", value=c["expert_calls"])
        stage = CounterMetricFamily("zipmoe_stage_seconds", "Seconds spent per serving stage.", labels=["stage"])
        for k, v in c["time_s"].items():
            stage.add_metric([k], v)
        yield stage
        yield _gauge("zipmoe_budget_bytes", "The memory budget for weights (--budget).", rt.budget)
        yield _gauge("zipmoe_held_bytes", "Weight bytes held now: dense, cache pools, in flight.", rt.held_bytes())
        yield _gauge("zipmoe_peak_held_bytes", "The most weight bytes held at once since load.",
                     c["peak_held_bytes"])
        mem = rt.memory() if hasattr(rt, "memory") else {}
        if "device_allocated" in mem:
            yield _gauge("zipmoe_device_allocated_bytes", "GPU bytes torch's caching allocator has handed out "
                         "(every tensor: weights, KV cache, activations).", mem["device_allocated"])
            yield _gauge("zipmoe_device_reserved_bytes", "GPU bytes torch's caching allocator holds.", mem["device_reserved"])
        if mem.get("staging_ring_bytes"):
            yield _gauge("zipmoe_staging_ring_bytes", "Pinned host staging ring for copies to the device.",
                         mem["staging_ring_bytes"])
        pools = GaugeMetricFamily("zipmoe_cache_pool_bytes", "Cache pool capacity and use.", labels=["pool", "kind"])
        for name, p in rt.cache.summary().items():
            pools.add_metric([name, "capacity"], p["capacity"])
            pools.add_metric([name, "used"], p["used"])
        yield pools


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
