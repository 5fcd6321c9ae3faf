"""Synthetic byte-level BPE tokenizers (and chat templates) for the synthetic checkpoints.

The vocabulary has exactly the model's `vocab_size` ids and every id decodes: special tokens
sit at the ids the real model family uses (so EOS/BOS ids are realistic), the 256 byte tokens
and programmatically built merges fill every other id. Merges grow letter strings
("Ġt" -> "Ġth" -> "Ġthe"), so English text tokenizes to fewer ids than bytes. No training: a
152k vocabulary builds in well under a second.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)
from tokenizers.pre_tokenizers import ByteLevel

# Chat templates (Jinja, as in tokenizer_config.json). Roles: system, user, assistant, tool.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set system.text = message['content'] + '\n\n' %}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + system.text + message['content'] + '[/INST]' }}"
    "{% set system.text = '' %}"
    "{% elif message['role'] == 'tool' %}{{ '[TOOL_RESULTS] ' + message['content'] + '[/TOOL_RESULTS]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
# (add_generation_prompt needs no text for Mistral: the model answers right after [/INST].)

LLAMA3_NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
QWEN_NAMED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
              "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
              "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
              "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
MISTRAL_NAMED = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]


def special_tokens(style: str, vocab_size: int) -> dict[int, str]:
    """Special tokens by id for a family `style` ("llama3", "qwen", "mistral")."""
    if style == "llama3":  # the last 256 ids (16 for tiny vocabularies), named ones first
        count = 256 if vocab_size > 4096 else 16
        first = vocab_size - count
        names = LLAMA3_NAMED + [f"<|reserved_special_token_{k}|>" for k in range(3, 3 + count - len(LLAMA3_NAMED))]
        return {first + k: name for k, name in enumerate(names)}
    if style == "qwen":  # right after the BPE range (151643 in the real model); padding ids follow
        first = 151643 if vocab_size > 151643 + len(QWEN_NAMED) else vocab_size - len(QWEN_NAMED)
        out = {first + k: name for k, name in enumerate(QWEN_NAMED)}
        out.update({i: f"<|extra_{i - first - len(QWEN_NAMED)}|>" for i in range(first + len(QWEN_NAMED), vocab_size)})
        return out
    if style == "mistral":  # the first ids
        return dict(enumerate(MISTRAL_NAMED))
    raise ValueError(f"unknown tokenizer style {style!r}")


CHAT_TEMPLATES = {"llama3": LLAMA3_TEMPLATE, "qwen": CHATML_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
# (bos, eos, pad) token strings per style; None = the style has none
ROLE_TOKENS = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"),
    "qwen": (None, "<|im_end|>", "<|endoftext|>"),
    "mistral": ("<s>", "</s>", None),
}


def _merged_strings() -> Iterator[tuple[str, str]]:
    """(left, right) merges in priority order; each result is a new letter string."""
    starts = ["Ġ"] + list(string.ascii_lowercase) + list(string.ascii_uppercase)
    level = list(starts)
    while True:  # level k: every level-(k-1) string extended by one lowercase letter
        nxt = []
        for left in level:
            for c in string.ascii_lowercase:
                yield left, c
                nxt.append(left + c)
        level = nxt


def build_tokenizer(vocab_size: int, style: str) -> Tokenizer:
    """A byte-level BPE `Tokenizer` with exactly `vocab_size` ids, all decodable."""
    specials = special_tokens(style, vocab_size)
    free = (i for i in range(vocab_size) if i not in specials)
    vocab: dict[str, int] = {tok: i for i, tok in specials.items()}
    for ch in sorted(ByteLevel.alphabet(), key=_BYTE_OF.__getitem__):
        vocab[ch] = next(free)
    merges: list[tuple[str, str]] = []
    remaining = vocab_size - len(vocab)
    for left, right in _merged_strings():
        if len(merges) == remaining:
            break
        if left + right in vocab:
            continue
        vocab[left + right] = next(free)
        merges.append((left, right))
    assert len(vocab) == vocab_size and sorted(vocab.values()) == list(range(vocab_size))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in sorted(specials.items())])
    bos = ROLE_TOKENS[style][0]
    if bos is not None:  # like Llama 3 and Mistral: encode() prepends BOS
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _gpt2_byte_map() -> dict[str, int]:
    """ByteLevel alphabet character -> the byte it stands for (GPT-2's printable byte map)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF = _gpt2_byte_map()


def write_tokenizer(out: Path, vocab_size: int, style: str, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) into `out`."""
    tok = build_tokenizer(vocab_size, style)
    tok.save(str(out / "tokenizer.json"))
    bos, eos, pad = ROLE_TOKENS[style]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": bos is not None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATES[style],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)) if v}, indent=2) + "\n")
