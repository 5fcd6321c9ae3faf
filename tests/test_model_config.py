"""ModelConfig from Hugging Face config.json: both spellings, every family, RoPE, EOS, refusals."""

import json

import numpy as np
import pytest

from replicas.model import ConfigError, ModelConfig

# transformers 5.24 `save_pretrained` output for a small Qwen3 (verbatim but shortened vocab)
QWEN3_V5 = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": None, "dtype": "bfloat16", "eos_token_id": [5, 6], "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48,
    "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": None, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "sliding_window": None,
    "tie_word_embeddings": True, "transformers_version": "5.24.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 64,
}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
# inv_freq from transformers 5.24 ROPE_INIT_FUNCTIONS (float32) for head_dim 32
HF_LLAMA3_INV_FREQ = [1.0, 0.440366626, 0.193922758, 0.0853971019, 0.0376060307, 0.0165604409, 0.00729266508,
                      0.00321144611, 0.000524846022, 7.78465546e-05, 3.42810235e-05, 1.50962178e-05,
                      6.64786967e-06, 2.92749974e-06, 1.28917316e-06, 5.6770881e-07]
HF_LINEAR4_INV_FREQ = [0.25, 0.140585333, 0.079056941, 0.0444569848, 0.0250000004, 0.0140585322, 0.00790569466,
                       0.00444569858, 0.00249999994, 0.00140585331, 0.000790569466, 0.000444569858,
                       0.000250000012, 0.000140585325, 7.90569466e-05, 4.44569851e-05]


def base(arch="LlamaForCausalLM", **over):
    """A small 4.x-spelling config.json of `arch`."""
    raw = {"architectures": [arch], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "torch_dtype": "bfloat16", "eos_token_id": 2, "bos_token_id": 1}
    raw.update(over)
    return {k: v for k, v in raw.items() if v is not None}


def test_transformers_5_spelling():
    cfg = ModelConfig.from_hf_dict(QWEN3_V5)
    assert (cfg.family, cfg.head_dim, cfg.q_dim, cfg.kv_dim, cfg.group_size) == ("qwen3", 16, 64, 32, 2)
    assert cfg.qk_norm and not cfg.qkv_bias and not cfg.o_bias and cfg.tie_word_embeddings
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (5, 6) and cfg.bos_token_id is None and cfg.dtype == "bf16"
    assert cfg.max_context == 32768


def test_4x_and_5x_spellings_give_the_same_config():
    v4 = base(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, torch_dtype="float16")
    v5 = base(rope_theta=None, torch_dtype=None, dtype="float16",
              rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING})
    assert ModelConfig.from_hf_dict(v4) == ModelConfig.from_hf_dict(v5)
    assert ModelConfig.from_hf_dict(v4).dtype == "fp16"


@pytest.mark.parametrize("arch,family,qkv_bias,o_bias,qk_norm", [
    ("LlamaForCausalLM", "llama", False, False, False),
    ("MistralForCausalLM", "mistral", False, False, False),
    ("Qwen2ForCausalLM", "qwen2", True, False, False),
    ("Qwen3ForCausalLM", "qwen3", False, False, True),
])
def test_every_family(arch, family, qkv_bias, o_bias, qk_norm):
    cfg = ModelConfig.from_hf_dict(base(arch))
    assert (cfg.family, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (family, qkv_bias, o_bias, qk_norm)
    assert cfg.head_dim == 8 and not cfg.tie_word_embeddings


@pytest.mark.parametrize("arch,qkv_bias,o_bias", [
    ("LlamaForCausalLM", True, True),  # Llama: attention_bias puts a bias on q, k, v and o
    ("Qwen3ForCausalLM", True, True),
    ("Qwen2ForCausalLM", True, False),  # Qwen2: q/k/v always biased, o never (no such option)
    ("MistralForCausalLM", False, False),  # Mistral has no attention bias at all
])
def test_attention_bias_follows_each_family(arch, qkv_bias, o_bias):
    cfg = ModelConfig.from_hf_dict(base(arch, attention_bias=True))
    assert (cfg.qkv_bias, cfg.o_bias) == (qkv_bias, o_bias)


def test_mha_explicit_head_dim_and_defaults():
    cfg = ModelConfig.from_hf_dict(base(num_key_value_heads=None, head_dim=16, rms_norm_eps=None))
    assert cfg.num_key_value_heads == 4 and cfg.group_size == 1 and cfg.head_dim == 16 and cfg.q_dim == 64
    assert cfg.rms_norm_eps == 1e-6
    assert ModelConfig.from_hf_dict(base(head_dim=None)).head_dim == 8  # hidden / heads


def test_llama3_rope_scaling_matches_transformers():
    cfg = ModelConfig.from_hf_dict(base(hidden_size=256, num_attention_heads=8, head_dim=32,
                                        rope_theta=500000.0, rope_scaling=LLAMA3_SCALING))
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0
    np.testing.assert_allclose(cfg.rope_inv_freq(), HF_LLAMA3_INV_FREQ, rtol=1e-6)


@pytest.mark.parametrize("key", ["rope_type", "type"])  # "type" is the older 4.x spelling
def test_linear_rope_scaling_matches_transformers(key):
    cfg = ModelConfig.from_hf_dict(base(hidden_size=256, num_attention_heads=8, head_dim=32,
                                        rope_scaling={key: "linear", "factor": 4.0}))
    np.testing.assert_allclose(cfg.rope_inv_freq(), HF_LINEAR4_INV_FREQ, rtol=1e-6)


def test_default_rope_type_means_no_scaling():
    cfg = ModelConfig.from_hf_dict(base(rope_scaling={"rope_type": "default"}))
    assert cfg.rope_scaling is None
    np.testing.assert_allclose(cfg.rope_inv_freq(), 10000.0 ** (-np.arange(0, 8, 2) / 8))


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_types_are_refused(rope_type):
    with pytest.raises(ConfigError, match=rf"rope_scaling\.rope_type='{rope_type}' is not supported; "
                                          r"supported: default, linear, llama3"):
        ModelConfig.from_hf_dict(base(rope_scaling={"rope_type": rope_type, "factor": 2.0}))
    with pytest.raises(ConfigError, match=rf"rope_parameters\.rope_type='{rope_type}' is not supported"):
        ModelConfig.from_hf_dict(base(rope_parameters={"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}))


def test_scaling_without_factor_is_refused():
    with pytest.raises(ConfigError, match=r"rope_scaling of type 'linear' needs a 'factor'"):
        ModelConfig.from_hf_dict(base(rope_scaling={"rope_type": "linear"}))


@pytest.mark.parametrize("over,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, (r"architectures=\['GPT2LMHeadModel'\] is not supported; supported: "
                                              r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")),
    ({"architectures": None}, r"architectures=\[\] is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; supported: 'silu'"),
    ({"mlp_bias": True}, r"mlp_bias=true is not supported"),
    ({"torch_dtype": "float64"}, r"dtype='float64' is not supported; supported: bfloat16, float16, float32"),
    ({"vocab_size": None}, r"missing required field 'vocab_size'"),
    ({"num_key_value_heads": 3}, r"^config\.json: num_attention_heads=4 is not a multiple of num_key_value_heads=3$"),
    ({"head_dim": 7}, r"head_dim=7 must be even"),
    ({"num_hidden_layers": 0}, r"^config\.json: num_hidden_layers: Input should be greater than 0$"),
    ({"vocab_size": "many"}, r"^config\.json: vocab_size: Input should be a valid integer"),
])
def test_unsupported_options_name_the_field(over, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(base(**over) if over.get("architectures", 1) is not None
                                 else {k: v for k, v in base().items() if k != "architectures"})


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_sliding_window_is_refused(arch):
    with pytest.raises(ConfigError, match=r"use_sliding_window=true is not supported"):
        ModelConfig.from_hf_dict(base(arch, use_sliding_window=True, sliding_window=64))
    # present but unused (the usual case) is fine and does not cap the context
    assert ModelConfig.from_hf_dict(base(arch, use_sliding_window=False, sliding_window=64)).max_context == 512


def test_mistral_sliding_window_caps_the_context():
    assert ModelConfig.from_hf_dict(base("MistralForCausalLM", sliding_window=128)).max_context == 128
    assert ModelConfig.from_hf_dict(base("MistralForCausalLM", sliding_window=None)).max_context == 512


def test_eos_ids_from_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(base(eos_token_id=2)))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9], "bos_token_id": 3}))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.eos_token_ids == (7, 2, 9) and cfg.bos_token_id == 3
    (tmp_path / "config.json").write_text(json.dumps(base(eos_token_id=[4, 5])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (5, 4)


def test_bad_checkpoint_dirs(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        ModelConfig.from_pretrained(tmp_path / "missing")
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"config\.json: cannot read JSON"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        ModelConfig.from_pretrained(tmp_path)


def test_derived_sizes():
    cfg = ModelConfig.from_hf_dict(base(attention_bias=True, tie_word_embeddings=True))
    h, i, v, q, kv = 32, 48, 64, 32, 16
    layer = h * q + 2 * h * kv + q * h + (q + 2 * kv) + h + 3 * h * i + 2 * h
    assert cfg.num_parameters() == 2 * layer + v * h + h
    assert cfg.decode_bytes_per_token() == 2 * (2 * layer + v * h + h)  # tied: the embedding is the head
