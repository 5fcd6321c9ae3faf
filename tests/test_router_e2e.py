"""Router end to end on loopback: real gRPC, real replica servers (PacedEngine and the reference
engine), real router server. What a client sees: tokens, text, finish reasons, statuses, timing."""

import threading
import time

import grpc
import pytest
from monoserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, inference_pb2, inference_pb2_grpc

from replicas.engine import SamplingParams
from replicas.server import ReplicaServer
from replicas.testing import PacedEngine
from router.server import RouterServer


class Cluster:
    """Replica servers + one router server, torn down together."""

    def __init__(self, engines, **router_kw):
        self.engines = list(engines)
        self.replicas = [ReplicaServer(e) for e in self.engines]
        for r in self.replicas:
            r.start()
        self.router = RouterServer([r.address for r in self.replicas], **router_kw)
        self.router.start()
        self.router.wait_ready(len(self.replicas))
        self.channel = grpc.insecure_channel(self.router.address)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.admin = admin_pb2_grpc.RouterAdminStub(self.channel)

    def close(self):
        self.channel.close()
        self.router.stop()
        for r in self.replicas:
            r.stop(grace=0)


@pytest.fixture
def make_cluster():
    made = []

    def make(*engines, **kw):
        made.append(Cluster(engines, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def request(ids=(5, 6, 7), max_tokens=20, **kw):
    return inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=list(ids)),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **kw)


class Result(tuple):
    """(token ids, text, final, seconds to first token, seconds total) + decode rate."""

    def __new__(cls, ids, text, final, ttft, total, last):
        self = super().__new__(cls, (ids, text, final, ttft, total))
        # under heavy load a replica may put several tokens in one chunk: never divide by zero
        self.decode_tokens_per_s = (len(ids) - 1) / max(last - ttft, 1e-6) if len(ids) > 1 else 0.0
        return self


def collect(stub, req, timeout=10.0, **kw) -> Result:
    t0 = time.perf_counter()
    ids, text, final, ttft, last = [], "", None, None, None
    for msg in stub.Generate(req, timeout=timeout, **kw):
        if msg.HasField("chunk"):
            last = time.perf_counter() - t0
            if ttft is None and msg.chunk.token_ids:
                ttft = last
            ids += msg.chunk.token_ids
            text += msg.chunk.text
        else:
            assert final is None, "more than one Final"
            final = msg.final
    assert final is not None, "stream ended without a Final"
    return Result(ids, text, final, ttft, time.perf_counter() - t0, last)


def wait_for(condition, timeout=5.0):
    """Poll a test condition (the router itself never polls)."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.002)


def in_router(server: RouterServer) -> int:
    """Requests the router has bound to replicas or queued."""
    bound = sum(h.router_running for h in list(server.router.pool.replicas.values()))
    return bound + server.queue_depth()


def engine_output(ids, max_tokens, engine=None):
    engine = engine or PacedEngine(tokens_per_s=1e6)
    return list(engine.generate(list(ids), SamplingParams(max_tokens=max_tokens)))


def test_streamed_tokens_equal_the_engines_own_output(make_cluster):
    c = make_cluster(PacedEngine(tokens_per_s=2000))
    ids, _, final, _, _ = collect(c.stub, request(max_tokens=30))
    assert ids == engine_output([5, 6, 7], 30)
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == 3 and final.usage.completion_tokens == 30
    assert final.timings.ttft_ms > 0 and final.timings.total_ms >= final.timings.ttft_ms


def test_text_prompt_on_the_reference_engine(make_cluster, tiny_checkpoint):
    from replicas.reference import ReferenceEngine
    from router.detokenizer import TextTokenizer

    engine = ReferenceEngine.from_pretrained(tiny_checkpoint)
    c = make_cluster(engine, tokenizer=tiny_checkpoint)
    tok = TextTokenizer.from_pretrained(tiny_checkpoint)
    req = inference_pb2.GenerateRequest(text="hello world", sampling=common_pb2.SamplingParams(max_tokens=12))
    ids, text, final, _, _ = collect(c.stub, req)
    prompt = tok.encode("hello world")
    expected = list(ReferenceEngine.from_pretrained(tiny_checkpoint).generate(prompt, SamplingParams(max_tokens=12)))
    assert ids == expected
    assert text == tok.decode(ids)
    assert final.usage.prompt_tokens == len(prompt)
    models = c.stub.ListModels(inference_pb2.ListModelsRequest()).models
    assert models[0].id == tiny_checkpoint.name and models[0].vocab_size == engine.config.vocab_size


def test_n_replicas_serve_n_requests_at_solo_speed(make_cluster):
    n, tokens, rate = 3, 60, 100.0
    c = make_cluster(*[PacedEngine(tokens_per_s=rate) for _ in range(n)])
    solo = collect(c.stub, request(max_tokens=tokens)).decode_tokens_per_s
    results = [None] * n

    def one(i):
        results[i] = collect(c.stub, request(ids=(i + 10,), max_tokens=tokens))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r[2].replica_id for r in results}) == n  # one request per replica
    for r in results:
        assert len(r[0]) == tokens
        speed = r.decode_tokens_per_s / solo
        assert speed >= 0.9, f"concurrent request ran at {speed:.0%} of solo speed"


def test_the_extra_request_waits_and_goes_to_the_first_replica_that_frees(make_cluster):
    c = make_cluster(PacedEngine(tokens_per_s=100), PacedEngine(tokens_per_s=100))
    out = {}

    def run(name, max_tokens):
        out[name] = collect(c.stub, request(ids=(max_tokens,), max_tokens=max_tokens))

    long = threading.Thread(target=run, args=("long", 60))
    long.start()
    wait_for(lambda: in_router(c.router) == 1)
    short = threading.Thread(target=run, args=("short", 10))
    short.start()
    wait_for(lambda: in_router(c.router) == 2)
    extra = threading.Thread(target=run, args=("extra", 5))
    extra.start()
    wait_for(lambda: c.router.queue_depth() == 1)
    status = c.admin.ListReplicas(admin_pb2.ListReplicasRequest())
    assert status.queue_depth == 1 and all(r.router_running == 1 for r in status.replicas)
    for t in (long, short, extra):
        t.join()
    assert out["extra"][2].replica_id == out["short"][2].replica_id != out["long"][2].replica_id
    assert out["extra"][2].timings.queue_ms > 20
    # it started as soon as the short one ended (~0.1 s), long before the long one (~0.6 s)
    assert out["extra"][3] < 0.45
    assert out["extra"][0] == engine_output([5], 5)


def test_client_cancel_stops_the_replica_within_a_token(make_cluster):
    engine = PacedEngine(tokens_per_s=100)
    c = make_cluster(engine)
    call = c.stub.Generate(request(max_tokens=500), timeout=10)
    got = 0
    for msg in call:
        got += len(msg.chunk.token_ids)
        if got >= 3:
            break
    call.cancel()
    end = time.monotonic() + 1.0
    while engine.active and time.monotonic() < end:
        time.sleep(0.002)
    assert engine.active == 0 and engine.cancelled == 1
    assert engine.last_generation.num_tokens <= got + 2
    # the slot is free again: the next request is served at once
    assert collect(c.stub, request(max_tokens=3))[3] < 0.2


def test_deadline_travels_to_the_replica(make_cluster):
    engine = PacedEngine(tokens_per_s=50)
    c = make_cluster(engine)
    with pytest.raises(grpc.RpcError) as err:
        collect(c.stub, request(max_tokens=200), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    end = time.monotonic() + 1.0
    while engine.active and time.monotonic() < end:
        time.sleep(0.005)
    assert engine.active == 0  # the replica stopped too


def test_in_process_deadline_keeps_the_partial_output(make_cluster):
    import asyncio

    c = make_cluster(PacedEngine(tokens_per_s=100))
    router = c.router.router

    async def run():
        return [m async for m in router.generate(request(max_tokens=500), deadline=router.clock() + 0.15)]

    msgs = asyncio.run_coroutine_threadsafe(run(), c.router._loop).result(5)
    ids = [t for m in msgs[:-1] for t in m.chunk.token_ids]
    assert msgs[-1].final.finish_reason == common_pb2.FINISH_REASON_DEADLINE
    assert 1 <= len(ids) < 100 and ids == engine_output([5, 6, 7], len(ids))


def test_abort_by_request_id(make_cluster):
    c = make_cluster(PacedEngine(tokens_per_s=100))
    call = c.stub.Generate(request(max_tokens=500, request_id="job-1"), timeout=10)
    msgs = []
    for msg in call:
        msgs.append(msg)
        if len(msgs) == 2:
            assert c.stub.Abort(inference_pb2.AbortRequest(request_id="job-1")).found
    assert msgs[-1].final.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert msgs[-1].final.request_id == "job-1"
    assert not c.stub.Abort(inference_pb2.AbortRequest(request_id="job-1")).found


def test_overload_is_refused_with_pushback_and_nothing_accepted_is_lost(make_cluster):
    c = make_cluster(PacedEngine(tokens_per_s=100), queue_size=2)
    results, errors = {}, {}

    def one(i):
        try:
            results[i] = collect(c.stub, request(ids=(i + 1,), max_tokens=20))
        except grpc.RpcError as e:
            errors[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for i, t in enumerate(threads):
        t.start()
        wait_for(lambda: in_router(c.router) + len(errors) == i + 1)  # arrive in order
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2] and sorted(errors) == [3, 4, 5]
    for i, r in results.items():
        assert r[0] == engine_output([i + 1], 20)  # complete and correct
    for e in errors.values():
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in e.details()
        pushback = dict(e.trailing_metadata())["grpc-retry-pushback-ms"]
        assert int(pushback) >= 1


def test_a_deadline_that_cannot_be_met_is_refused_up_front(make_cluster):
    c = make_cluster(PacedEngine(tokens_per_s=100))
    collect(c.stub, request(max_tokens=5))  # let the replica measure its TPOT
    busy = threading.Thread(target=collect, args=(c.stub, request(max_tokens=50)))
    busy.start()
    wait_for(lambda: in_router(c.router) == 1)
    with pytest.raises(grpc.RpcError) as err:
        collect(c.stub, request(max_tokens=50), timeout=0.3)  # needs ~0.45 s wait + 0.5 s work
    busy.join()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "deadline" in err.value.details()
    assert "grpc-retry-pushback-ms" in dict(err.value.trailing_metadata())


def test_engine_failure_mid_stream_fails_over_without_loss(make_cluster):
    broken = PacedEngine(tokens_per_s=1000, fail_after=7)
    c = make_cluster(broken, PacedEngine(tokens_per_s=1000))
    out = {}

    def one(i):  # two at once: one lands on the broken replica, resumes behind the other
        out[i] = collect(c.stub, request(ids=(i,), max_tokens=40))

    threads = [threading.Thread(target=one, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (ids, _, final, _, _) in out.items():
        assert ids == engine_output([i], 40)
        assert final.usage.completion_tokens == 40
        assert final.replica_id == c.replicas[1].replica_id
    assert broken.started == 1  # it did serve (and fail) one request first
    metrics = c.router.metrics.registry.get_sample_value("monoserve_router_failovers_total")
    assert metrics == 1


def test_admin_lists_drains_and_removes(make_cluster):
    a, b = PacedEngine(tokens_per_s=200), PacedEngine(tokens_per_s=200)
    c = make_cluster(a, b)
    listed = c.admin.ListReplicas(admin_pb2.ListReplicasRequest())
    assert {r.state for r in listed.replicas} == {admin_pb2.REPLICA_STATE_READY}
    assert listed.queue_capacity == 64
    addr_a = c.replicas[0].address
    running = threading.Thread(target=collect, args=(c.stub, request(max_tokens=40)))
    running.start()
    wait_for(lambda: in_router(c.router) == 1)
    serving = next(r.address for r in c.admin.ListReplicas(admin_pb2.ListReplicasRequest()).replicas
                   if r.router_running)
    removed = c.admin.RemoveReplica(admin_pb2.RemoveReplicaRequest(address=serving, drain=True))
    assert removed.running_requests == 1
    running.join()
    left = c.admin.ListReplicas(admin_pb2.ListReplicasRequest()).replicas
    assert [r.address for r in left] == [x.address for x in c.replicas if x.address != serving]
    with pytest.raises(grpc.RpcError) as err:
        c.admin.RemoveReplica(admin_pb2.RemoveReplicaRequest(address=serving))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        c.admin.AddReplica(admin_pb2.AddReplicaRequest(address="nonsense"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    c.admin.AddReplica(admin_pb2.AddReplicaRequest(address=serving))
    c.router.wait_ready(2)
    assert addr_a
