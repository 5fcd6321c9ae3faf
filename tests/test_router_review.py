"""Request-path defects found in review, each pinned by a test through a real router + replica."""

import itertools
import threading
import time

import grpc
import pytest
from monoserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

from replicas.server import ReplicaServer
from replicas.testing import PacedEngine
from router.server import RouterServer

CONTEXT = 2048
TOKENS_PER_S = 200


@pytest.fixture(scope="module")
def router(tiny_checkpoint):
    replica = ReplicaServer(PacedEngine.from_pretrained(tiny_checkpoint, tokens_per_s=TOKENS_PER_S,
                                                        max_context=CONTEXT, max_batch=4))
    replica.start()
    server = RouterServer([replica.address], tokenizer=tiny_checkpoint, model_name="tiny")
    server.start()
    server.wait_ready()
    channel = grpc.insecure_channel(server.address)
    yield server, channel
    channel.close()
    server.stop()
    replica.stop(grace=0)


@pytest.fixture(scope="module")
def stub(router):
    return inference_pb2_grpc.InferenceStub(router[1])


def ids_request(ids=(5, 6), **sampling):
    return inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=list(ids)),
                                         sampling=common_pb2.SamplingParams(**sampling))


def test_large_text_prompt_does_not_stall_other_streams(stub):
    """Tokenizing a 1 MB prompt (~0.5-1 s of Rust holding the GIL) must not stop other streams."""
    big = ("the agent calls a tool and reads naïve 日本語 output; " * 20_000)[:1_000_000]
    arrivals, big_done = [], {}

    def send_big():
        t = time.perf_counter()
        with pytest.raises(grpc.RpcError) as err:  # far beyond the context window
            list(stub.Generate(inference_pb2.GenerateRequest(text=big), timeout=30))
        big_done["code"], big_done["at"], big_done["took"] = err.value.code(), time.perf_counter(), \
            time.perf_counter() - t

    sender = threading.Thread(target=send_big)
    # a stream long enough to outlast the tokenizing on a loaded machine (~10 s at the replica's pace), read until
    # 10 chunks after the big request's answer, then cancelled
    stream = stub.Generate(ids_request(max_tokens=CONTEXT - 8, ignore_eos=True), timeout=60)
    for msg in stream:
        if msg.HasField("chunk"):
            arrivals.append(time.perf_counter())
            if len(arrivals) == 20:
                sender.start()
            if "at" in big_done and sum(a > big_done["at"] for a in arrivals) >= 10:
                stream.cancel()
                break
    sender.join()
    assert big_done["code"] == grpc.StatusCode.INVALID_ARGUMENT
    assert big_done["at"] < arrivals[-1], "the big prompt must be tokenized while the stream runs"
    during = [b - a for a, b in itertools.pairwise(arrivals[20:]) if a < big_done["at"]]
    # on the event loop it would stop the stream for the whole tokenizing time; off it, the gaps stay at the pace
    # plus scheduling noise (up to ~0.3 s on a loaded 2-core CI machine)
    assert max(during) < max(0.3, big_done["took"] / 4), f"stream stalled {max(during) * 1e3:.0f} ms while a 1 MB " \
                                                          f"prompt was tokenized (tokenizing took {big_done['took']:.2f} s)"


def test_off_loop_tokenization_gives_the_same_ids(tiny_checkpoint):
    import asyncio

    from router.detokenizer import OFF_LOOP_CHARS, TextTokenizer

    tok = TextTokenizer.from_pretrained(tiny_checkpoint)
    text = ("<s> naïve 日本語 tool_call(x=1)\n\t " * (OFF_LOOP_CHARS // 10))
    for special in (True, False):
        assert asyncio.run(tok.encode_async(text, special)) == tok.encode(text, special)


def test_oversized_request_is_invalid_argument_saying_the_limit(stub):
    """gRPC's own refusal was a bare RESOURCE_EXHAUSTED 'Received message larger than max'."""
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(inference_pb2.GenerateRequest(text="x" * 5_000_000), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "5000005 bytes" in err.value.details() and "4 MiB" in err.value.details()
    assert "shorten the prompt" in err.value.details()
    msgs = list(stub.Generate(ids_request(max_tokens=3), timeout=10))  # still serving
    assert msgs[-1].final.usage.completion_tokens == 3


@pytest.fixture(scope="module")
def one_slot_router(tiny_checkpoint):
    replica = ReplicaServer(PacedEngine.from_pretrained(tiny_checkpoint, tokens_per_s=2000, max_context=CONTEXT))
    replica.start()
    server = RouterServer([replica.address], model_name="tiny")
    server.start()
    server.wait_ready()
    yield server
    server.stop()
    replica.stop(grace=0)


def test_cancel_as_the_queued_request_gets_its_slot_does_not_leak_it(one_slot_router):
    """A client cancelled in the instant its queued request was bound lost the slot for good
    (the router then thought the replica busy forever). Every interleaving is swept."""
    import asyncio

    router = one_slot_router.router
    handle = next(iter(router.pool.replicas.values()))

    async def drain(gen):
        async for _ in gen:
            pass

    async def scenario(ticks: int) -> int:
        holder = router.generate(ids_request(max_tokens=10_000, ignore_eos=True))
        await holder.__anext__()  # it holds the only slot
        queued = asyncio.ensure_future(drain(router.generate(ids_request(max_tokens=5))))
        while router.dispatcher.depth() == 0:
            await asyncio.sleep(0.001)
        await holder.aclose()  # frees the slot: the queued request is bound to it...
        while router.dispatcher.depth() > 0:
            await asyncio.sleep(0)
        for _ in range(ticks):  # ...and its client goes away `ticks` loop steps later
            await asyncio.sleep(0)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        return handle.router_running

    for ticks in range(8):
        running = asyncio.run_coroutine_threadsafe(scenario(ticks), one_slot_router._loop).result(30)
        assert running == 0, f"a slot leaked when the client cancelled {ticks} loop steps after binding"


def test_deadline_while_failing_over_keeps_the_tokens_already_sent(tiny_checkpoint):
    """After tokens were sent, a deadline ends the stream with Final(DEADLINE) (the documented
    contract) — also when it passes while the request waits for a replica to fail over to; it
    used to raise DEADLINE_EXCEEDED there, dropping the partial output of an in-process caller."""
    import asyncio

    steady = ReplicaServer(PacedEngine.from_pretrained(tiny_checkpoint, tokens_per_s=500, max_context=CONTEXT))
    crashing = ReplicaServer(PacedEngine.from_pretrained(tiny_checkpoint, tokens_per_s=500, max_context=CONTEXT,
                                                         fail_after=5))
    steady.start()
    crashing.start()
    server = RouterServer([steady.address], model_name="tiny")
    server.start()
    try:
        server.wait_ready()
        router = server.router

        async def scenario():
            occupier = router.generate(ids_request(max_tokens=10_000, ignore_eos=True))
            await occupier.__anext__()  # the steady replica's only slot is taken
            router.add_replica(crashing.address)
            while sum(h.healthy for h in router.pool.replicas.values()) < 2:
                await asyncio.sleep(0.01)
            msgs = []
            async for msg in router.generate(ids_request(max_tokens=100, ignore_eos=True),
                                             deadline=router.clock() + 1.0):
                msgs.append(msg)  # 5 tokens from the crashing replica, then a wait for the busy one
            await occupier.aclose()
            return msgs

        msgs = asyncio.run_coroutine_threadsafe(scenario(), server._loop).result(30)
        assert msgs[-1].HasField("final"), msgs[-1]
        assert msgs[-1].final.finish_reason == common_pb2.FINISH_REASON_DEADLINE
        assert sum(len(m.chunk.token_ids) for m in msgs[:-1]) == msgs[-1].final.usage.completion_tokens == 5
    finally:
        server.stop()
        steady.stop(grace=0)
        crashing.stop(grace=0)


def test_replica_removed_without_drain_just_after_binding_fails_over(tiny_checkpoint):
    """A request bound to a replica that was then removed without drain (its channel closed) before
    the call started escaped as UNKNOWN ('Channel is closed') instead of failing over."""
    import asyncio

    replicas = [ReplicaServer(PacedEngine.from_pretrained(tiny_checkpoint, tokens_per_s=2000, max_context=CONTEXT))
                for _ in range(2)]
    for r in replicas:
        r.start()
    server = RouterServer(model_name="tiny")
    server.start()
    router = server.router

    async def scenario(ticks: int):
        for r in replicas:
            if r.address not in router.pool.replicas:
                router.add_replica(r.address)
        while sum(h.healthy for h in router.pool.replicas.values()) < 2:
            await asyncio.sleep(0.01)
        first = router.generate(ids_request(max_tokens=10_000, ignore_eos=True))
        await first.__anext__()
        doomed = next(h for h in router.pool.replicas.values() if h.router_running)
        second = router.generate(ids_request(max_tokens=10_000, ignore_eos=True))
        await second.__anext__()  # both replicas busy now

        async def collect():
            return [m async for m in router.generate(ids_request(max_tokens=5))]

        queued = asyncio.ensure_future(collect())
        while router.dispatcher.depth() == 0:
            await asyncio.sleep(0.001)
        await first.aclose()  # the queued request is bound to `doomed`...
        while router.dispatcher.depth() > 0:
            await asyncio.sleep(0)
        for _ in range(ticks):
            await asyncio.sleep(0)
        await router.remove_replica(doomed.address, drain=False)  # ...which goes away at once
        await second.aclose()  # the other replica frees: the request fails over there
        return await asyncio.wait_for(queued, 10)

    try:
        for ticks in range(6):
            msgs = asyncio.run_coroutine_threadsafe(scenario(ticks), server._loop).result(30)
            assert msgs[-1].final.usage.completion_tokens == 5, f"after {ticks} loop steps: {msgs[-1]}"
    finally:
        server.stop()
        for r in replicas:
            r.stop(grace=0)


class _BusyAtFirst(PacedEngine):
    """Refuses its first `refusals` generations with EngineBusy (the replica answers
    RESOURCE_EXHAUSTED: the router lost a race for the last slot), then serves."""

    def __init__(self, *args, refusals: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.refusals = refusals

    def generate(self, prompt_ids, params):
        from replicas.engine import EngineBusy

        if self.refusals > 0:
            self.refusals -= 1
            raise EngineBusy("slot taken by another router")
        return super().generate(prompt_ids, params)


def test_lost_slot_races_do_not_count_as_replica_failures(tiny_checkpoint, monkeypatch):
    """Each RESOURCE_EXHAUSTED retry was counted as a failover attempt, so after 8 lost races
    the first real replica failure gave up with UNAVAILABLE instead of failing over."""
    import asyncio

    from replicas import server_servicer
    from replicas.model import ModelConfig

    monkeypatch.setattr(server_servicer, "HEARTBEAT_S", 0.05)  # retries wait for a load report

    config = ModelConfig.from_pretrained(tiny_checkpoint)
    steady = ReplicaServer(PacedEngine(config, tokens_per_s=2000, max_context=CONTEXT))
    contended = ReplicaServer(_BusyAtFirst(config, tokens_per_s=2000, max_context=CONTEXT, fail_after=3,
                                           refusals=8))
    steady.start()
    contended.start()
    server = RouterServer([steady.address], model_name="tiny")
    server.start()
    try:
        server.wait_ready()
        router = server.router

        async def scenario():
            holder = router.generate(ids_request(max_tokens=10_000, ignore_eos=True))
            await holder.__anext__()  # the steady replica is busy: the request goes to the contended one
            router.add_replica(contended.address)
            while sum(h.healthy for h in router.pool.replicas.values()) < 2:
                await asyncio.sleep(0.01)
            request = asyncio.ensure_future(
                asyncio.wait_for(_collect(router.generate(ids_request(max_tokens=10))), 20))
            while not request.done() and not contended.servicer.engine.started:
                await asyncio.sleep(0.001)  # lost 8 races for its slot, then got it...
            await asyncio.sleep(0.05)  # ...and it failed after 3 tokens: free the steady replica
            await holder.aclose()
            out = await request
            return out

        msgs = asyncio.run_coroutine_threadsafe(scenario(), server._loop).result(30)
        assert msgs[-1].final.usage.completion_tokens == 10
        assert sum(len(m.chunk.token_ids) for m in msgs[:-1]) == 10
    finally:
        server.stop()
        steady.stop(grace=0)
        contended.stop(grace=0)


async def _collect(gen):
    return [m async for m in gen]


def test_max_tokens_beyond_the_context_is_not_taken_at_face_value(one_slot_router):
    """A request may ask for more tokens than its context window leaves room for (it just ends
    with LENGTH when the window is full). Admission used to estimate its work from max_tokens,
    so max_tokens=1e6 with a 5 s deadline was refused though it needs ~1 s."""
    import asyncio

    router = one_slot_router.router
    handle = next(iter(router.pool.replicas.values()))

    async def scenario():
        await _collect(router.generate(ids_request(max_tokens=50, ignore_eos=True)))
        while not (handle.load and handle.load.tpot_ewma_ms > 0 and not handle.router_running):
            await asyncio.sleep(0.01)  # the replica has measured its speed (~0.5 ms/token)
        holder = router.generate(ids_request(max_tokens=100, ignore_eos=True))
        await holder.__anext__()  # busy: the next request goes through admission
        holding = asyncio.ensure_future(_collect(holder))
        msgs = await _collect(router.generate(ids_request(max_tokens=1_000_000, ignore_eos=True),
                                              deadline=router.clock() + 5.0))
        await holding
        return msgs

    msgs = asyncio.run_coroutine_threadsafe(scenario(), one_slot_router._loop).result(30)
    assert msgs[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].final.usage.completion_tokens == CONTEXT - 2  # the window filled up


def test_abort_while_the_prompt_is_being_tokenized(tiny_checkpoint):
    """Abort(request_id) answered found=False while a long prompt was still being tokenized, and
    the request then ran to the end anyway."""
    import asyncio

    from router.detokenizer import OFF_LOOP_CHARS

    replica = ReplicaServer(PacedEngine.from_pretrained(tiny_checkpoint, tokens_per_s=2000, max_context=65_536))
    replica.start()
    server = RouterServer([replica.address], tokenizer=tiny_checkpoint, model_name="tiny")
    server.start()
    try:
        server.wait_ready()
        router = server.router
        text = ("a long agent transcript " * OFF_LOOP_CHARS)[:2 * OFF_LOOP_CHARS]  # tokenized off the loop

        async def scenario():
            request = inference_pb2.GenerateRequest(text=text, request_id="abort-me",
                                                    sampling=common_pb2.SamplingParams(max_tokens=50))
            running = asyncio.ensure_future(_collect(router.generate(request)))
            await asyncio.sleep(0)  # it has started: its prompt is being tokenized in a thread
            return router.abort("abort-me"), await running

        found, msgs = asyncio.run_coroutine_threadsafe(scenario(), server._loop).result(30)
        assert found
        assert msgs[-1].final.finish_reason == common_pb2.FINISH_REASON_CANCELLED
        assert msgs[-1].final.usage.completion_tokens == 0
    finally:
        server.stop()
        replica.stop(grace=0)


def test_no_token_ids_past_a_stop_string(tiny_checkpoint):
    """A replica sends the tokens that piled up behind a slow reader in one chunk; when a stop
    string ended inside such a chunk, the tokens after it still went out as token_ids and were
    counted in usage (how many depended on timing). Now the output ends at the stop's token."""
    from router.detokenizer import TextTokenizer

    tok = TextTokenizer.from_pretrained(tiny_checkpoint)
    replica = ReplicaServer(PacedEngine.from_pretrained(tiny_checkpoint, tokens_per_s=1e6, max_context=CONTEXT))
    replica.start()
    server = RouterServer([replica.address], tokenizer=tiny_checkpoint, model_name="tiny")
    server.start()
    try:
        server.wait_ready()
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(server.address))
        request = inference_pb2.GenerateRequest(text="hello naïve world", stop=["e"],
                                                sampling=common_pb2.SamplingParams(max_tokens=500, ignore_eos=True))
        for _ in range(5):
            msgs = list(stub.Generate(request, timeout=10))
            ids = [t for m in msgs[:-1] for t in m.chunk.token_ids]
            assert msgs[-1].final.finish_reason == common_pb2.FINISH_REASON_STOP
            assert "e" in tok.decode(ids) and "e" not in tok.decode(ids[:-1]), ids
            assert msgs[-1].final.usage.completion_tokens == len(ids) == 15
    finally:
        server.stop()
        replica.stop(grace=0)
