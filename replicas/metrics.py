"""Prometheus metrics of one replica server, in its own registry (several servers per process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Latency buckets in seconds: sub-millisecond decode steps up to long prefills.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TPOT_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)

# Values of the `outcome` label of monoserve_replica_requests_total.
OUTCOMES = ("stop", "length", "cancelled", "aborted", "deadline", "invalid", "rejected", "unavailable", "error")


class ReplicaMetrics:
    """Counters, histograms and gauges the replica server updates; `serve(port)` exposes them."""

    def __init__(self, replica_id: str, capacity: int, session_stats: Callable[[], object] | None = None,
                 engine: object | None = None):
        """engine: read at scrape for the batched monokernel's launch counters (`launches`, `resident_joins`)
        and a resident engine's join GEMM mode, where it has them."""
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"replica": replica_id}
        r = self.registry
        self.requests = Counter(
            "monoserve_replica_requests", "Generate calls by outcome (stop, length, cancelled by the "
            "client, aborted via Abort, deadline, invalid, rejected = no free slot, unavailable = "
            "draining, error = engine failure).", ["outcome"], registry=r).labels
        self.ttft = Histogram("monoserve_replica_ttft_seconds", "Time from request to first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("monoserve_replica_tpot_seconds", "Time between consecutive output tokens.",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.tokens = Counter("monoserve_replica_generated_tokens", "Output tokens streamed.", registry=r)
        self.active_slots = Gauge("monoserve_replica_active_slots", "Generations running now.", registry=r)
        self.capacity = Gauge("monoserve_replica_capacity", "Generation slots (engine max_batch).", registry=r)
        self.aborts = Counter("monoserve_replica_aborts", "Abort RPCs that found their request.", registry=r)
        self.draining = Gauge("monoserve_replica_draining", "1 while the replica refuses new requests.",
                              registry=r)
        info = Gauge("monoserve_replica_info", "Constant 1, labelled with the replica id.", ["replica"], registry=r)
        info.labels(**labels).set(1)
        self.capacity.set(capacity)
        for outcome in OUTCOMES:  # export zeros so rates work from the start
            self.requests(outcome)
        if session_stats is not None:
            r.register(_SessionCollector(session_stats))
        if engine is not None and hasattr(engine, "launches"):
            r.register(_LaunchCollector(engine))
        self._http = None

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Expose /metrics on host:port (0 = any free port); returns the bound port."""
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _SessionCollector(Collector):
    """The engine's session KV reuse counters (replicas.session_cache.SessionStats), read at scrape."""

    def __init__(self, stats: Callable[[], object]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        for name, doc, value in (
            ("hits", "Requests with a session_id that reused KV kept from an earlier turn.", s.hits),
            ("misses", "Requests with a session_id that prefilled the whole prompt.", s.misses),
            ("evictions", "Stored sessions dropped to stay within the session cache bounds.", s.evictions),
            ("reused_tokens", "Prompt tokens not prefilled thanks to session KV reuse.", s.reused_tokens),
        ):
            yield CounterMetricFamily(f"monoserve_replica_session_{name}", doc, value=value)
        yield GaugeMetricFamily("monoserve_replica_sessions", "Sessions whose KV is resident now.", value=s.sessions)
        yield GaugeMetricFamily("monoserve_replica_session_bytes", "Bytes of resident session KV.", value=s.bytes)


class _LaunchCollector(Collector):
    """The batched monokernel's kernel launches and resident joins (a join that needs no launch is the
    resident kernel's point: launches growing with requests means joins are not happening), and the GEMM mode
    its joins' prefill runs in (replicas/monokernel_resident.Joiner.warm; "off" when none runs beside a launch)."""

    def __init__(self, engine):
        self._engine = engine

    def collect(self):
        e = self._engine
        yield CounterMetricFamily("monoserve_replica_kernel_launches", "Monokernel launches (batched engine).",
                                  value=e.launches)
        yield CounterMetricFamily("monoserve_replica_resident_joins", "Requests admitted into a running "
                                  "resident launch, without a relaunch.", value=getattr(e, "resident_joins", 0))
        yield CounterMetricFamily("monoserve_replica_stalled_joins", "Joins that waited for the running launch "
                                  "past JOIN_STALL_S (a first kernel load): the launch was asked to yield for them.",
                                  value=getattr(e, "stalled_joins", 0))
        if getattr(e, "resident", False):
            joiner = getattr(e, "_joiner", None)
            mode = GaugeMetricFamily("monoserve_replica_join_mode", "Constant 1, labelled with the GEMM mode of "
                                     "the resident joins' prefill (tensor, mma, fp32; off: joins relaunch).",
                                     labels=["mode"])
            mode.add_metric([joiner.mode if joiner is not None and joiner.mode else "off"], 1)
            yield mode
