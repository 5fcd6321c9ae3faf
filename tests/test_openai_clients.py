"""The OpenAI-compatible HTTP API driven by real third-party clients (the official `openai`
package, plain httpx SSE, grpcio-reflection) against a real RouterServer and real ReplicaServers
running the reference engine on the tiny checkpoint, all on loopback.

Expected outputs come from the reference engine itself (greedy tokens for the same prompt ids),
decoded with the checkpoint's tokenizer: the HTTP layer must neither lose nor alter text.
"""

import json

import grpc
import httpx
import openai
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from replicas.engine import SamplingParams
from replicas.reference import ReferenceEngine
from replicas.server import ReplicaServer
from router.chat import ChatTemplate
from router.detokenizer import TextTokenizer
from router.server import RouterServer

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


class Stack:
    def __init__(self, checkpoint):
        self.replicas = [ReplicaServer(ReferenceEngine.from_pretrained(checkpoint)) for _ in range(2)]
        for r in self.replicas:
            r.start()
        self.router = RouterServer([r.address for r in self.replicas], http_port=0, tokenizer=checkpoint)
        self.router.start()
        self.router.wait_ready(2)
        self.base_url = f"http://127.0.0.1:{self.router.http_port}/v1"
        self.model = checkpoint.name
        self.oracle = ReferenceEngine.from_pretrained(checkpoint)
        self.tok = TextTokenizer.from_pretrained(checkpoint)
        self.template = ChatTemplate.from_pretrained(checkpoint)

    def greedy(self, prompt_ids, max_tokens):
        ids = list(self.oracle.generate(prompt_ids, SamplingParams(max_tokens=max_tokens)))
        return ids, self.tok.decode(ids)

    def chat_ids(self, messages):
        return self.tok.encode(self.template.render(messages), add_special_tokens=False)

    def close(self):
        self.router.stop()
        for r in self.replicas:
            r.stop(grace=0)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    s = Stack(tiny_checkpoint)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models_list_and_retrieve(client, stack):
    models = client.models.list()
    assert [m.id for m in models.data] == [stack.model]
    assert client.models.retrieve(stack.model).id == stack.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_completion_equals_the_engines_greedy_output(client, stack):
    prompt = stack.chat_ids(CHAT)
    ids, text = stack.greedy(prompt, 10)
    r = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ("length" if len(ids) == 10 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(ids))
    assert r.usage.total_tokens == len(prompt) + len(ids)


def test_chat_stream_with_usage_matches_non_streaming(client, stack):
    kw = dict(model=stack.model, messages=CHAT, max_completion_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_text_prompt_and_token_prompt(client, stack):
    prompt = stack.tok.encode("The quick brown fox")
    _, text = stack.greedy(prompt, 12)
    r = client.completions.create(model=stack.model, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == text
    assert r.usage.prompt_tokens == len(prompt)
    r2 = client.completions.create(model=stack.model, prompt=prompt, max_tokens=12, temperature=0)
    assert r2.choices[0].text == text


def test_completion_stream(client, stack):
    _, text = stack.greedy(stack.tok.encode("Once upon"), 12)
    chunks = list(client.completions.create(model=stack.model, prompt="Once upon", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop") and chunks[-1].usage is None


def test_stop_string_cuts_the_output_and_is_reported(client, stack):
    _, text = stack.greedy(stack.tok.encode("Once upon"), 16)
    assert len(text) >= 8, "precondition: the tiny model says enough to pick a stop from"
    stop = text[4:6]
    expected = text[:text.find(stop)]
    kw = dict(model=stack.model, prompt="Once upon", max_tokens=16, temperature=0, stop=[stop, "\x00never"])
    r = client.completions.create(**kw)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.model_extra.get("stop_reason") is None and r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == expected
    kept = client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_seeded_sampling_is_reproducible(client, stack):
    kw = dict(model=stack.model, prompt="Hello", max_tokens=12, temperature=1.0, top_p=0.9)
    a = client.completions.create(**kw, seed=7).choices[0].text
    b = client.completions.create(**kw, seed=7).choices[0].text
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in (8, 9, 10)}
    assert a == b
    assert others != {a}


def test_unsupported_options_are_refused_with_a_reason(client, stack):
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        client.chat.completions.create(model=stack.model, messages=CHAT, n=2)
    with pytest.raises(openai.BadRequestError, match="logprobs are not available") as e:
        client.chat.completions.create(model=stack.model, messages=CHAT, logprobs=True)
    assert e.value.status_code == 400 and e.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=stack.model, prompt="x", logprobs=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)


def test_tools_and_tool_results_reach_the_template(client, stack):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    r = client.chat.completions.create(model=stack.model, messages=messages, tools=tools, max_tokens=4, temperature=0)
    # the synthetic template ignores tool definitions but renders the tool result
    rendered = stack.template.render([*CHAT, {"role": "assistant", "content": None, "tool_calls": []},
                                      {"role": "tool", "content": "12:00"}])
    assert "12:00" in rendered
    assert r.usage.prompt_tokens == len(stack.tok.encode(rendered, add_special_tokens=False))


def test_plain_httpx_sse_read(stack):
    body = {"model": stack.model, "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert len({e["id"] for e in events}) == 1
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == stack.greedy(stack.chat_ids(CHAT), 6)[1]


def _reflected_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        if "monoserve.v1.Inference" in services:
            method = db.FindFileContainingSymbol("monoserve.v1.Inference")
            assert any(s.name == "Inference" for s in method.service)
        return services


def test_grpc_reflection_lists_the_services(stack):
    router_services = _reflected_services(stack.router.address)
    assert {"monoserve.v1.Inference", "monoserve.v1.RouterAdmin", "grpc.health.v1.Health"} <= router_services
    assert "monoserve.v1.Replica" in _reflected_services(stack.replicas[0].address)


def test_chat_stop_string_streamed_and_kept(client, stack):
    _, text = stack.greedy(stack.chat_ids(CHAT), 16)
    assert len(text) >= 8, "precondition: enough output to pick a stop from"
    stop = text[5:7]
    expected = text[:text.find(stop)]
    kw = dict(model=stack.model, messages=CHAT, max_tokens=16, temperature=0, stop=stop)
    streamed = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    kept = client.chat.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == expected + stop


def test_responses_are_not_held_back_by_nagle(stack):
    """Headers and body are separate writes: without TCP_NODELAY each response waits ~40 ms for
    the client's delayed ACK (and so would every SSE event)."""
    import statistics
    import time

    with httpx.Client() as c:
        c.get(f"{stack.base_url}/models")
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            assert c.get(f"{stack.base_url}/models").status_code == 200
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.02, f"median round trip {statistics.median(times) * 1e3:.1f} ms"


def test_chat_extensions_change_the_rendered_prompt(client, stack):
    def prompt_tokens(messages, **extra):
        r = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=1, temperature=0,
                                           extra_body=extra or None)
        return r.usage.prompt_tokens

    developer = [{"role": "developer", "content": "You are terse."}, CHAT[1]]
    assert prompt_tokens(developer) == prompt_tokens(CHAT) == len(stack.chat_ids(CHAT))  # developer = system
    partial = [*CHAT, {"role": "assistant", "content": "Well,"}]
    continued = stack.tok.encode(stack.template.render(partial, add_generation_prompt=False,
                                                       continue_final_message=True), add_special_tokens=False)
    assert prompt_tokens(partial, add_generation_prompt=False, continue_final_message=True) == len(continued)
    r = httpx.post(f"{stack.base_url}/chat/completions", timeout=10, json={
        "model": stack.model, "messages": partial, "continue_final_message": True})
    assert r.status_code == 400 and "cannot both be true" in r.json()["error"]["message"]


def test_async_client_streams_concurrently(stack):
    import asyncio

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0) as aclient:
            async def one(prompt):
                stream = await aclient.completions.create(model=stack.model, prompt=prompt, max_tokens=8,
                                                          temperature=0, stream=True)
                return "".join([c.choices[0].text async for c in stream])

            return await asyncio.gather(one("Once upon"), one("The quick brown fox"))

    got = asyncio.run(main())
    assert got == [stack.greedy(stack.tok.encode(p), 8)[1] for p in ("Once upon", "The quick brown fox")]
