"""Property test: any request to a replica gets a well-formed stream or INVALID_ARGUMENT, never a crash."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from monoserve.v1 import common_pb2, replica_pb2, replica_pb2_grpc

from replicas.server import ReplicaServer
from replicas.testing import PacedEngine

VOCAB, CONTEXT = 512, 64


@pytest.fixture(scope="module")
def replica():
    engine = PacedEngine(tokens_per_s=100_000, max_batch=4, max_context=CONTEXT)
    server = ReplicaServer(engine)
    server.start()
    channel = grpc.insecure_channel(server.address)
    yield server, channel
    channel.close()
    server.stop(grace=0.5)


token = st.integers(min_value=-5, max_value=VOCAB + 5)
sampling = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.one_of(st.none(), st.integers(-3, 40)),
    temperature=st.one_of(st.floats(-1, 3), st.sampled_from([0.0, float("nan"), float("inf"), 1e9])),
    top_p=st.one_of(st.none(), st.floats(-0.5, 1.5), st.just(float("nan"))),
    top_k=st.integers(-2, VOCAB + 10),
    seed=st.one_of(st.none(), st.integers(-10, 2**63 - 1)),
    stop_token_ids=st.lists(token, max_size=3),
    ignore_eos=st.booleans(),
)
request = st.builds(replica_pb2.ReplicaGenerateRequest, prompt_token_ids=st.lists(token, max_size=CONTEXT + 4),
                    sampling=sampling)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=request)
def test_random_requests_stream_or_invalid_argument(replica, req):
    _, channel = replica
    stub = replica_pb2_grpc.ReplicaStub(channel)
    tokens, final = [], None
    try:
        for msg in stub.Generate(req, timeout=10):
            assert final is None, "a message after the final one"
            if msg.HasField("chunk"):
                tokens.extend(msg.chunk.token_ids)
            else:
                final = msg.final
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert e.details(), "an error without a message"
        event("invalid: " + e.details().split(":")[0][:40])
        return
    event("served")
    assert final is not None and final.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert all(0 <= t < VOCAB for t in tokens)
    max_tokens = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else 16
    assert len(tokens) == final.usage.completion_tokens <= min(max_tokens, CONTEXT - len(req.prompt_token_ids))
    assert not set(tokens) & set(req.sampling.stop_token_ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64))
def test_random_bytes_never_crash_the_server(replica, raw):
    server, channel = replica
    call = channel.unary_stream("/monoserve.v1.Replica/Generate")
    try:
        list(call(raw, timeout=10))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    assert server.load().healthy and server.load().busy_slots <= 4
