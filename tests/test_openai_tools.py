"""Tool calls written by the model come back as OpenAI `tool_calls`.

Parser unit tests, plus end to end: a scripted engine (an Engine whose output is a fixed text,
served by a real ReplicaServer behind a real RouterServer) writes tool calls in the Hermes/Qwen
and Llama-3 JSON formats, and the official `openai` client reads them, streaming and not.
"""

import json
import shutil
import threading

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.engine import FinishReason, Generation
from replicas.model import ModelConfig
from replicas.server import ReplicaServer
from router.detokenizer import TextTokenizer
from router.openai_tools import ToolCallStream, parse_tool_calls, tool_format
from router.server import RouterServer

HERMES_TEMPLATE = (__import__("pathlib").Path(__file__).parent / "data" / "chat_templates" / "chatml_qwen.jinja")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# -- parser ------------------------------------------------------------------------------------

def test_hermes_calls_and_surrounding_text():
    content, calls = parse_tool_calls("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"), "hermes")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "no call here",
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
])
def test_what_does_not_parse_stays_content(text):
    assert parse_tool_calls(text, "hermes") == (text, [])


def test_json_format_llama_style():
    content, calls = parse_tool_calls(' {"name": "get_time", "parameters": {"tz": "UTC"}}', "json")
    assert content is None and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"tz": "UTC"}
    _, two = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "json")
    assert [c.name for c in two] == ["a", "b"]
    assert parse_tool_calls("{ this is prose }", "json") == ("{ this is prose }", [])


def test_format_is_read_from_the_template():
    assert tool_format(HERMES_TEMPLATE.read_text()) == "hermes"
    assert tool_format((HERMES_TEMPLATE.parent / "llama3.jinja").read_text()) == "json"
    assert tool_format("{{ messages[0].content }}") is None


texts = st.sampled_from(["Sure. ", "", "  ", "text <tool_ca", "a<b>"]).flatmap(
    lambda pre: st.sampled_from([pre + CALL, pre + CALL + CALL, pre, pre + "<tool_call>{bad", pre + CALL[:-3]]))


@settings(max_examples=200, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(0, 200), max_size=10))
def test_streaming_finds_the_same_calls_for_any_split(text, cuts):
    points = sorted({c % (len(text) + 1) for c in cuts})
    parts = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    s = ToolCallStream("hermes")
    shown = "".join(s.feed(p) for p in parts)
    tail, calls = s.finish()
    content, expected = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]
    if expected:
        assert (shown + tail).strip() == (content or "")
    else:
        assert shown + tail == text  # nothing lost, nothing changed


# -- end to end ----------------------------------------------------------------------------------

class ScriptedEngine:
    """Engine that answers every prompt with `script` (then EOS). Real enough for the replica
    server; lets a test choose exactly what the model 'writes'."""

    kind = "scripted"
    max_batch = 1

    def __init__(self, checkpoint):
        self.config = ModelConfig.from_pretrained(checkpoint)
        self.max_context = self.config.max_position_embeddings
        self.tok = TextTokenizer.from_pretrained(checkpoint)
        self.script = ""
        self.lock = threading.Lock()

    def generate(self, prompt_ids, params):
        ids = self.tok.encode(self.script, add_special_tokens=False)

        def steps(cancel):
            for i, t in enumerate(ids):
                if cancel.is_set():
                    return FinishReason.CANCELLED, None
                if i >= params.max_tokens:
                    return FinishReason.LENGTH, None
                yield t
            return FinishReason.STOP, self.config.eos_token_ids[0]

        return Generation(steps)

    def forward_logits(self, token_ids):
        raise NotImplementedError("scripted engine")


class ScriptedStack:
    def __init__(self, checkpoint):
        self.engine = ScriptedEngine(checkpoint)
        self.replica = ReplicaServer(self.engine)
        self.replica.start()
        self.router = RouterServer([self.replica.address], http_port=0, tokenizer=checkpoint)
        self.router.start()
        self.router.wait_ready(1)
        self.model = checkpoint.name
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.router.http_port}/v1", api_key="x",
                                    max_retries=0)

    def close(self):
        self.client.close()
        self.router.stop()
        self.replica.stop(grace=0)


@pytest.fixture(scope="module")
def hermes(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with a Qwen-style (Hermes tool call) chat template."""
    ckpt = tmp_path_factory.mktemp("hermes") / "tiny-hermes"
    shutil.copytree(tiny_checkpoint, ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE.read_text()
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    s = ScriptedStack(ckpt)
    yield s
    s.close()


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    s = ScriptedStack(tiny_checkpoint)  # its synthetic Llama-3 template: JSON tool calls
    yield s
    s.close()


def test_hermes_tool_call_non_streaming(hermes):
    hermes.engine.script = "Let me check.\n" + CALL
    r = hermes.client.chat.completions.create(model=hermes.model, messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_hermes_tool_call_streaming(hermes):
    hermes.engine.script = "Let me check.\n" + CALL
    chunks = list(hermes.client.chat.completions.create(model=hermes.model, messages=ASK, tools=TOOLS,
                                                        max_tokens=200, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_in_the_request_the_text_is_returned_as_is(hermes):
    hermes.engine.script = CALL
    r = hermes.client.chat.completions.create(model=hermes.model, messages=ASK, max_tokens=200)
    assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls


def test_malformed_call_is_returned_as_content(hermes):
    hermes.engine.script = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    for stream in (False, True):
        r = hermes.client.chat.completions.create(model=hermes.model, messages=ASK, tools=TOOLS, max_tokens=200,
                                                  stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == hermes.engine.script and finish == "stop"


def test_llama_json_tool_call(llama):
    llama.engine.script = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    r = llama.client.chat.completions.create(model=llama.model, messages=ASK, tools=TOOLS, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    llama.engine.script = "The weather is fine."
    chunks = list(llama.client.chat.completions.create(model=llama.model, messages=ASK, tools=TOOLS, max_tokens=200,
                                                       stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The weather is fine."


def test_stop_string_on_known_text(llama):
    llama.engine.script = "alpha beta END gamma"
    r = llama.client.completions.create(model=llama.model, prompt="x", max_tokens=50, stop=["END"])
    assert r.choices[0].text == "alpha beta " and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "END"
