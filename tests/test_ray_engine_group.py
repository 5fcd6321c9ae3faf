"""EngineGroup: a replica's per-GPU-group engines served as one engine (CPU, paced engines)."""

import threading

import pytest

from replicas.actor import engines_per_gpu_group
from replicas.engine import EngineBusy, FinishReason, SamplingParams, accepts_session_id
from replicas.engine_group import EngineGroup
from replicas.testing import PacedEngine


def group(n=2, **kw):
    return EngineGroup([PacedEngine(tokens_per_s=2000, **kw) for _ in range(n)])


def test_slots_add_up_and_generations_spread_over_members():
    g = group(2)
    assert g.max_batch == 2 and g.kind == "paced" and accepts_session_id(g)
    a = g.generate([1, 2], SamplingParams(max_tokens=3))
    b = g.generate([1, 2], SamplingParams(max_tokens=3))
    assert g._active == [1, 1]
    with pytest.raises(EngineBusy, match="all 2 generation slots"):
        g.generate([1], SamplingParams(max_tokens=1))
    assert list(a) == list(PacedEngine(tokens_per_s=2000).generate([1, 2], SamplingParams(max_tokens=3)))
    assert a.finish_reason is FinishReason.LENGTH
    assert g._active == [0, 1]  # finishing frees the member's slot
    b.close()  # closed without being iterated: freed too
    assert g._active == [0, 0]


def test_cancel_reaches_the_member_engine():
    g = group(1, max_batch=1)
    gen = g.generate([5], SamplingParams(max_tokens=10_000, ignore_eos=True))
    tokens = []
    t = threading.Thread(target=lambda: tokens.extend(gen))
    t.start()
    while not tokens:
        pass
    gen.cancel()
    t.join(timeout=5)
    assert not t.is_alive() and gen.finish_reason is FinishReason.CANCELLED
    assert g._active == [0]


def test_session_prefers_the_member_that_served_it():
    g = group(3)
    held = g.generate([1], SamplingParams(max_tokens=1))  # member 0 busy
    list(g.generate([1], SamplingParams(max_tokens=1), session_id="s"))  # -> member 1
    held.close()
    assert g._sessions["s"] == 1 and g._active == [0, 0, 0]
    again = g.generate([1, 9], SamplingParams(max_tokens=1), session_id="s")  # all idle: sticky wins
    assert g._active == [0, 1, 0]
    again.close()


def test_one_engine_per_tensor_parallel_group():
    loaded = []

    def load(devices):
        loaded.append(devices)
        return PacedEngine(tokens_per_s=1000)

    engine = engines_per_gpu_group(load, list(range(8)), 8)
    assert isinstance(engine, PacedEngine) and loaded == [list(range(8))]
    loaded.clear()
    engine = engines_per_gpu_group(load, list(range(8)), 2)
    assert isinstance(engine, EngineGroup) and engine.max_batch == 4
    assert sorted(loaded) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the 8 GPUs"):
        engines_per_gpu_group(load, list(range(8)), 3)


def test_a_group_of_session_engines_reports_reuse_and_summed_session_stats(tiny_checkpoint):
    import grpc
    import numpy as np
    from monoserve.v1 import common_pb2, replica_pb2, replica_pb2_grpc

    from replicas.reference import ReferenceEngine
    from replicas.server import ReplicaServer

    members = [ReferenceEngine.from_pretrained(tiny_checkpoint, max_sessions=3, session_cache_bytes=2**20)
               for _ in range(2)]
    g = EngineGroup(members)
    assert not hasattr(group(2), "session_stats")  # members without sessions: none offered
    server = ReplicaServer(g)
    server.start()
    try:
        def ask(ids, sid):
            req = replica_pb2.ReplicaGenerateRequest(prompt_token_ids=ids, session_id=sid,
                                                     sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
            with grpc.insecure_channel(server.address) as ch:
                msgs = list(replica_pb2_grpc.ReplicaStub(ch).Generate(req, timeout=30))
            return [t for m in msgs[:-1] for t in m.chunk.token_ids], msgs[-1].final

        prompt = np.random.default_rng(0).integers(3, 2000, 200).tolist()
        out, first = ask(prompt, "agent")
        new = [7, 8, 9]
        _, second = ask(prompt + out + new, "agent")
        assert first.usage.cached_prompt_tokens == 0
        assert second.usage.cached_prompt_tokens == len(prompt) + len(out) - 1  # the wrapper passes it on
        gen = g.generate(prompt + [11], SamplingParams(max_tokens=1), session_id="direct")
        list(gen)
        assert gen.reused_tokens == 0

        per_member = [m.session_stats() for m in members]
        total = g.session_stats()
        assert (total.hits, total.misses) == (1, 2) == (sum(s.hits for s in per_member),
                                                        sum(s.misses for s in per_member))
        assert total.sessions == 2 and total.bytes == sum(s.bytes for s in per_member) > 0
        assert (total.max_sessions, total.max_bytes) == (6, 2 * 2**20)
        load = server.load().session_cache  # what the router and metrics see
        assert (load.hits, load.reused_tokens, load.max_sessions) == (1, second.usage.cached_prompt_tokens, 6)
    finally:
        server.stop(grace=0)
