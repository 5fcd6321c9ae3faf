"""Model presets for synthetic checkpoints: real `config.json` shapes of public models.

`PRESETS[name]` is the config.json dict (transformers 4.x spelling, which 5.x also reads).
`GENERATION[name]` is its generation_config.json; `TOKENIZER_STYLE[name]` picks the special
tokens and chat template (see tokenizer_gen.py). Weights are random (see checkpoint.py).
"""

from __future__ import annotations

from typing import Any

LLAMA3_EOS = [128001, 128008, 128009]  # <|end_of_text|>, <|eom_id|>, <|eot_id|>
QWEN_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>


def _llama(hidden, inter, layers, heads, kv, *, tie, factor, head_dim=None, vocab=128256,
           max_pos=131072, bos=128000, eos=LLAMA3_EOS, rope_theta=500000.0) -> dict[str, Any]:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim or hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": None if factor is None else {
            "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos[0],  # the full list is in generation_config.json, as in the real models
        "torch_dtype": "bfloat16",
    }
    return cfg


def _qwen(arch, hidden, inter, layers, heads, kv, *, head_dim, tie, max_pos, window) -> dict[str, Any]:
    qwen3 = arch == "Qwen3ForCausalLM"
    cfg = {
        "architectures": [arch],
        "model_type": "qwen3" if qwen3 else "qwen2",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": window,
        "max_window_layers": layers,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "bos_token_id": 151643,
        "eos_token_id": QWEN_EOS[0],
        "torch_dtype": "bfloat16",
    }
    if qwen3:
        cfg["attention_bias"] = False
    return cfg


def _mistral_7b() -> dict[str, Any]:
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


# tiny: Llama-style GQA (4 query heads, 2 kv heads), untied head, ~1.4 M parameters (2.8 MB bf16).
_TINY = _llama(128, 384, 4, 4, 2, tie=False, factor=None, vocab=2048, max_pos=2048,
               bos=2032, eos=[2033, 2040, 2041], rope_theta=10000.0)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "llama-3.2-1b": _llama(2048, 8192, 16, 32, 8, tie=True, factor=32.0),
    "llama-3.2-3b": _llama(3072, 8192, 28, 24, 8, tie=True, factor=32.0),
    "llama-3.1-8b": _llama(4096, 14336, 32, 32, 8, tie=False, factor=8.0),
    "qwen3-0.6b": _qwen("Qwen3ForCausalLM", 1024, 3072, 28, 16, 8, head_dim=128, tie=True,
                        max_pos=40960, window=None),
    "qwen3-1.7b": _qwen("Qwen3ForCausalLM", 2048, 6144, 28, 16, 8, head_dim=128, tie=True,
                        max_pos=40960, window=None),
    "qwen2.5-1.5b": _qwen("Qwen2ForCausalLM", 1536, 8960, 28, 12, 2, head_dim=128, tie=True,
                          max_pos=32768, window=32768),
    "mistral-7b": _mistral_7b(),
}

TOKENIZER_STYLE = {name: {"LlamaForCausalLM": "llama3", "MistralForCausalLM": "mistral"}.get(
    cfg["architectures"][0], "qwen") for name, cfg in PRESETS.items()}


def _generation(cfg: dict[str, Any], style: str) -> dict[str, Any]:
    eos = {"llama3": None, "qwen": QWEN_EOS, "mistral": [2]}[style]
    if eos is None:  # llama3 style: end_of_text, eom, eot at their offsets from BOS
        bos = cfg["bos_token_id"]
        eos = [bos + 1, bos + 8, bos + 9]
    return {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos}


GENERATION = {name: _generation(cfg, TOKENIZER_STYLE[name]) for name, cfg in PRESETS.items()}
