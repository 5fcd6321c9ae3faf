"""Chat templates rendered like transformers' apply_chat_template.

The Llama-3 and ChatML (Qwen) templates in tests/data/chat_templates are written in the style of
the real model families (system prompt, tools, tool calls, tool results). Expected strings are
spelled out by hand here; tests/data/chat_templates/goldens.json holds strings produced by
transformers itself (scripts/check_chat_templates.py regenerates and cross-checks them).
"""

import json
from pathlib import Path

import pytest

from router.chat import ChatTemplate, ChatTemplateError, NoChatTemplate

DATA = Path(__file__).parent / "data" / "chat_templates"
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def template(name: str, special=SPECIAL) -> ChatTemplate:
    return ChatTemplate((DATA / f"{name}.jinja").read_text(), special)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C <sunny> & dry"},
]


def test_llama3_system_user_with_generation_prompt():
    text = template("llama3").render(
        [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi <b>&"}])
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi <b>&<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_generation_prompt_can_be_left_off():
    text = template("llama3").render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert text == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"


def test_chatml_default_system_prompt_and_no_html_escaping():
    text = template("chatml_qwen").render([{"role": "user", "content": "1 < 2 & 'x'"}])
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\n1 < 2 & 'x'<|im_end|>\n<|im_start|>assistant\n")


def test_chatml_tools_calls_and_results():
    text = template("chatml_qwen").render(TOOL_CHAT, tools=[WEATHER_TOOL])
    # tojson keeps key order and does not escape (Jinja's built-in tojson would do both)
    assert ('<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", '
            '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
            "\n</tools>") in text
    assert text.endswith('<|im_start|>user\nWeather in Paris?<|im_end|>\n'
                         '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                         '\n</tool_call><|im_end|>\n'
                         '<|im_start|>user\n<tool_response>\n18°C <sunny> & dry\n</tool_response><|im_end|>\n'
                         '<|im_start|>assistant\n')


def test_llama3_tools_rendered_with_indented_json_and_ipython_role():
    text = template("llama3").render(TOOL_CHAT, tools=[WEATHER_TOOL])
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert '{\n    "type": "function",\n    "function": {\n        "name": "get_weather",' in text
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
            '<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n18°C <sunny> & dry<|eot_id|>') in text


def test_raise_exception_in_template_becomes_a_clear_error():
    t = template("mistral_alternating", {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles"):
        t.render([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="rejected the messages"):
        template("llama3").render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                   "tool_calls": TOOL_CHAT[1]["tool_calls"] * 2}])


def test_trim_and_lstrip_blocks_and_generation_tag():
    t = template("mistral_alternating", {"bos_token": "<s>", "eos_token": "</s>"})
    text = t.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                     {"role": "user", "content": "Q"}], add_generation_prompt=False)
    assert text == "<s>\n[INST] Hi [/INST]\nYo</s>[INST] Q [/INST]\n"


def test_loop_controls_and_strftime_now_are_available():
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
                     "{% endfor %}|{{ strftime_now('%Y') | length }}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a|4"


def test_sandbox_refuses_unsafe_templates():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])
    t = ChatTemplate("{{ messages.append(1) }}")  # immutable: no mutation of the caller's data
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])


def test_continue_final_message_cuts_after_the_partial_assistant_turn():
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    text = template("chatml_qwen").render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n1, 2,")
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        template("chatml_qwen").render(msgs, add_generation_prompt=True, continue_final_message=True)


def test_named_templates_pick_tool_use_when_tools_are_given():
    t = ChatTemplate.from_tokenizer_config({"chat_template": [
        {"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools={{ tools | length }}"}]})
    assert t.render([{"role": "user", "content": "x"}]) == "plain"
    assert t.render([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL]) == "tools=1"


def test_special_tokens_from_added_token_dicts_and_extra_kwargs():
    t = ChatTemplate.from_tokenizer_config({
        "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{% if enable_thinking %}T{% endif %}",
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"})
    assert t.render([{"role": "user", "content": "x"}]) == "<s>x</s>"
    assert t.render([{"role": "user", "content": "x"}], enable_thinking=True) == "<s>x</s>T"


def test_checkpoint_without_template_gives_a_clear_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    t = ChatTemplate.from_pretrained(tmp_path)
    assert not t.available
    with pytest.raises(NoChatTemplate, match="has no chat template.*send a plain text prompt"):
        t.render([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old"}))
    (tmp_path / "chat_template.jinja").write_text("new {{ messages | length }}")
    assert ChatTemplate.from_pretrained(tmp_path).render([{"role": "user", "content": "x"}]) == "new 1"


def test_broken_template_only_breaks_chat_requests():
    t = ChatTemplate("{% for m in messages %}unclosed")
    assert t.available
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        t.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"content": "x"}], r"messages\[0\].role"),
    (["x"], r"messages\[0\] must be an object"),
])
def test_malformed_messages_are_named(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        template("llama3").render(messages)


def test_synthetic_checkpoint_ships_a_working_template(tiny_checkpoint):
    t = ChatTemplate.from_pretrained(tiny_checkpoint)
    text = t.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert "S" in text and "U" in text and text != "SU"


def test_goldens_from_transformers_match():
    """Strings produced by transformers.apply_chat_template (scripts/check_chat_templates.py)."""
    goldens = json.loads((DATA / "goldens.json").read_text())
    assert len(goldens) >= 8
    for case in goldens:
        source = case.get("template_text") or (DATA / case["template"]).read_text()
        t = ChatTemplate(source, case["special_tokens"])
        got = t.render(case["messages"], tools=case.get("tools"), add_generation_prompt=case["add_generation_prompt"])
        assert got == case["expected"], case["name"]
