"""Agent sessions across the serving path: the router's affinity rule (pure policy, fakes) and, on
real loopback gRPC, a multi-turn session that stays on the replica holding its KV, prefills only
the new suffix and streams exactly what a fresh full-prompt request streams."""

import time

import grpc
import numpy as np
import pytest
from monoserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc, replica_pb2, replica_pb2_grpc

from replicas.reference import ReferenceEngine
from replicas.server import ReplicaServer
from replicas.testing import PacedEngine
from router.policy import ReplicaState, RequestShape, Snapshot, pick_replica
from router.server import RouterServer

# ---- policy (pure) -----------------------------------------------------------------------------

MS = 0.001


def rep(address, busy=0, capacity=2, **kw):
    kw.setdefault("tpot_s", 10 * MS)
    kw.setdefault("prefill_s_per_token", 0.5 * MS)
    return ReplicaState(address=address, capacity=capacity, busy=busy, **kw)


def pick(replicas, held=None, prompt=4000, exclude=()):
    req = RequestShape(prompt_tokens=prompt, max_tokens=10, session_id="s")
    snap = Snapshot(tuple(replicas), {"s": "sticky"}, {} if held is None else {"s": held})
    return pick_replica(snap, req, now=0.0, exclude=exclude)


def test_affinity_is_worth_the_prefill_of_the_tokens_the_replica_holds():
    # sticky is 1 s busier (100 more tokens x 10 ms) than other
    sticky = rep("sticky", busy=1, tokens_remaining=110)
    other = rep("other", busy=1, tokens_remaining=10)
    assert pick([sticky, other], held=3000) == "sticky"  # saves 3000 x 0.5 ms = 1.5 s > 1 s
    assert pick([sticky, other], held=1000) == "other"  # saves 0.5 s < 1 s
    assert pick([sticky, other]) == "sticky"  # unknown: the whole prompt (the router's first guess)
    assert pick([sticky, other], held=10**6, prompt=2000) == "other"  # reuse is capped by the prompt


def test_a_full_replica_holding_the_session_is_waited_for_only_when_that_pays():
    # one-slot replicas: sticky finishes its current request in 0.5 s, other is idle
    soon = rep("sticky", busy=1, capacity=1, expected_idle_s=0.5)
    idle = rep("other", capacity=1)
    assert pick([soon, idle], held=3900) is None  # 0.5 s wait < 1.95 s of prefill saved: queue for it
    late = rep("sticky", busy=1, capacity=1, expected_idle_s=5.0)
    assert pick([late, idle], held=3900) == "other"
    assert pick([soon, idle], held=100) == "other"  # a short history is not worth waiting for
    overdue = rep("sticky", busy=1, capacity=1, expected_idle_s=0.5, reported_at=-1.0)
    assert pick([overdue, idle], held=3900) == "other"  # its estimate ran out: no telling when it frees


def test_a_sick_draining_or_excluded_session_replica_is_ignored():
    other = rep("other", capacity=1)
    for sticky in (rep("sticky", healthy=False), rep("sticky", draining=True)):
        assert pick([sticky, other], held=3900) == "other"
    assert pick([rep("sticky"), other], held=3900, exclude={"sticky"}) == "other"
    # nothing else available and the session replica full: wait (None), as without sessions
    assert pick([rep("sticky", busy=1, capacity=1, expected_idle_s=60.0)], held=3900) is None


# ---- replica + router on loopback --------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    replicas = [ReplicaServer(ReferenceEngine.from_pretrained(tiny_checkpoint)) for _ in range(2)]
    for r in replicas:
        r.start()
    router = RouterServer([r.address for r in replicas])
    router.start()
    router.wait_ready(2)
    channel = grpc.insecure_channel(router.address)
    yield router, replicas, inference_pb2_grpc.InferenceStub(channel)
    channel.close()
    router.stop()
    for r in replicas:
        r.stop(grace=0)


def ask(stub, ids, session_id="", **sampling):
    req = inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=ids), session_id=session_id,
        sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True, **sampling))
    msgs = list(stub.Generate(req, timeout=30))
    return [t for m in msgs[:-1] for t in m.chunk.token_ids], msgs[-1].final


def settled(router):
    """The router has seen every replica go idle (an agent's think time between turns)."""
    end = time.monotonic() + 5
    while any(h.load is None or h.load.busy_slots for h in router.router.pool.replicas.values()):
        assert time.monotonic() < end, "replicas did not report idle"
        time.sleep(0.005)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "seeded"])
def test_a_three_turn_session_stays_put_reuses_kv_and_matches_fresh_requests(cluster, sampling):
    router, replicas, stub = cluster
    by_id = {r.replica_id: r for r in replicas}
    sid = f"agent-{len(sampling)}"
    prompt = np.random.default_rng(len(sampling)).integers(3, 2000, 600).tolist()
    homes, new = [], []
    for turn in range(3):
        settled(router)
        out, final = ask(stub, prompt, sid, **sampling)
        homes.append(final.replica_id)
        home = by_id[final.replica_id].load().session_cache
        if turn == 0:
            assert final.usage.cached_prompt_tokens == 0 and home.misses >= 1
        else:  # only the new message and the previous turn's last output token were prefilled
            assert final.usage.prompt_tokens - final.usage.cached_prompt_tokens == len(new) + 1
            assert home.hits >= turn and home.reused_tokens >= final.usage.cached_prompt_tokens
        fresh, fresh_final = ask(stub, prompt, **sampling)
        assert out == fresh and fresh_final.usage.cached_prompt_tokens == 0
        new = np.random.default_rng(turn + 100).integers(3, 2000, 25).tolist()
        prompt = prompt + out + new
    assert len(set(homes)) == 1, f"the session moved between replicas: {homes}"
    metrics = by_id[homes[0]].metrics.registry
    assert metrics.get_sample_value("monoserve_replica_session_hits_total") >= 2
    assert metrics.get_sample_value("monoserve_replica_sessions") >= 1


def test_session_ids_are_bounded_and_engines_without_sessions_ignore_them(cluster):
    _, replicas, stub = cluster
    with pytest.raises(grpc.RpcError) as e:
        ask(stub, [5, 6], "x" * 257)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in e.value.details()
    with grpc.insecure_channel(replicas[0].address) as ch:  # the replica refuses it too
        req = replica_pb2.ReplicaGenerateRequest(prompt_token_ids=[5], session_id="y" * 257)
        with pytest.raises(grpc.RpcError) as e:
            list(replica_pb2_grpc.ReplicaStub(ch).Generate(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    paced = ReplicaServer(PacedEngine())  # its generate() has no session_id: served as a plain request
    paced.start()
    try:
        with grpc.insecure_channel(paced.address) as ch:
            req = replica_pb2.ReplicaGenerateRequest(prompt_token_ids=[5], session_id="s",
                                                     sampling=common_pb2.SamplingParams(max_tokens=3))
            msgs = list(replica_pb2_grpc.ReplicaStub(ch).Generate(req, timeout=10))
        assert msgs[-1].final.usage.completion_tokens == 3 and msgs[-1].final.usage.cached_prompt_tokens == 0
        assert not paced.load().HasField("session_cache")
    finally:
        paced.stop(grace=0)


def test_replica_cli_sizes_the_session_cache(tiny_checkpoint):
    import argparse

    from replicas.cli_replica import add_arguments, make_engine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine = make_engine(parser.parse_args(["--model", str(tiny_checkpoint), "--session-cache-mb", "0.5",
                                            "--max-sessions", "3"]))
    stats = engine.session_stats()
    assert (stats.max_bytes, stats.max_sessions) == (2**19, 3)
    with pytest.raises(ValueError, match="max_sessions=-1"):
        make_engine(parser.parse_args(["--model", str(tiny_checkpoint), "--max-sessions", "-1"]))
