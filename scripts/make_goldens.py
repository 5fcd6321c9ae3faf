"""Write the oracle goldens under tests/goldens/: tiny random HF checkpoints + HF fp32 outputs.

NOT run in CI (needs torch + transformers). Run with the oracle venv:

    /work/oracle-venv/bin/python scripts/make_goldens.py [--out tests/goldens]

For each case it builds a tiny random model with transformers, saves it with `save_pretrained`
(fp32 safetensors), and stores in `golden.npz`:
  prompt_ids  [P] int64      a fixed random prompt
  greedy_ids  [N] int64      HF `generate(do_sample=False)` continuation (EOS disabled)
  logits_ids  [P+N-1] int64  prompt + greedy_ids[:-1], the sequence the logits are for
  logits      [P+N-1, V] f32 HF teacher-forced logits over logits_ids
so logits[P-1+i] is the distribution greedy_ids[i] was picked from (its top-2 margin tells the
test whether a tie-break could legitimately differ).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

PROMPT_LEN = 32
NEW_TOKENS = 16
COMMON = dict(num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
              bos_token_id=1, eos_token_id=2, hidden_act="silu")

# name -> (model class, config class, config kwargs, save kwargs, what it covers)
CASES = {
    "llama_gqa_llama3": (LlamaForCausalLM, LlamaConfig, dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False,
        # head_dim 16 -> wavelengths 6..2e4; original_max 64 puts some above, some between, some below.
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64),
    ), {}, "Llama, GQA 4q/2kv, untied LM head, llama3 rope scaling"),
    "llama_mha_bias_tied": (LlamaForCausalLM, LlamaConfig, dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        tie_word_embeddings=True, attention_bias=True,
    ), {}, "Llama, MHA, tied embeddings, attention_bias (q/k/v/o bias)"),
    "llama_linear_v4cfg": (LlamaForCausalLM, LlamaConfig, dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    ), {"v4_config": True}, "Llama, MQA, linear rope scaling; config.json rewritten in the transformers 4.x spelling"),
    "mistral": (MistralForCausalLM, MistralConfig, dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, sliding_window=64,
    ), {}, "Mistral, GQA, sliding_window 64 (> sequence, so attention is full)"),
    "qwen2_bias_tied": (Qwen2ForCausalLM, Qwen2Config, dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, use_sliding_window=False, rope_theta=1000000.0,
    ), {}, "Qwen2, GQA, q/k/v bias, tied embeddings, rope_theta 1e6"),
    "qwen3_qknorm_headdim": (Qwen3ForCausalLM, Qwen3Config, dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
    ), {}, "Qwen3, per-head q/k RMSNorm, explicit head_dim 16 != hidden/heads 8"),
    "llama_sharded": (LlamaForCausalLM, LlamaConfig, dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False,
    ), {"max_shard_size": "40KB"}, "Llama, GQA, sharded safetensors with model.safetensors.index.json"),
}


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Replace HF's tiny init (std 0.02, unit norms, zero biases) with weights that make logits
    far from uniform and exercise every parameter: N(0, 1/fan_in) matrices, N(0, 1) embeddings,
    norm weights around 1, non-zero biases."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are listed once
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def to_v4_config(path: Path) -> None:
    """Rewrite config.json in the transformers 4.x spelling (rope_theta/rope_scaling/torch_dtype)."""
    file = path / "config.json"
    cfg = json.loads(file.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    cfg["torch_dtype"] = cfg.pop("dtype")
    file.write_text(json.dumps(cfg, indent=2) + "\n")


def build(name: str, out: Path, seed: int) -> dict:
    model_cls, config_cls, kwargs, save, what = CASES[name]
    config = config_cls(**{**COMMON, **kwargs}, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    randomize(model, gen)

    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    kw = {"max_shard_size": save["max_shard_size"]} if "max_shard_size" in save else {}
    model.save_pretrained(target, safe_serialization=True, **kw)
    if save.get("v4_config"):
        to_v4_config(target)

    prompt = torch.randint(3, config.vocab_size, (1, PROMPT_LEN), generator=gen)
    with torch.no_grad():
        # EOS disabled so the continuation always has NEW_TOKENS tokens (the test sets ignore_eos).
        out_ids = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(prompt))
        greedy = out_ids[0, PROMPT_LEN:]
        assert greedy.numel() == NEW_TOKENS, greedy
        logits_ids = torch.cat([prompt[0], greedy[:-1]])
        logits = model(logits_ids[None]).logits[0].to(torch.float32)
    np.savez_compressed(
        target / "golden.npz",
        prompt_ids=prompt[0].numpy().astype(np.int64),
        greedy_ids=greedy.numpy().astype(np.int64),
        logits_ids=logits_ids.numpy().astype(np.int64),
        logits=logits.numpy().astype(np.float32),
    )
    top2 = np.sort(logits.numpy()[PROMPT_LEN - 1:], axis=-1)[:, -2:]
    size = sum(f.stat().st_size for f in target.iterdir())
    print(f"{name:24s} {size / 1024:7.1f} KB  min greedy top-2 margin {np.min(top2[:, 1] - top2[:, 0]):.4f}")
    return {"name": name, "covers": what, "files": sorted(f.name for f in target.iterdir())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "goldens")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    cases = [build(name, args.out, args.seed + i) for i, name in enumerate(CASES)]
    lines = [
        "# Oracle goldens (generated, do not edit)",
        "",
        ("Written by `scripts/make_goldens.py` with "
         f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__} "
         "(CPU, fp32, eager attention). Regenerate with"),
        "`/work/oracle-venv/bin/python scripts/make_goldens.py`; checked by `tests/test_oracle.py`.",
        "",
        (f"Each directory is a `save_pretrained` checkpoint (fp32) plus `golden.npz`: a {PROMPT_LEN}-token "
         f"random prompt, HF's {NEW_TOKENS}-token greedy continuation (EOS disabled) and HF's teacher-forced "
         "logits over prompt + continuation[:-1]."),
        "",
        "| case | covers |",
        "|---|---|",
        *[f"| `{c['name']}` | {c['covers']} |" for c in cases],
        "",
    ]
    (args.out / "README.md").write_text("\n".join(lines))
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"total {total / 1024:.0f} KB in {args.out}")


if __name__ == "__main__":
    main()
