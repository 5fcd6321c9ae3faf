"""Incremental, UTF-8-safe detokenization and tokenizer loading."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from router.detokenizer import TextTokenizer, TokenizerError

CORPUS = ["hello world héllo wörld 你好 世界 🙂🚀 naïve café", "the quick brown fox", "Grüße 😀 ok"] * 5


def byte_level_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    byte_level_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}))
    return d


@pytest.fixture(scope="module")
def tokenizer(checkpoint_dir):
    return TextTokenizer.from_pretrained(checkpoint_dir)


def stream(tokenizer, ids, prompt=()):
    detok = tokenizer.detokenizer(list(prompt))
    deltas = [detok.step(i) for i in ids]
    deltas.append(detok.finish())
    return deltas


def test_loads_config_bos_and_template(tokenizer):
    assert tokenizer.bos_token_id == tokenizer.tokenizer.token_to_id("<s>")
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id
    assert tokenizer.encode("hi", add_special_tokens=False)[0] != tokenizer.bos_token_id
    assert "messages" in tokenizer.chat_template


def test_multi_token_characters_are_emitted_whole(tokenizer):
    text = "héllo 🙂 你好 🚀 wörld"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several tokens
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # at least one token completed no character on its own


def test_output_after_a_prompt_decodes_as_in_the_full_sequence(tokenizer):
    prompt = tokenizer.encode("the quick", add_special_tokens=False)
    out = tokenizer.encode(" brown fox 😀", add_special_tokens=False)
    assert "".join(stream(tokenizer, out, prompt)) == " brown fox 😀"


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    emoji = tokenizer.encode("🚀", add_special_tokens=False)
    raw = tokenizer.tokenizer.encode("🚀").tokens
    if len(emoji) < 2:
        pytest.skip(f"emoji is one token here: {raw}")
    deltas = stream(tokenizer, emoji[:-1])
    assert deltas[:-1] == [""] * (len(emoji) - 1)
    assert deltas[-1] and set(deltas[-1]) == {"\ufffd"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=319), max_size=40))
def test_random_ids_concatenate_to_the_full_decode(tokenizer, ids):
    # random model output: stray continuation bytes, special tokens, anything
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)


def test_missing_or_broken_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json not found"):
        TextTokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        TextTokenizer.from_pretrained(tmp_path)
