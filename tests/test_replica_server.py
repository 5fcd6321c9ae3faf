"""ReplicaServer end to end over real loopback gRPC (PacedEngine: deterministic tokens, fixed rate)."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from monoserve.v1 import common_pb2, replica_pb2, replica_pb2_grpc

from replicas.engine import SamplingParams
from replicas.server import ReplicaServer
from replicas.testing import PacedEngine

SP = common_pb2.SamplingParams


@pytest.fixture
def serve():
    """serve(engine, **kw) -> (server, stub); every server and channel is closed after the test."""
    opened = []

    def start(engine, **kw):
        server = ReplicaServer(engine, **kw)
        server.start()
        channel = grpc.insecure_channel(server.address)
        opened.append((server, channel))
        return server, replica_pb2_grpc.ReplicaStub(channel)

    yield start
    for server, channel in opened:
        channel.close()
        server.stop(grace=0.5)


def gen_request(prompt=(5, 6, 7), request_id="", **sampling):
    return replica_pb2.ReplicaGenerateRequest(request_id=request_id, prompt_token_ids=list(prompt), sampling=SP(**sampling))


def collect(stream):
    tokens, final = [], None
    for msg in stream:
        if msg.HasField("chunk"):
            assert final is None, "chunk after final"
            tokens.extend(msg.chunk.token_ids)
        else:
            final = msg.final
    return tokens, final


def wait_for(predicate, timeout=2.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


def test_streamed_tokens_equal_the_engines_own_output(serve):
    engine = PacedEngine(tokens_per_s=5000)
    _, stub = serve(engine)
    expected = list(engine.generate([5, 6, 7], SamplingParams(max_tokens=40)))
    tokens, final = collect(stub.Generate(gen_request(max_tokens=40)))
    assert tokens == expected
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 40)
    assert final.timings.ttft_ms > 0 and final.timings.total_ms >= final.timings.ttft_ms
    assert 0 < final.timings.mean_tpot_ms < 2  # 0.2 ms nominal; generous for loaded CI machines


def test_stop_token_ends_the_stream_and_is_reported_not_streamed(serve):
    engine = PacedEngine(tokens_per_s=5000)
    _, stub = serve(engine)
    full = list(engine.generate([5, 6, 7], SamplingParams(max_tokens=10)))
    tokens, final = collect(stub.Generate(gen_request(max_tokens=10, stop_token_ids=[full[4]])))
    assert tokens == full[:4]
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP and final.stop_token_id == full[4]
    eos_engine = PacedEngine(tokens_per_s=5000, eos_after=3)
    _, stub2 = serve(eos_engine)
    tokens, final = collect(stub2.Generate(gen_request(max_tokens=10)))
    assert len(tokens) == 3 and final.stop_token_id == 2 and final.finish_reason == common_pb2.FINISH_REASON_STOP


def test_tokens_are_streamed_as_produced_not_buffered(serve):
    _, stub = serve(PacedEngine(tokens_per_s=20))  # 50 ms per token
    start = time.perf_counter()
    arrivals = [time.perf_counter() - start for msg in stub.Generate(gen_request(max_tokens=4)) if msg.HasField("chunk")]
    assert len(arrivals) == 4
    # buffered output would arrive all at once after ~150 ms; streamed output spreads over it
    assert arrivals[-1] - arrivals[0] > 0.1, arrivals
    assert arrivals[0] < 0.1, f"first token took {arrivals[0]:.3f}s"


def test_capacity_beyond_engine_slots_is_resource_exhausted_and_frees_after(serve):
    engine = PacedEngine(tokens_per_s=200, max_batch=2)
    _, stub = serve(engine)
    running = [stub.Generate(gen_request(max_tokens=20)) for _ in range(2)]
    for call in running:
        next(call)  # both admitted and streaming
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(gen_request(max_tokens=5)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "slots" in err.value.details() and "busy" in err.value.details()
    pushback = dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"]
    assert int(pushback) > 0
    for call in running:  # nothing accepted was lost
        tokens, final = collect(call)
        assert len(tokens) == 19 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    tokens, _ = collect(stub.Generate(gen_request(max_tokens=5)))
    assert len(tokens) == 5


def test_abort_by_request_id_ends_stream_with_cancelled(serve):
    engine = PacedEngine(tokens_per_s=50)
    _, stub = serve(engine)
    call = stub.Generate(gen_request(max_tokens=1000, request_id="r1"))
    next(call)
    t0 = time.perf_counter()
    assert stub.Abort(replica_pb2.ReplicaAbortRequest(request_id="r1")).found
    tokens, final = collect(call)
    assert time.perf_counter() - t0 < 0.5  # one token is 20 ms; slack for loaded machines
    assert final.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert final.usage.completion_tokens == 1 + len(tokens) < 10
    assert not stub.Abort(replica_pb2.ReplicaAbortRequest(request_id="r1")).found
    assert not stub.Abort(replica_pb2.ReplicaAbortRequest(request_id="never")).found


def test_client_cancel_stops_the_engine_within_a_token(serve):
    engine = PacedEngine(tokens_per_s=50)  # 20 ms per token
    server, stub = serve(engine, metrics_port=0)
    call = stub.Generate(gen_request(max_tokens=1000))
    next(call), next(call)
    call.cancel()
    t0 = time.perf_counter()
    assert wait_for(lambda: engine.active == 0, 1.0)
    assert time.perf_counter() - t0 < 0.3  # one token is 20 ms; slack for loaded machines
    assert engine.cancelled == 1 and engine.last_generation.num_tokens < 10
    assert wait_for(lambda: server.busy_slots() == 0)
    metrics = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    assert 'monoserve_replica_requests_total{outcome="cancelled"} 1.0' in metrics


def test_deadline_stops_the_engine(serve):
    engine = PacedEngine(tokens_per_s=50)
    server, stub = serve(engine, metrics_port=0)
    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(gen_request(max_tokens=1000), timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: engine.active == 0, 1.0)
    assert time.perf_counter() - t0 < 0.8  # deadline 0.3 s + one 20 ms token + slack
    assert engine.cancelled == 1 and engine.last_generation.num_tokens < 20
    assert wait_for(lambda: server.busy_slots() == 0)
    metrics = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics").text
    assert 'monoserve_replica_requests_total{outcome="deadline"} 1.0' in metrics


def test_watch_load_pushes_changes_immediately(serve):
    engine = PacedEngine(tokens_per_s=100, max_batch=2)
    _, stub = serve(engine)
    watch = stub.WatchLoad(replica_pb2.WatchLoadRequest())
    first = next(watch)
    assert (first.capacity, first.busy_slots, first.healthy, first.draining) == (2, 0, True, False)
    received: list[tuple[float, common_pb2.ReplicaLoad]] = []

    def reader():
        for load in watch:
            received.append((time.perf_counter(), load))
            if len(received) == 2:
                return

    t = threading.Thread(target=reader)
    t.start()
    admitted_at = time.perf_counter()
    call = stub.Generate(gen_request(max_tokens=5))
    next(call)
    t.join(timeout=1.0)
    watch.cancel()
    (t_admit, on_admit), (t_finish, on_finish) = received
    assert on_admit.busy_slots == 1 and on_admit.tokens_remaining in (4, 5)  # the first token may be out
    assert t_admit - admitted_at < 0.2, "admission push was not immediate (the heartbeat is 2 s)"
    assert on_finish.busy_slots == 0 and on_finish.version > on_admit.version
    assert t_finish - admitted_at < 0.5  # 5 tokens at 10 ms + slack, far below the heartbeat
    assert on_finish.tpot_ewma_ms == pytest.approx(10, rel=0.5)
    assert on_finish.tpot_ms_by_occupancy[0] == on_finish.tpot_ewma_ms  # one slot was busy throughout
    assert collect(call)[1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_drain_refuses_new_requests_finishes_running_ones_and_turns_readiness_off(serve):
    engine = PacedEngine(tokens_per_s=200, max_batch=2)
    server, stub = serve(engine)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    check = lambda service: health.Check(health_pb2.HealthCheckRequest(service=service)).status
    assert check("monoserve.v1.Replica") == health_pb2.HealthCheckResponse.SERVING
    watch = stub.WatchLoad(replica_pb2.WatchLoadRequest())
    next(watch)
    call = stub.Generate(gen_request(max_tokens=30))
    next(call)
    server.drain()
    assert check("monoserve.v1.Replica") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert check("") == health_pb2.HealthCheckResponse.SERVING  # still alive
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(gen_request(max_tokens=5)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    tokens, final = collect(call)
    assert len(tokens) == 29 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert any(load.draining for load in (next(watch), next(watch)))
    assert server.wait_idle(timeout=1.0)
    watch.cancel()


BAD_REQUESTS = [
    (dict(prompt=()), "prompt is empty"),
    (dict(prompt=(5, 512)), "outside the vocabulary"),
    (dict(prompt=(5, -1)), "outside the vocabulary"),
    (dict(prompt=[7] * 4096), "context window"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-5), "seed"),
    (dict(stop_token_ids=[100000]), "stop token id"),
]


@pytest.mark.parametrize("kwargs,message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_malformed_requests_are_invalid_argument_with_a_message(serve, kwargs, message):
    engine = PacedEngine(tokens_per_s=5000)
    _, stub = serve(engine)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(gen_request(**kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert engine.started == 0  # refused before reaching the engine
    tokens, _ = collect(stub.Generate(gen_request(max_tokens=3)))  # and the server still serves
    assert len(tokens) == 3


def test_duplicate_running_request_id_is_refused(serve):
    _, stub = serve(PacedEngine(tokens_per_s=100, max_batch=2))
    call = stub.Generate(gen_request(max_tokens=20, request_id="same"))
    next(call)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(gen_request(max_tokens=5, request_id="same")))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "same" in err.value.details()
    call.cancel()


def test_engine_crash_mid_stream_is_internal_and_the_server_keeps_serving(serve):
    engine = PacedEngine(tokens_per_s=5000, fail_after=3)
    _, stub = serve(engine)
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for msg in stub.Generate(gen_request(max_tokens=10)):
            got.extend(msg.chunk.token_ids)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "engine failed after 3 tokens" in err.value.details() and "simulated failure" in err.value.details()
    assert got == list(PacedEngine(tokens_per_s=5000).generate([5, 6, 7], SamplingParams(max_tokens=3)))
    engine.fail_after = None
    assert len(collect(stub.Generate(gen_request(max_tokens=4)))[0]) == 4


def test_repeated_engine_failures_turn_readiness_off_until_a_probe_succeeds(serve):
    engine = PacedEngine(tokens_per_s=5000, fail_after=0)
    server, stub = serve(engine)
    server.servicer.probe_interval_s = 0.05
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    ready = lambda: health.Check(health_pb2.HealthCheckRequest(service="monoserve.v1.Replica")).status
    for _ in range(3):
        with pytest.raises(grpc.RpcError):
            collect(stub.Generate(gen_request(max_tokens=2)))
    assert wait_for(lambda: not server.load().healthy)
    assert ready() == health_pb2.HealthCheckResponse.NOT_SERVING
    time.sleep(0.2)  # probes keep failing while the engine is broken
    assert not server.load().healthy
    engine.fail_after = None  # the engine recovers: the next self-probe makes the replica ready again
    assert wait_for(lambda: server.load().healthy, 2.0)
    assert ready() == health_pb2.HealthCheckResponse.SERVING
    assert len(collect(stub.Generate(gen_request(max_tokens=3)))[0]) == 3


def test_a_fatal_engine_failure_turns_readiness_off_at_once(serve):
    """EngineFailed (a GPU fault, a lost tensor-parallel peer: the engine cannot recover) is INTERNAL for the
    request, which the router resumes elsewhere, and makes the replica NOT_SERVING after one failure, not three."""
    engine = PacedEngine(tokens_per_s=5000, fail_after=2, fatal=True)
    server, stub = serve(engine)
    server.servicer.probe_interval_s = 0.05
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(gen_request(max_tokens=5)))
    assert err.value.code() == grpc.StatusCode.INTERNAL and "simulated GPU fault" in err.value.details()
    assert wait_for(lambda: not server.load().healthy)
    status = health.Check(health_pb2.HealthCheckRequest(service="monoserve.v1.Replica")).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_reflection_and_info(serve):
    engine = PacedEngine(tokens_per_s=5000, max_batch=3)
    server, stub = serve(engine, replica_id="rep-a", model_name="tiny-paced", gpu_ids=[0, 1])
    channel = grpc.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "monoserve.v1.Replica"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert {"monoserve.v1.Replica", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    info = stub.GetInfo(replica_pb2.GetInfoRequest())
    assert (info.replica_id, info.model_name, info.engine_kind) == ("rep-a", "tiny-paced", "paced")
    assert (info.max_batch, info.max_context, list(info.gpu_ids)) == (3, 4096, [0, 1])
    assert info.shape.vocab_size == 512 and list(info.shape.eos_token_ids) == [2]
    channel.close()


def test_prometheus_metrics_per_server(serve):
    a, stub_a = serve(PacedEngine(tokens_per_s=5000), metrics_port=0)
    b, _ = serve(PacedEngine(tokens_per_s=5000), metrics_port=0)  # a second registry in one process
    collect(stub_a.Generate(gen_request(max_tokens=4)))
    with pytest.raises(grpc.RpcError):
        collect(stub_a.Generate(gen_request(prompt=())))
    text = httpx.get(f"http://127.0.0.1:{a.metrics_port}/metrics").text
    assert 'monoserve_replica_requests_total{outcome="length"} 1.0' in text
    assert 'monoserve_replica_requests_total{outcome="invalid"} 1.0' in text
    assert "monoserve_replica_ttft_seconds_count 1.0" in text
    assert "monoserve_replica_tpot_seconds_count 3.0" in text
    assert "monoserve_replica_generated_tokens_total 4.0" in text
    assert "monoserve_replica_active_slots 0.0" in text
    other = httpx.get(f"http://127.0.0.1:{b.metrics_port}/metrics").text
    assert 'monoserve_replica_requests_total{outcome="length"} 0.0' in other


def test_seeded_sampling_reproduces_and_greedy_resume_continues_the_same_sequence(serve):
    engine = PacedEngine(tokens_per_s=5000)
    _, stub = serve(engine)
    a, _ = collect(stub.Generate(gen_request(max_tokens=8, temperature=0.8, seed=42)))
    b, _ = collect(stub.Generate(gen_request(max_tokens=8, temperature=0.8, seed=42)))
    assert a == b
    full, _ = collect(stub.Generate(gen_request(max_tokens=12)))
    rest, _ = collect(stub.Generate(gen_request(prompt=[5, 6, 7] + full[:5], max_tokens=7)))
    assert full[5:] == rest
    assert engine.forward_logits([5, 6, 7] + full).argmax(-1)[2:-1].tolist() == full


def test_garbage_request_bytes_are_invalid_argument(serve):
    server, stub = serve(PacedEngine(tokens_per_s=5000))
    channel = grpc.insecure_channel(server.address)
    for method in ("/monoserve.v1.Replica/Generate", "/monoserve.v1.Replica/Abort"):
        raw = channel.unary_stream(method) if method.endswith("Generate") else channel.unary_unary(method)
        with pytest.raises(grpc.RpcError) as err:
            result = raw(b"\xff\xff\xff\x07garbage")
            list(result) if method.endswith("Generate") else result
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid monoserve.v1." in err.value.details()
    assert len(collect(stub.Generate(gen_request(max_tokens=2)))[0]) == 2
    channel.close()


def test_stop_ends_watch_streams_and_returns_promptly():
    server = ReplicaServer(PacedEngine(tokens_per_s=5000))
    server.start()
    channel = grpc.insecure_channel(server.address)
    watch = replica_pb2_grpc.ReplicaStub(channel).WatchLoad(replica_pb2.WatchLoadRequest())
    next(watch)
    assert server.load().busy_slots == 0 and server.load().healthy
    t0 = time.perf_counter()
    server.stop(grace=5.0)
    assert time.perf_counter() - t0 < 2.0, "an open WatchLoad stream held stop() for the whole grace period"
    with pytest.raises((StopIteration, grpc.RpcError)):
        while True:
            next(watch)
    channel.close()


def test_back_to_back_requests_find_the_slot_free_after_the_final_message(serve):
    """The slot is freed before the final message is sent, so a caller never races its own release."""
    _, stub = serve(PacedEngine(tokens_per_s=100_000, max_batch=1))
    for _ in range(40):
        tokens, final = collect(stub.Generate(gen_request(max_tokens=2)))
        assert len(tokens) == 2 and final.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_port_in_use_is_a_clear_oserror(serve):
    first, _ = serve(PacedEngine())
    second = ReplicaServer(PacedEngine(), port=first.port)
    with pytest.raises(OSError, match="cannot bind gRPC address .* pick another port"):
        second.start()
    second.stop()  # a server that never started stops as a no-op


def test_a_reader_slower_than_the_engine_gets_the_backlog_in_fewer_chunks_without_loss(serve):
    engine = PacedEngine(tokens_per_s=1e6)  # far faster than one gRPC message per token can go
    _, stub = serve(engine)
    chunks = [list(m.chunk.token_ids) for m in stub.Generate(gen_request(max_tokens=3000, ignore_eos=True))
              if m.HasField("chunk")]
    tokens = [t for c in chunks for t in c]
    assert tokens == list(PacedEngine(tokens_per_s=1e6).generate([5, 6, 7], SamplingParams(max_tokens=3000)))
    assert len(chunks) < len(tokens)
