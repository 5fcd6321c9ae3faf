"""The OpenAI-compatible HTTP API under bad input, overload, missing replicas, deadlines and
client disconnects: real RouterServer + ReplicaServers (PacedEngine: known speed) on loopback.
Every error is OpenAI's JSON shape with the status a client library acts on, and the server
keeps serving afterwards."""

import json
import threading
import time

import grpc
import httpx
import openai
import pytest
from monoserve.v1 import admin_pb2, admin_pb2_grpc

from replicas.server import ReplicaServer
from replicas.testing import PacedEngine
from router.server import RouterServer


class Stack:
    def __init__(self, checkpoint, replicas=1, engine_kw=None, **router_kw):
        self.replicas = [ReplicaServer(PacedEngine.from_pretrained(checkpoint, **(engine_kw or {})))
                         for _ in range(replicas)]
        for r in self.replicas:
            r.start()
        self.router = RouterServer([r.address for r in self.replicas], http_port=0, tokenizer=checkpoint,
                                   **router_kw)
        self.router.start()
        if replicas:
            self.router.wait_ready(replicas)
        self.url = f"http://127.0.0.1:{self.router.http_port}/v1"
        self.model = checkpoint.name
        self.channel = grpc.insecure_channel(self.router.address)
        self.admin = admin_pb2_grpc.RouterAdminStub(self.channel)

    def busy(self) -> int:
        """Requests running on replicas, as the router's admin API reports them."""
        listing = self.admin.ListReplicas(admin_pb2.ListReplicasRequest(), timeout=5)
        return sum(r.router_running + r.load.busy_slots for r in listing.replicas)

    def wait_idle(self, timeout=3.0) -> float:
        t0 = time.monotonic()
        while self.busy():
            assert time.monotonic() - t0 < timeout, "the generation was not aborted"
            time.sleep(0.01)
        return time.monotonic() - t0

    def ok(self) -> dict:
        r = httpx.post(f"{self.url}/completions", json={"model": self.model, "prompt": "hi", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def close(self):
        self.channel.close()
        self.router.stop()
        for r in self.replicas:
            r.stop(grace=0)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    # one slot, no queue: a second concurrent request is refused with 429 at once
    s = Stack(tiny_checkpoint, engine_kw={"tokens_per_s": 100}, queue_size=0)
    yield s
    s.close()


def assert_openai_error(r: httpx.Response, status: int, fragment: str, type_=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"], err["message"]
    if type_:
        assert err["type"] == type_
    if param:
        assert err["param"] == param


def post(stack, path, body=None, content=None, headers=None):
    kw = {"json": body} if content is None else {"content": content}
    return httpx.post(f"{stack.url}{path}", headers=headers, timeout=10, **kw)


def test_bad_requests_get_400_naming_the_problem_and_the_server_keeps_serving(stack):
    m = stack.model
    cases = [
        ("/completions", None, b"{not json", "not valid JSON", None),
        ("/completions", None, b"[1, 2]", "must be a JSON object", None),
        ("/completions", None, b"", "body is empty", None),
        ("/completions", None, b'{"model": "%s", "prompt": "x", "temperature": NaN}' % m.encode(), "not valid JSON",
         None),
        ("/completions", None, b"\xff\xfe{}", "not valid JSON", None),
        ("/completions", None, b"[" * 100_000, "not valid JSON", None),  # nesting deeper than the parser goes
        ("/completions", None, b'{"model": "m", "prompt": "x", "seed": 1%s}' % (b"0" * 5000), "not valid JSON",
         None),
        ("/completions", {"model": m, "prompt": "x", "max_tokens": "5"}, None, "valid integer", "max_tokens"),
        ("/completions", {"model": m, "prompt": "x", "max_token": 5}, None, "unknown field `max_token`", "max_token"),
        ("/completions", {"model": m}, None, "`prompt` is required", "prompt"),
        ("/completions", {"model": m, "prompt": {"text": "x"}}, None, "wrong type", "prompt"),
        ("/completions", {"model": m, "prompt": "x", "stop": [""]}, None, "empty", None),
        ("/completions", {"model": m, "prompt": [5] * 3000}, None, "context window", None),
        ("/completions", {"model": m, "prompt": "x", "max_tokens": 0}, None, "greater than or equal to 1",
         "max_tokens"),
        ("/chat/completions", {"model": m, "messages": [{"role": "bot", "content": "x"}]}, None, "'user'",
         "messages[0].role"),
        ("/chat/completions", {"model": m, "messages": "hello"}, None, "valid list", "messages"),
        ("/chat/completions", {"model": m, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         None, "text only", "messages"),
        ("/chat/completions", {"model": m, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, None,
         "valid boolean", "stream"),
    ]
    for path, body, raw, fragment, param in cases:
        assert_openai_error(post(stack, path, body, raw), 400, fragment, "invalid_request_error", param)
    r = post(stack, "/completions", {"model": m, "prompt": "x"}, headers={"X-Request-Timeout": "soon"})
    assert_openai_error(r, 400, "X-Request-Timeout")
    assert stack.ok()["choices"][0]["finish_reason"] == "length"


def test_huge_bodies_get_413_and_the_server_keeps_serving(stack):
    big = json.dumps({"model": stack.model, "prompt": "x" * (5 * 1024 * 1024)}).encode()
    assert_openai_error(post(stack, "/completions", content=big), 413, "larger than")

    def chunked():  # no Content-Length: the cap applies while reading
        for _ in range(6):
            yield b" " * (1024 * 1024)

    assert_openai_error(post(stack, "/completions", content=chunked()), 413, "larger than")
    stack.ok()


def test_unknown_paths_methods_and_models(stack):
    assert_openai_error(httpx.get(f"{stack.url}/engines"), 404, "no such endpoint")
    assert_openai_error(httpx.get(f"{stack.url}/chat/completions"), 405, "not allowed")
    r = post(stack, "/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(r, 404, "does not exist", "invalid_request_error", "model")
    assert r.json()["error"]["code"] == "model_not_found"


def test_overload_is_429_with_retry_after_and_a_disconnect_frees_the_slot(stack):
    body = {"model": stack.model, "prompt": "hi", "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", f"{stack.url}/completions", json=body, timeout=10) as long:
        assert long.status_code == 200
        lines = long.iter_lines()  # keep a reference: a dropped iterator closes the stream
        next(lines)  # generating: the only slot is taken
        r = post(stack, "/completions", {"model": stack.model, "prompt": "hi", "max_tokens": 2})
        assert_openai_error(r, 429, "queue is full", "rate_limit_error")
        assert int(r.headers["Retry-After"]) >= 1
        with openai.OpenAI(base_url=stack.url, api_key="x", max_retries=0) as client:
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=stack.model, prompt="hi", max_tokens=2)
    # leaving the `with` closed the connection mid-stream: the generation must stop
    assert stack.wait_idle() < 1.0
    stack.ok()


def test_disconnect_aborts_a_non_streaming_request(stack):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/chat/completions", timeout=0.5,
                   json={"model": stack.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000})
    assert stack.wait_idle() < 1.0
    stack.ok()


def test_openai_client_stream_closed_early_aborts(stack):
    with openai.OpenAI(base_url=stack.url, api_key="x", max_retries=0) as client:
        stream = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=5000, stream=True)
        got = [c for _, c in zip(range(3), stream)]
        stream.close()
    assert len(got) == 3
    assert stack.wait_idle() < 1.0


def test_no_replica_is_503(tiny_checkpoint):
    s = Stack(tiny_checkpoint, replicas=0)
    try:
        r = post(s, "/completions", {"model": s.model, "prompt": "hi"})
        assert_openai_error(r, 503, "replica", "service_unavailable_error")
    finally:
        s.close()


def test_deadline_before_the_first_token_is_504(tiny_checkpoint):
    s = Stack(tiny_checkpoint, engine_kw={"tokens_per_s": 100, "prefill_s": 1.0})
    try:
        t0 = time.monotonic()
        r = post(s, "/completions", {"model": s.model, "prompt": "hi", "max_tokens": 2},
                 headers={"X-Request-Timeout": "0.2"})
        assert_openai_error(r, 504, "deadline", "timeout_error")
        assert time.monotonic() - t0 < 0.9
        ok = post(s, "/completions", {"model": s.model, "prompt": "hi", "max_tokens": 2},
                  headers={"X-Request-Timeout": "5"})
        assert ok.status_code == 200
    finally:
        s.close()


def test_concurrent_clients_on_two_replicas(tiny_checkpoint):
    s = Stack(tiny_checkpoint, replicas=2, engine_kw={"tokens_per_s": 500})
    try:
        results = [None] * 4

        def one(i):
            results[i] = post(s, "/completions", {"model": s.model, "prompt": f"p{i}", "max_tokens": 20})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200] * 4
        assert all(r.json()["usage"]["completion_tokens"] == 20 for r in results)
    finally:
        s.close()


def test_deadline_after_output_began_keeps_the_partial_output(tiny_checkpoint):
    s = Stack(tiny_checkpoint, engine_kw={"tokens_per_s": 50})
    try:
        r = post(s, "/completions", {"model": s.model, "prompt": "hi", "max_tokens": 1000},
                 headers={"X-Request-Timeout": "0.4"})
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert choice["finish_reason"] == "length"
        assert 5 <= usage["completion_tokens"] <= 30 and choice["text"]
    finally:
        s.close()


def test_replica_failure_mid_stream_ends_the_stream_with_an_error_event(tiny_checkpoint):
    s = Stack(tiny_checkpoint, engine_kw={"tokens_per_s": 500, "fail_after": 3})
    try:
        with openai.OpenAI(base_url=s.url, api_key="x", max_retries=0) as client:
            stream = client.completions.create(model=s.model, prompt="hi", max_tokens=50, stream=True)
            texts = []
            with pytest.raises(openai.APIError, match="replica"):
                for chunk in stream:
                    texts.append(chunk.choices[0].text)
        assert texts, "the tokens produced before the failure were delivered"
    finally:
        s.close()


def test_router_shutdown_ends_open_streams_with_an_error_event(tiny_checkpoint):
    s = Stack(tiny_checkpoint, engine_kw={"tokens_per_s": 50})
    got = {}

    def read():
        with httpx.stream("POST", f"{s.url}/completions", timeout=30,
                          json={"model": s.model, "prompt": "hi", "max_tokens": 1000, "stream": True}) as r:
            got["lines"] = [line for line in r.iter_lines() if line]

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    s.close()
    reader.join(10)
    assert time.monotonic() - t0 < 6
    assert len(got["lines"]) > 3
    last = json.loads(got["lines"][-1].removeprefix("data: "))
    assert last["error"]["type"] == "service_unavailable_error" and "shutting down" in last["error"]["message"]
