"""Bounds on how long the router waits: for a replica that never comes up, and after replicas
refuse for lack of a slot. Real loopback gRPC, PacedEngine replicas."""

import socket
import threading
import time

import grpc
import pytest
from monoserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, inference_pb2, inference_pb2_grpc

from replicas.server import ReplicaServer
from replicas.testing import PacedEngine
from router.server import RouterServer


def request(ids=(5, 6, 7), max_tokens=10):
    return inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=list(ids)),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_replica_that_never_comes_up_fails_requests_fast_and_is_admitted_when_it_does():
    """A mistyped --replica counted as 'connecting, worth waiting for' for ever: a request
    without a deadline hung, one with a deadline waited until it."""
    port = unused_port()
    dead = f"127.0.0.1:{port}"
    router = RouterServer([dead], connect_timeout_s=0.5)
    router.start()
    replica = None
    try:
        with grpc.insecure_channel(router.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            t0 = time.perf_counter()  # sent while the replica may still come up: waits for it, then fails
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request(), timeout=10))
            waited = time.perf_counter() - t0
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert dead in err.value.details() and "ejected" in err.value.details()
            assert "not ready 0.5 s after it was added" in err.value.details()
            assert 0.3 < waited < 2.0, waited
            t0 = time.perf_counter()  # from now on: at once
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request(), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.perf_counter() - t0 < 0.3
            admin = admin_pb2_grpc.RouterAdminStub(channel)
            [status] = admin.ListReplicas(admin_pb2.ListReplicasRequest()).replicas
            assert status.state == admin_pb2.REPLICA_STATE_EJECTED

            replica = ReplicaServer(PacedEngine(tokens_per_s=2000), port=port)  # it comes up after all
            replica.start()
            router.wait_ready(timeout=5)
            msgs = list(stub.Generate(request(max_tokens=4), timeout=10))
            assert msgs[-1].final.usage.completion_tokens == 4
    finally:
        router.stop()
        if replica is not None:
            replica.stop(grace=0)


def test_requests_queued_for_a_busy_replica_keep_waiting_when_another_never_comes_up():
    busy = ReplicaServer(PacedEngine(tokens_per_s=200))  # one slot
    busy.start()
    router = RouterServer([busy.address], connect_timeout_s=0.2)
    router.start()
    try:
        router.wait_ready()
        router.add_replica(f"127.0.0.1:{unused_port()}")  # never comes up
        with grpc.insecure_channel(router.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            holder = stub.Generate(request(max_tokens=120))  # holds the only slot ~0.6 s
            next(holder)
            out = {}
            queued = threading.Thread(target=lambda: out.update(msgs=list(stub.Generate(request(max_tokens=3),
                                                                                         timeout=10))))
            queued.start()
            queued.join()
            assert out["msgs"][-1].final.usage.completion_tokens == 3  # waited past the connect timeout
            assert list(holder)[-1].final.usage.completion_tokens == 120
    finally:
        router.stop()
        busy.stop(grace=0)


def test_connect_timeout_must_be_positive():
    with pytest.raises(ValueError, match="connect_timeout_s must be > 0"):
        RouterServer([], connect_timeout_s=0)


class _Refusing(PacedEngine):
    """Refuses its first `refusals` generations with EngineBusy (its replica answers
    RESOURCE_EXHAUSTED though its load reports show a free slot), then serves."""

    def __init__(self, *args, refusals: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.refusals = refusals
        self.refused = 0

    def generate(self, prompt_ids, params):
        from replicas.engine import EngineBusy

        if self.refusals > 0:
            self.refusals -= 1
            self.refused += 1
            raise EngineBusy("slot taken by another router")
        return super().generate(prompt_ids, params)


@pytest.fixture
def refusing_router():
    made = []

    def make(refusals: int, first=None):
        """A replica that refuses `refusals` times, and a router in front of it, or only of `first`
        if given (the test adds the refusing one when it wants)."""
        replica = ReplicaServer(_Refusing(tokens_per_s=2000, refusals=refusals))
        replica.start()
        router = RouterServer([first.address] if first else [replica.address])
        router.start()
        router.wait_ready()
        channel = grpc.insecure_channel(router.address)
        made.append((router, replica, channel))
        return router, replica, inference_pb2_grpc.InferenceStub(channel)

    yield make
    for router, replica, channel in made:
        channel.close()
        router.stop()
        replica.stop(grace=0)


def test_a_busy_refusal_is_retried_promptly_not_at_the_next_heartbeat(refusing_router):
    """The load report showing the freed slot arrives before the refusal itself, so the router
    waited for the next one: the 2 s WatchLoad heartbeat."""
    _, replica, stub = refusing_router(refusals=2)
    t0 = time.perf_counter()
    msgs = list(stub.Generate(request(max_tokens=4), timeout=10))
    took = time.perf_counter() - t0
    assert msgs[-1].final.usage.completion_tokens == 4
    assert replica.servicer.engine.refusals == 0  # it was refused twice, then served
    print(f"two busy refusals, then 4 tokens: {took * 1e3:.0f} ms")
    assert took < 0.5, f"two busy refusals cost {took:.2f} s"


def test_a_replica_that_keeps_refusing_is_given_up_with_resource_exhausted(refusing_router):
    """Busy refusals were retried without limit: for ever without a deadline."""
    from router.core import MAX_BUSY_REFUSALS

    router, replica, stub = refusing_router(refusals=10**9)
    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request(), timeout=10))
    took = time.perf_counter() - t0
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert replica.address in err.value.details() and f"{MAX_BUSY_REFUSALS} times" in err.value.details()
    assert dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
    assert replica.servicer.engine.refused == MAX_BUSY_REFUSALS
    print(f"gave up after {MAX_BUSY_REFUSALS} refusals in {took * 1e3:.0f} ms")
    assert took < 2.0
    assert router.router.pool.replicas[replica.address].healthy  # busy is no failure: not ejected


def test_after_its_refusals_a_request_goes_to_another_replica(refusing_router):
    from router.core import MAX_BUSY_REFUSALS

    good = ReplicaServer(PacedEngine(tokens_per_s=200))  # one slot
    good.start()
    try:
        router, refusing, stub = refusing_router(refusals=10**9, first=good)
        holder = stub.Generate(request(max_tokens=400))  # holds the good replica's slot ~2 s
        next(holder)
        router.add_replica(refusing.address)
        router.wait_ready(2)
        msgs = list(stub.Generate(request(max_tokens=5), timeout=10))  # idle: the refusing one first
        assert msgs[-1].final.usage.completion_tokens == 5
        assert good.servicer.engine.started == 2 and refusing.servicer.engine.started == 0  # served by the good one
        assert refusing.servicer.engine.refused == MAX_BUSY_REFUSALS
        assert list(holder)[-1].final.usage.completion_tokens == 400
        assert router.metrics.registry.get_sample_value("monoserve_router_failovers_total") == 0
    finally:
        good.stop(grace=0)


def test_http_clients_get_503_naming_the_replica_that_never_came_up(tiny_checkpoint):
    import httpx

    dead = f"127.0.0.1:{unused_port()}"
    router = RouterServer([dead], http_port=0, tokenizer=tiny_checkpoint, model_name="tiny", connect_timeout_s=0.3)
    router.start()
    try:
        r = httpx.post(f"http://127.0.0.1:{router.http_port}/v1/completions",
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable_error"
        assert f"{dead} ejected" in r.json()["error"]["message"]
    finally:
        router.stop()
