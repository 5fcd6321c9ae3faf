"""Agent sessions through the OpenAI-compatible HTTP API: the real `openai` client against a real
RouterServer and a ReplicaServer running the reference engine on loopback. A conversation's turns
with one `session_id` (body field or X-Session-Id header) reuse its KV, report it as
`usage.prompt_tokens_details.cached_tokens`, and produce exactly what a fresh request produces."""

import httpx
import openai
import pytest

from replicas.reference import ReferenceEngine
from replicas.server import ReplicaServer
from router.server import RouterServer

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    replica = ReplicaServer(ReferenceEngine.from_pretrained(tiny_checkpoint))
    replica.start()
    router = RouterServer([replica.address], http_port=0, tokenizer=tiny_checkpoint)
    router.start()
    router.wait_ready(1)
    base_url = f"http://127.0.0.1:{router.http_port}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30) as client:
        yield client, tiny_checkpoint.name, base_url
    router.stop()
    replica.stop(grace=0)


def chat(client, model, messages, session=None, **kw):
    extra = {"extra_body": {"session_id": session}} if session else {}
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, **extra, **kw)
    return r.choices[0].message.content, r.usage


@pytest.mark.parametrize("how", ["body", "header"])
def test_a_two_turn_chat_reuses_the_sessions_kv_and_matches_a_fresh_request(stack, how):
    client, model, _ = stack
    sid = f"conv-{how}"
    ask = (lambda m: chat(client, model, m, sid)) if how == "body" else \
        (lambda m: chat(client, model, m, extra_headers={"X-Session-Id": sid}))
    text1, usage1 = ask(CHAT)
    assert usage1.prompt_tokens_details.cached_tokens == 0
    turn2 = CHAT + [{"role": "assistant", "content": text1}, {"role": "user", "content": "And again?"}]
    text2, usage2 = ask(turn2)
    assert 0 < usage2.prompt_tokens_details.cached_tokens < usage2.prompt_tokens
    fresh, fresh_usage = chat(client, model, turn2)
    assert text2 == fresh and fresh_usage.prompt_tokens_details.cached_tokens == 0
    assert fresh_usage.prompt_tokens == usage2.prompt_tokens


def test_streamed_usage_and_completions_report_cached_tokens(stack):
    client, model, _ = stack
    kw = dict(model=model, max_tokens=6, temperature=0, extra_body={"session_id": "stream-1"})
    first = "".join(c.choices[0].delta.content or "" for c in
                    client.chat.completions.create(messages=CHAT, stream=True, **kw) if c.choices)
    turn2 = CHAT + [{"role": "assistant", "content": first}, {"role": "user", "content": "More."}]
    chunks = list(client.chat.completions.create(messages=turn2, stream=True, stream_options={"include_usage": True},
                                                 **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0

    prompt = list(range(10, 60))
    kw = dict(model=model, max_tokens=4, temperature=0)
    a = client.completions.create(prompt=prompt, extra_body={"session_id": "cmpl-1"}, **kw)
    b = client.completions.create(prompt=prompt + [5, 6, 7], extra_body={"session_id": "cmpl-1"}, **kw)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens >= len(prompt)


def test_the_body_field_wins_over_the_header(stack):
    client, model, _ = stack
    chat(client, model, CHAT, "winner")
    # same prompt again: the session "winner" holds it (cached), a header-only id would be new (0 cached)
    _, usage = chat(client, model, CHAT, "winner", extra_headers={"X-Session-Id": "loser"})
    assert usage.prompt_tokens_details.cached_tokens > 0
    _, usage = chat(client, model, CHAT, extra_headers={"X-Session-Id": "loser"})
    assert usage.prompt_tokens_details.cached_tokens == 0  # "loser" was never used before


def test_bad_session_ids_are_400_naming_the_field(stack):
    client, model, base_url = stack
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, CHAT, "x" * 257)
    assert e.value.body["param"] == "session_id" and "257 characters" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, CHAT, extra_headers={"X-Session-Id": "y" * 300})
    assert e.value.body["param"] == "session_id" and "header X-Session-Id" in e.value.body["message"]
    r = httpx.post(f"{base_url}/completions", json={"model": model, "prompt": "hi", "session_id": 7}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "session_id" and error["type"] == "invalid_request_error"
    assert "string" in error["message"]
    _, usage = chat(client, model, CHAT, "z" * 256)  # the limit itself is fine
    assert usage.completion_tokens > 0
