"""Cross-check router.chat against transformers' apply_chat_template and write the goldens.

NOT run in CI (needs transformers). Run with the oracle venv:

    /work/oracle-venv/bin/python scripts/check_chat_templates.py [--write]

For each case (test templates in tests/data/chat_templates/ and the synthetic checkpoints'
templates from replicas/tokenizer_gen.py) it renders the messages with transformers and with
`router.chat.ChatTemplate`, and fails if any string differs. `--write` stores transformers'
strings in tests/data/chat_templates/goldens.json, which tests/test_chat.py compares against.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from replicas.tokenizer_gen import CHAT_TEMPLATES, ROLE_TOKENS  # noqa: E402
from router.chat import ChatTemplate  # noqa: E402

DATA = ROOT / "tests" / "data" / "chat_templates"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Ünïcode ok"}},
                   "required": ["city"]}}}
SIMPLE = [{"role": "system", "content": "You are terse. "}, {"role": "user", "content": " Hi <b> & 'q' "},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"}]
TOOLS_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18°C"},
]
LLAMA_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def cases() -> list[dict]:
    out = [
        dict(name="llama3-simple", template="llama3.jinja", special_tokens=LLAMA_TOKENS, messages=SIMPLE,
             add_generation_prompt=True),
        dict(name="llama3-tools", template="llama3.jinja", special_tokens=LLAMA_TOKENS, messages=TOOLS_CHAT,
             tools=[TOOL], add_generation_prompt=True),
        dict(name="chatml-simple", template="chatml_qwen.jinja", special_tokens={"eos_token": "<|im_end|>"},
             messages=SIMPLE, add_generation_prompt=True),
        dict(name="chatml-tools", template="chatml_qwen.jinja", special_tokens={"eos_token": "<|im_end|>"},
             messages=TOOLS_CHAT, tools=[TOOL], add_generation_prompt=True),
        dict(name="mistral-no-generation-prompt", template="mistral_alternating.jinja",
             special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, add_generation_prompt=False,
             messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                       {"role": "user", "content": "Q"}]),
    ]
    for style, text in CHAT_TEMPLATES.items():
        bos, eos, _ = ROLE_TOKENS[style]
        special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v}
        msgs = [m for m in SIMPLE if style != "mistral" or m["role"] != "system"] + [
            {"role": "assistant", "content": "calling"}, {"role": "tool", "content": "42"}]
        out.append(dict(name=f"synthetic-{style}", template_text=text, special_tokens=special, messages=msgs,
                        add_generation_prompt=True))
    return out


def transformers_render(case: dict, template: str, tokenizer_file: str) -> str:
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **case["special_tokens"])
    return tok.apply_chat_template(case["messages"], tools=case.get("tools"), chat_template=template,
                                   tokenize=False, add_generation_prompt=case["add_generation_prompt"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write tests/data/chat_templates/goldens.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # A throwaway word-level tokenizer: apply_chat_template(tokenize=False) only needs the object.
        words = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer_file = str(Path(tmp) / "tokenizer.json")
        words.save(tokenizer_file)
        goldens, failures = [], 0
        for case in cases():
            template = case.get("template_text") or (DATA / case["template"]).read_text()
            expected = transformers_render(case, template, tokenizer_file)
            ours = ChatTemplate(template, case["special_tokens"]).render(
                case["messages"], tools=case.get("tools"), add_generation_prompt=case["add_generation_prompt"])
            ok = ours == expected
            failures += not ok
            print(f"{'OK  ' if ok else 'DIFF'} {case['name']} ({len(expected)} chars)")
            if not ok:
                print(f"  transformers: {expected!r}\n  monoserve:    {ours!r}")
            goldens.append({**case, "expected": expected})
    print(f"transformers {transformers.__version__}: {len(goldens) - failures}/{len(goldens)} identical")
    if args.write and not failures:
        (DATA / "goldens.json").write_text(json.dumps(goldens, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {DATA / 'goldens.json'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
