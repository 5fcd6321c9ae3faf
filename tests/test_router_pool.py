"""Pool behaviour a client can observe: no replica -> UNAVAILABLE, drained replicas get no new
requests, session affinity, abort while queued, the Prometheus endpoint."""

import threading
import time

import grpc
import httpx
import pytest
from monoserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

from replicas.server import ReplicaServer
from replicas.testing import PacedEngine
from router.server import RouterServer


def request(ids=(5, 6, 7), max_tokens=10, **kw):
    return inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=list(ids)),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **kw)


def wait_for(condition, timeout=5.0):
    """Poll a test condition (the router itself never polls)."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.002)


def bound(server: RouterServer) -> int:
    return sum(h.router_running for h in list(server.router.pool.replicas.values()))


def final_of(stub, req, timeout=10.0):
    return list(stub.Generate(req, timeout=timeout))[-1].final


@pytest.fixture
def setup():
    made = []

    def make(n, rate=1000.0, **kw):
        replicas = [ReplicaServer(PacedEngine(tokens_per_s=rate)) for _ in range(n)]
        for r in replicas:
            r.start()
        router = RouterServer([r.address for r in replicas], **kw)
        router.start()
        router.wait_ready(n)
        channel = grpc.insecure_channel(router.address)
        made.append((router, replicas, channel))
        return router, replicas, inference_pb2_grpc.InferenceStub(channel)

    yield make
    for router, replicas, channel in made:
        channel.close()
        router.stop()
        for r in replicas:
            r.stop(grace=0)


def test_no_replica_is_unavailable_at_once():
    router = RouterServer([])
    router.start()
    try:
        with grpc.insecure_channel(router.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            t0 = time.perf_counter()
            with pytest.raises(grpc.RpcError) as err:
                final_of(stub, request())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy replica" in err.value.details()
            assert time.perf_counter() - t0 < 1.0
    finally:
        router.stop()


def test_a_draining_replica_gets_no_new_requests(setup):
    router, replicas, stub = setup(2)
    replicas[0].drain()
    end = time.monotonic() + 5
    while router.router.pool.replicas[replicas[0].address].healthy and time.monotonic() < end:
        time.sleep(0.01)
    for i in range(4):
        assert final_of(stub, request(ids=(i + 1,))).replica_id == replicas[1].replica_id


def test_session_affinity_keeps_a_conversation_on_one_replica(setup):
    router, replicas, stub = setup(3)
    first = final_of(stub, request(session_id="conv-1")).replica_id
    for _ in range(3):
        assert final_of(stub, request(session_id="conv-1")).replica_id == first


def test_abort_while_queued_ends_with_cancelled(setup):
    router, replicas, stub = setup(1, rate=100.0)
    busy = threading.Thread(target=final_of, args=(stub, request(max_tokens=40)))
    busy.start()
    wait_for(lambda: bound(router) == 1)
    result = {}
    waiting = threading.Thread(target=lambda: result.update(final=final_of(stub, request(request_id="q1"))))
    waiting.start()
    wait_for(lambda: router.queue_depth() == 1)
    assert stub.Abort(inference_pb2.AbortRequest(request_id="q1")).found
    waiting.join(2)
    assert result["final"].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert result["final"].usage.completion_tokens == 0
    assert router.queue_depth() == 0
    busy.join()


def test_metrics_endpoint_counts_outcomes(setup):
    router, replicas, stub = setup(1, metrics_port=0)
    final_of(stub, request())
    with pytest.raises(grpc.RpcError):
        final_of(stub, request(max_tokens=0))
    text = httpx.get(f"http://127.0.0.1:{router.metrics_port}/metrics").text
    assert 'monoserve_router_requests_total{outcome="length"} 1.0' in text
    assert 'monoserve_router_requests_total{outcome="invalid_argument"} 1.0' in text
    assert "monoserve_router_ttft_seconds_count 1.0" in text
    assert 'monoserve_router_replicas{state="ready"} 1.0' in text
    assert "monoserve_router_queue_depth 0.0" in text


def test_removing_a_replica_without_drain_fails_its_requests_over(setup):
    from replicas.engine import SamplingParams

    router, replicas, stub = setup(2, rate=200.0)
    ids, final, removed = [], None, None
    for msg in stub.Generate(request(ids=(1, 2), max_tokens=60), timeout=10):
        if msg.HasField("final"):
            final = msg.final
            continue
        ids += msg.chunk.token_ids
        if len(ids) == 10:
            removed = next(h.address for h in router.router.pool.replicas.values() if h.router_running)
            threading.Thread(target=router.remove_replica, args=(removed, False)).start()
    assert ids == list(PacedEngine(tokens_per_s=1e6).generate([1, 2], SamplingParams(max_tokens=60)))
    assert final.replica_id != removed and final.usage.completion_tokens == 60


def test_a_client_that_gives_up_while_queued_leaves_the_queue(setup):
    router, replicas, stub = setup(1, rate=100.0)
    busy = threading.Thread(target=final_of, args=(stub, request(max_tokens=30)))
    busy.start()
    wait_for(lambda: bound(router) == 1)
    waiting = stub.Generate(request(), timeout=10)
    wait_for(lambda: router.queue_depth() == 1)
    waiting.cancel()
    wait_for(lambda: router.queue_depth() == 0)
    busy.join()
    assert final_of(stub, request(max_tokens=2)).usage.completion_tokens == 2  # slot not leaked


def test_an_in_process_caller_closing_the_stream_stops_the_replica():
    import asyncio

    engine = PacedEngine(tokens_per_s=100)
    replica = ReplicaServer(engine)
    replica.start()
    router = RouterServer([replica.address])
    router.start()
    try:
        router.wait_ready()

        async def read_three_then_close():
            stream = router.router.generate(request(max_tokens=500))
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.aclose()

        asyncio.run_coroutine_threadsafe(read_three_then_close(), router._loop).result(5)
        end = time.monotonic() + 0.1  # well within one token (10 ms) plus scheduling
        while engine.active and time.monotonic() < end:
            time.sleep(0.001)
        assert engine.active == 0 and engine.last_generation.num_tokens <= 5
    finally:
        router.stop()
        replica.stop(grace=0)


def test_two_routers_racing_for_one_slot_both_complete():
    """A replica refusing for lack of a slot (RESOURCE_EXHAUSTED) is not a failure: the losing
    router waits for the replica's next load report and then gets the slot."""
    from replicas.engine import SamplingParams

    replica = ReplicaServer(PacedEngine(tokens_per_s=200))
    replica.start()
    routers = [RouterServer([replica.address]) for _ in range(2)]
    try:
        for r in routers:
            r.start()
            r.wait_ready()
        stubs = [inference_pb2_grpc.InferenceStub(grpc.insecure_channel(r.address)) for r in routers]
        finals = {}
        threads = [threading.Thread(target=lambda i=i: finals.update({i: list(stubs[i].Generate(
            request(ids=(i + 1,), max_tokens=20), timeout=10))})) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, msgs in finals.items():
            ids = [t for m in msgs[:-1] for t in m.chunk.token_ids]
            assert ids == list(PacedEngine(tokens_per_s=1e6).generate([i + 1], SamplingParams(max_tokens=20)))
        assert all(r.metrics.registry.get_sample_value("monoserve_router_failovers_total") == 0 for r in routers)
    finally:
        for r in routers:
            r.stop()
        replica.stop(grace=0)


def test_a_replica_whose_engine_keeps_failing_is_ejected():
    from monoserve.v1 import admin_pb2, admin_pb2_grpc

    from replicas.engine import SamplingParams

    broken, good = PacedEngine(tokens_per_s=2000, fail_after=0), PacedEngine(tokens_per_s=2000)
    replicas = [ReplicaServer(broken), ReplicaServer(good)]
    for r in replicas:
        r.start()
    router = RouterServer([r.address for r in replicas])
    router.start()
    try:
        router.wait_ready(2)
        with grpc.insecure_channel(router.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            out = {}

            def one(i):
                msgs = list(stub.Generate(request(ids=(i + 1,), max_tokens=5), timeout=10))
                out[i] = [t for m in msgs[:-1] for t in m.chunk.token_ids]

            for round_ in range(5):  # pairs, so that both replicas get requests
                pair = [threading.Thread(target=one, args=(2 * round_ + k,)) for k in range(2)]
                for t in pair:
                    t.start()
                for t in pair:
                    t.join()
            for i, ids in out.items():
                assert ids == list(PacedEngine(tokens_per_s=1e6).generate([i + 1], SamplingParams(max_tokens=5)))
            # ejected after a failure (until its next healthy report), and for good once the
            # replica itself turns unhealthy (3 failures): half the traffic never reaches it
            assert 1 <= broken.started <= 3
            states = {r.address: r.state for r in admin_pb2_grpc.RouterAdminStub(channel).ListReplicas(
                admin_pb2.ListReplicasRequest()).replicas}
            if broken.started == 3:
                assert states[replicas[0].address] == admin_pb2.REPLICA_STATE_EJECTED
            assert router.metrics.registry.get_sample_value("monoserve_router_failovers_total") == broken.started
    finally:
        router.stop()
        for r in replicas:
            r.stop(grace=0)


def test_router_serves_health_and_reflection(setup):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    router, _, _ = setup(1)
    with grpc.insecure_channel(router.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "monoserve.v1.Inference", "monoserve.v1.RouterAdmin"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=5)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert {"monoserve.v1.Inference", "monoserve.v1.RouterAdmin", "grpc.health.v1.Health"} <= names
