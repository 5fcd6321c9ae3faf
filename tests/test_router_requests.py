"""Malformed requests get INVALID_ARGUMENT with a message; random requests never crash the router
(always a status or a valid stream: chunks, then exactly one Final)."""

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from monoserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

from replicas.server import ReplicaServer
from replicas.testing import PacedEngine
from router.server import RouterServer

VOCAB, CONTEXT = 2048, 256  # the tiny checkpoint's vocabulary; a short window


@pytest.fixture(scope="module")
def router(tiny_checkpoint):
    replica = ReplicaServer(PacedEngine.from_pretrained(tiny_checkpoint, tokens_per_s=20_000, max_context=CONTEXT))
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


def run(stub, req, timeout=5.0):
    msgs = list(stub.Generate(req, timeout=timeout))
    assert msgs and msgs[-1].HasField("final") and all(m.HasField("chunk") for m in msgs[:-1])
    return msgs


def refused(stub, req) -> str:
    with pytest.raises(grpc.RpcError) as err:
        run(stub, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


@pytest.mark.parametrize("req, says", [
    (inference_pb2.GenerateRequest(), "no prompt"),
    (inference_pb2.GenerateRequest(text=""), "empty"),
    (ids_request(ids=()), "empty"),
    (inference_pb2.GenerateRequest(chat=inference_pb2.ChatMessages()), "no messages"),
    (inference_pb2.GenerateRequest(model="gpt-9", text="hi"), "unknown model 'gpt-9'"),
    (ids_request(ids=(5, VOCAB)), f"token id {VOCAB} is outside the vocabulary"),
    (ids_request(ids=(-1,)), "token id -1"),
    (ids_request(ids=[7] * CONTEXT), "context window"),
    (ids_request(max_tokens=0), "max_tokens must be >= 1"),
    (ids_request(temperature=-0.5), "temperature"),
    (ids_request(temperature=math.nan), "temperature"),
    (ids_request(top_p=0.0), "top_p"),
    (ids_request(top_p=1.5), "top_p"),
    (ids_request(top_k=-3), "top_k"),
    (ids_request(seed=-1), "seed"),
    (ids_request(stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
    (inference_pb2.GenerateRequest(text="hi", stop=[""]), "stop"),
])
def test_malformed_request_is_invalid_argument_with_a_message(stub, req, says):
    assert says in refused(stub, req)


def _raw_generate(channel, payload: bytes):
    call = channel.unary_stream("/monoserve.v1.Inference/Generate", request_serializer=lambda b: b,
                                response_deserializer=inference_pb2.GenerateResponse.FromString)
    return list(call(payload, timeout=5))


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff\xff",  # not protobuf at all
    b"\x1a\x02\xc3\x28",  # field 3 (text) holding invalid UTF-8
    b"\x22\x05\x0a\x03\x01",  # token_ids truncated
])
def test_garbage_bytes_are_invalid_argument(router, payload):
    with pytest.raises(grpc.RpcError) as err:
        _raw_generate(router[1], payload)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid monoserve.v1.GenerateRequest" in err.value.details()


def test_router_still_serves_after_bad_requests(stub):
    msgs = run(stub, ids_request(max_tokens=4))
    assert msgs[-1].final.usage.completion_tokens == 4


def test_chat_prompt_is_rendered_with_the_checkpoint_template(stub):
    req = inference_pb2.GenerateRequest(chat=inference_pb2.ChatMessages(
        messages=[inference_pb2.ChatMessage(role="user", content="hello")]),
        sampling=common_pb2.SamplingParams(max_tokens=3))
    msgs = run(stub, req)
    assert msgs[-1].final.usage.prompt_tokens > 2  # template tokens around "hello"


def test_stop_string_ends_the_stream(stub):
    # find the text the model produces, then ask it to stop at a piece of it
    full = "".join(m.chunk.text for m in run(stub, ids_request(max_tokens=30))[:-1])
    stop = full[10:13]
    if not stop.strip() or stop in full[:10]:
        pytest.skip("no usable stop string in this output")
    req = ids_request(max_tokens=30)
    req.stop.append(stop)
    msgs = run(stub, req)
    final = msgs[-1].final
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP and final.matched_stop == stop
    assert "".join(m.chunk.text for m in msgs[:-1]) == full[:full.index(stop)]


ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}

sampling = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.integers(-5, 40), temperature=st.one_of(st.floats(-1, 3), st.just(math.inf)),
    top_p=st.floats(-0.5, 1.5), top_k=st.integers(-2, 600), seed=st.integers(-3, 2**63 - 1),
    stop_token_ids=st.lists(st.integers(-1, VOCAB + 1), max_size=3), ignore_eos=st.booleans())
inputs = st.one_of(
    st.builds(lambda ids: {"token_ids": inference_pb2.TokenIds(ids=ids)},
              st.lists(st.integers(-2, VOCAB + 2), max_size=CONTEXT + 5)),
    st.builds(lambda t: {"text": t}, st.text(max_size=200)),
    st.builds(lambda ms: {"chat": inference_pb2.ChatMessages(messages=[
        inference_pb2.ChatMessage(role=r, content=c) for r, c in ms])},
        st.lists(st.tuples(st.sampled_from(["user", "assistant", "system", "tool", "bogus"]), st.text(max_size=40)),
                 max_size=3)),
    st.just({}),
)
requests = st.builds(
    lambda inp, s, model, stop: inference_pb2.GenerateRequest(sampling=s, model=model, stop=stop, **inp),
    inputs, sampling, st.sampled_from(["", "tiny", "other"]), st.lists(st.text(max_size=5), max_size=3))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests)
def test_random_requests_get_a_status_or_a_valid_stream(stub, req):
    try:
        msgs = run(stub, req)
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, f"{e.code()}: {e.details()}"
        assert e.details()
        return
    final = msgs[-1].final
    ids = [t for m in msgs[:-1] for t in m.chunk.token_ids]
    assert final.usage.completion_tokens == len(ids) <= max(req.sampling.max_tokens, 16)
    assert all(0 <= t < VOCAB for t in ids)
    assert final.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=64))
def test_random_bytes_never_crash_the_router(router, payload):
    try:
        msgs = _raw_generate(router[1], payload)
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, f"{e.code()}: {e.details()}"
        return
    assert msgs[-1].HasField("final")
