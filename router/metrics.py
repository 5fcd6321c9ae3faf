"""Prometheus metrics of one router (own CollectorRegistry, so several routers in one process —
tests, benchmarks — never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets from 100 us (router overhead) to a minute (long generations).
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("monoserve_router_requests", "Finished requests by outcome "
                                "(stop, length, cancelled, deadline, invalid_argument, resource_exhausted, ...)",
                                ["outcome"], registry=r)
        self.ttft = Histogram("monoserve_router_ttft_seconds", "Time from request to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("monoserve_router_tpot_seconds", "Mean time per output token of a request",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.queue_depth = Gauge("monoserve_router_queue_depth", "Requests waiting for a free replica", registry=r)
        self.queue_wait = Histogram("monoserve_router_queue_wait_seconds", "Time a request waited for a replica",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.active = Gauge("monoserve_router_active_slots", "Replica slots the router has requests running on",
                            registry=r)
        self.rejections = Counter("monoserve_router_rejections", "Requests refused with RESOURCE_EXHAUSTED",
                                  ["reason"], registry=r)
        self.failovers = Counter("monoserve_router_failovers", "Requests resumed on another replica after a failure",
                                 registry=r)
        self.aborts = Counter("monoserve_router_aborts", "Requests cancelled by the client or aborted",
                              registry=r)
        self.replicas = Gauge("monoserve_router_replicas", "Replicas in the pool by state", ["state"], registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1"):
        """Expose /metrics on `port` (0 = any free port); returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)
