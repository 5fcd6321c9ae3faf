"""Synthetic checkpoints: preset shapes, written files, tokenizer, chat template, determinism."""

import json

import jinja2
import numpy as np
import pytest
from tokenizers import Tokenizer

from replicas import checkpoint
from replicas.checkpoint import PRESETS, make_checkpoint, preset_config, write_metadata
from replicas.model import ModelConfig
from replicas.weights import expected_tensors, load_weights

# parameters of the real models (from their model cards / safetensors headers)
REAL_PARAMS = {
    "llama-3.2-1b": 1.236e9, "llama-3.2-3b": 3.213e9, "llama-3.1-8b": 8.030e9, "qwen3-0.6b": 0.596e9,
    "qwen3-1.7b": 1.721e9, "qwen2.5-1.5b": 1.544e9, "mistral-7b": 7.248e9,
}


def test_presets_have_real_shapes():
    assert set(REAL_PARAMS) | {"tiny"} <= set(PRESETS)
    for name, params in REAL_PARAMS.items():
        assert preset_config(name).num_parameters() == pytest.approx(params, rel=1e-3), name
    l8 = preset_config("llama-3.1-8b")
    assert (l8.vocab_size, l8.hidden_size, l8.num_hidden_layers, l8.num_key_value_heads) == (128256, 4096, 32, 8)
    assert l8.rope_scaling.rope_type == "llama3" and l8.rope_scaling.factor == 8.0
    assert l8.eos_token_ids == (128001, 128008, 128009) and not l8.tie_word_embeddings
    assert preset_config("llama-3.2-1b").tie_word_embeddings
    q3 = preset_config("qwen3-0.6b")
    assert q3.qk_norm and q3.head_dim == 128 and q3.tie_word_embeddings and not q3.qkv_bias
    assert q3.eos_token_ids == (151645, 151643) and q3.vocab_size == 151936
    q2 = preset_config("qwen2.5-1.5b")
    assert q2.qkv_bias and not q2.o_bias and q2.tie_word_embeddings and q2.num_key_value_heads == 2
    m = preset_config("mistral-7b")
    assert (m.vocab_size, m.eos_token_ids, m.bos_token_id, m.sliding_window) == (32768, (2,), 1, None)
    tiny = preset_config("tiny")
    assert tiny.num_parameters() * 2 < 4e6 and tiny.group_size == 2 and not tiny.tie_word_embeddings


def test_large_presets_are_sharded_below_4gb():
    tensors = expected_tensors(preset_config("llama-3.1-8b"))
    shards = checkpoint._plan_shards(tensors, 2)
    sizes = [sum(np.prod(tensors[n]) * 2 for n in shard) for shard in shards]
    assert len(shards) == 5 and max(sizes) <= 4e9 and sum(sizes) == 8.030261248e9 * 2
    assert len(checkpoint._plan_shards(expected_tensors(preset_config("llama-3.2-1b")), 2)) == 1


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_writes_a_readable_config_and_full_tokenizer(tmp_path, preset):
    config = write_metadata(preset, tmp_path)
    assert ModelConfig.from_pretrained(tmp_path) == config == preset_config(preset)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == config.vocab_size
    assert sorted(tok.get_vocab().values()) == list(range(config.vocab_size))  # every id has a token
    for eos in config.eos_token_ids:
        assert tok.decode([eos], skip_special_tokens=False)  # EOS ids are named special tokens
    text = "Hello, world! Ünïcode 😀 and code: x = f(y) + 1\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text and len(ids) < len(text.encode())
    tk_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tok.token_to_id(tk_config["eos_token"]) in config.eos_token_ids
    if tk_config["bos_token"]:
        assert tok.token_to_id(tk_config["bos_token"]) == config.bos_token_id
        assert tok.encode("hi").ids[0] == config.bos_token_id


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": '{"t": 1}'},
        {"role": "user", "content": "Again"}]


@pytest.mark.parametrize("preset,parts,prompt_suffix", [
    ("tiny", ["<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>",
              "<|start_header_id|>ipython<|end_header_id|>\n\n{\"t\": 1}<|eot_id|>"],
     "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("qwen3-0.6b", ["<|im_start|>system\nBe brief.<|im_end|>\n", "<tool_response>\n{\"t\": 1}\n</tool_response>"],
     "<|im_end|>\n<|im_start|>assistant\n"),
    ("mistral-7b", ["<s>[INST] Be brief.\n\nHi[/INST] Hello</s>", "[TOOL_RESULTS] {\"t\": 1}[/TOOL_RESULTS]"],
     "[INST] Again[/INST]"),
])
def test_chat_template_renders_every_role(tmp_path, preset, parts, prompt_suffix):
    write_metadata(preset, tmp_path)
    tk_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(tk_config["chat_template"])
    specials = {"bos_token": tk_config["bos_token"] or "", "eos_token": tk_config["eos_token"]}
    text = template.render(messages=CHAT, add_generation_prompt=True, **specials)
    assert all(part in text for part in parts), text
    assert all(m["content"] in text for m in CHAT)
    assert text.endswith(prompt_suffix)
    without = template.render(messages=CHAT, add_generation_prompt=False, **specials)
    assert without.endswith(prompt_suffix) == (preset == "mistral-7b")  # Mistral answers right after [/INST]


def test_tiny_checkpoint_files(tiny_checkpoint):
    names = {p.name for p in tiny_checkpoint.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert (tiny_checkpoint / "model.safetensors").stat().st_size < 4e6
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["torch_dtype"] == "bfloat16"


def test_same_seed_same_bytes_other_seed_differs(tmp_path, tiny_checkpoint):
    again = make_checkpoint("tiny", tmp_path / "again", seed=0)
    other = make_checkpoint("tiny", tmp_path / "other", seed=1)
    data = (tiny_checkpoint / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == data
    assert (other / "model.safetensors").read_bytes() != data


def test_weights_are_scaled(tiny_checkpoint):
    config = ModelConfig.from_pretrained(tiny_checkpoint)
    w = load_weights(tiny_checkpoint, config)
    assert abs(w["model.norm.weight"].mean() - 1) < 0.05
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert q.std() == pytest.approx(1 / np.sqrt(config.hidden_size), rel=0.05)
    assert abs(q.mean()) < 0.01


@pytest.mark.parametrize("tied", [False, True])
def test_logits_are_peaked_not_uniform_and_not_an_echo(tmp_path, monkeypatch, tiny_checkpoint, tied):
    from replicas.reference import ReferenceEngine

    path = tiny_checkpoint
    if tied:  # the tiny shapes with a tied head, like the Llama 3.2 and Qwen presets
        for table in (checkpoint.PRESETS, checkpoint.GENERATION, checkpoint.TOKENIZER_STYLE):
            monkeypatch.setitem(table, "tiny-tied", table["tiny"])
        monkeypatch.setitem(PRESETS, "tiny-tied", dict(PRESETS["tiny"], tie_word_embeddings=True))
        path = make_checkpoint("tiny-tied", tmp_path)
    ids = np.random.default_rng(0).integers(0, 2000, 48).tolist()
    logits = ReferenceEngine.from_pretrained(path).forward_logits(ids)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert p.max(-1).mean() > 0.2  # uniform would be 1/2048
    assert np.all(np.isfinite(logits)) and logits.std(-1).mean() < 10
    top1 = logits.argmax(-1)
    assert np.mean(top1 == ids) < 0.1  # a position does not just predict its own input token
    assert len(set(top1.tolist())) > len(ids) // 2  # nor one token everywhere


def test_bad_arguments(tmp_path):
    with pytest.raises(KeyError, match="unknown preset 'llama-9'; presets: tiny, llama-3.2-1b"):
        make_checkpoint("llama-9", tmp_path)
    with pytest.raises(ValueError, match="dtype='int8' is not supported; use one of: bf16, fp16, fp32"):
        make_checkpoint("tiny", tmp_path, dtype="int8")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="directory is not empty"):
        make_checkpoint("tiny", tmp_path / "x", overwrite=False)


def test_rewrite_replaces_stale_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 1_000_000)
    path = make_checkpoint("tiny", tmp_path / "c")
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 4 * 10**9)
    make_checkpoint("tiny", path)
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]
    load_weights(path, ModelConfig.from_pretrained(path))
