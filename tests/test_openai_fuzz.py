"""Fuzzing the OpenAI HTTP endpoints with generated bodies: whatever arrives, the answer is a
200 or a 4xx in OpenAI's error shape (never a 500 or a dropped connection), and the server keeps
serving. Real RouterServer + a fast PacedEngine replica on loopback."""

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicas.server import ReplicaServer
from replicas.testing import PacedEngine
from router.server import RouterServer

json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def field(valid):
    """A field value: usually valid, sometimes any JSON at all."""
    return st.one_of(valid, valid, json_values)


message = st.fixed_dictionaries({"role": field(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
                                 "content": field(st.text(max_size=20))})
common = {
    "max_tokens": field(st.integers(1, 4)), "temperature": field(st.floats(0, 2)), "top_p": field(st.floats(0.01, 1)),
    "seed": field(st.integers(0, 2**40)), "stop": field(st.text(min_size=1, max_size=3) | st.lists(st.text(max_size=3),
                                                                                                max_size=3)),
    "stream": field(st.booleans()), "n": field(st.just(1)), "user": field(st.text(max_size=5)),
    "bogus_field": json_values,
}


def body(required):
    return st.fixed_dictionaries({"model": field(st.just("MODEL")), **required},
                                 optional=common).map(lambda d: d)


completions = body({"prompt": field(st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 2047), min_size=1,
                                                                                max_size=5))})
chats = body({"messages": field(st.lists(message, min_size=1, max_size=3))})


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    replica = ReplicaServer(PacedEngine.from_pretrained(tiny_checkpoint, tokens_per_s=20000, max_batch=4))
    replica.start()
    router = RouterServer([replica.address], http_port=0, tokenizer=tiny_checkpoint)
    router.start()
    router.wait_ready(1)
    with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}/v1", timeout=20) as client:
        yield client, tiny_checkpoint.name
    router.stop()
    replica.stop(grace=0)


def check(client, model, path, payload):
    if payload.get("model") == "MODEL":
        payload["model"] = model
    r = client.post(path, json=payload)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text, payload)
    if r.status_code != 200:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"] == "invalid_request_error"
    elif payload.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["usage"]["completion_tokens"] >= 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=completions)
def test_fuzzed_completion_bodies(server, payload):
    client, model = server
    check(client, model, "/completions", payload)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=chats)
def test_fuzzed_chat_bodies(server, payload):
    client, model = server
    check(client, model, "/chat/completions", payload)


def test_still_serving_after_fuzzing(server):
    client, model = server
    r = client.post("/chat/completions", json={"model": model, "max_tokens": 3,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
