"""Tensor parallelism on the CPU: shard plans, error messages, vocabulary padding, and a numpy
simulation of the sharded forward pass (replicas.tp_prefill.ShardedPrefill on shards cut by
replicas.tp_shard, packed by the single-GPU packer) against the unsharded path, the reference
engine and the transformers goldens."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from replicas.checkpoint import preset_config
from replicas.layout import KernelLayout
from replicas.model import ModelConfig
from replicas.monokernel_weights import pack_weights, rope_tables, to_bf16_bits, to_f32
from replicas.reference import ReferenceEngine
from replicas.tp_prefill import ShardedPrefill
from replicas.tp_shard import (
    TensorParallelError,
    check_tp,
    shard_config,
    shard_plan,
    shard_tensors,
)
from replicas.weights import expected_tensors, load_weights

GOLDENS = Path(__file__).parent / "goldens"
# Sharded vs unsharded (same bf16 weights, same bf16 KV rounding): only the fp32 summation order
# of the matvecs and of the all-reduce differs (measured max |Δ| / max |logit| up to 2.7e-5: an
# order change now and then flips a cached K/V value by one bf16 ulp).
FP32_TOL = 1e-4
# vs the fp32 reference engine / transformers: the monokernel rounds K/V to bf16 (and the weights
# to bf16 where the checkpoint is fp32), as test_monokernel_cpu.py's prefill check allows.
REF_TOL = 5e-3
# vs transformers on an fp32 golden checkpoint: the monokernel also rounds the weights to bf16
# (the tolerance of tests/test_monokernel_gpu.py).
GOLDEN_TOL = 2e-2


def rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def cfg_with(base: ModelConfig, **kw) -> ModelConfig:
    return ModelConfig(**{**base.model_dump(), **kw})


# ---- plans and errors ----------------------------------------------------------------------
def test_plan_splits_heads_rows_and_vocab():
    c = preset_config("llama-3.2-1b")  # 32 q heads, 8 kv heads, inter 8192, vocab 128256
    p = shard_plan(c, 2, 1)
    assert p.q_heads == (16, 32) and p.kv_heads == (4, 8) and p.inter == (4096, 8192)
    assert p.vocab == (64128, 128256) and p.vocab_rows == 64128 and p.vocab_base == 64128
    local = shard_config(c, 8)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (4, 1, 1024)
    assert local.vocab_size == 16032 and not local.tie_word_embeddings and local.hidden_size == 2048


def test_more_gpus_than_kv_heads_replicates_the_needed_kv_head():
    c = preset_config("tiny")  # 4 q heads, 2 kv heads (group 2)
    plans = [shard_plan(c, 4, r) for r in range(4)]
    assert [p.q_heads for p in plans] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # q head h reads kv head h // 2


def test_last_vocab_shard_is_zero_padded():
    c = preset_config("tiny")
    c3 = cfg_with(c, vocab_size=2045)
    t = {k: np.random.default_rng(0).standard_normal(s).astype(np.float32) for k, s in expected_tensors(c3).items()}
    plans = [shard_plan(c3, 4, r) for r in range(4)]
    assert [p.vocab for p in plans] == [(0, 512), (512, 1024), (1024, 1536), (1536, 2045)]
    last = shard_tensors(c3, t, 4, 3)["lm_head.weight"]
    assert last.shape == (512, c3.hidden_size)
    assert np.array_equal(last[:509], t["lm_head.weight"][1536:]) and not last[509:].any()


def test_tied_embedding_becomes_a_sliced_head_and_whole_embedding():
    c = cfg_with(preset_config("tiny"), tie_word_embeddings=True)
    t = {k: np.random.default_rng(1).standard_normal(s).astype(np.float32) for k, s in expected_tensors(c).items()}
    s = shard_tensors(c, t, 2, 1)
    assert s["model.embed_tokens.weight"] is t["model.embed_tokens.weight"]
    assert np.array_equal(s["lm_head.weight"], t["model.embed_tokens.weight"][1024:])
    assert set(s) == set(expected_tensors(shard_config(c, 2)))  # exactly the local model's tensors


@pytest.mark.parametrize("n, field, match", [
    (3, None, "not supported; use one of 1, 2, 4, 8"),
    (16, None, "not supported"),
    (8, None, "do not divide num_attention_heads=4"),
    (2, {"intermediate_size": 385}, "do not divide intermediate_size=385"),
    (4, {"num_attention_heads": 12, "num_key_value_heads": 6}, "num_key_value_heads=6: one must divide"),
])
def test_unsplittable_models_are_refused_clearly(n, field, match):
    c = cfg_with(preset_config("tiny"), **(field or {}))
    with pytest.raises(TensorParallelError, match=match):
        check_tp(c, n)
    with pytest.raises(TensorParallelError):
        shard_tensors(c, {}, n, 0)


# ---- the sharded forward pass (numpy) -----------------------------------------------------
def packing_layout(cfg: ModelConfig) -> KernelLayout:
    """The packed shapes of `cfg` (built directly: goldens use head dims the kernel refuses)."""
    return KernelLayout(hidden=cfg.hidden_size, inter=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                        heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        vocab=cfg.vocab_size, eps=cfg.rms_norm_eps, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                        qk_norm=cfg.qk_norm, max_ctx=64, num_sms=132)


def sharded_logits(cfg: ModelConfig, tensors, n: int, ids) -> np.ndarray:
    """The GPU loader's steps on numpy: cut shards, pack each, run the sharded prefill."""
    local = shard_config(cfg, n)
    models = []
    for r in range(n):
        m = types.SimpleNamespace(config=local)
        m.weights = pack_weights(np, packing_layout(local), local, shard_tensors(cfg, tensors, n, r))
        m.rope_cos, m.rope_sin = rope_tables(local, 64)
        shape = (local.num_hidden_layers, local.num_key_value_heads, 64, local.head_dim)
        m.k_cache, m.v_cache = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
        models.append(m)
    xs, logits = ShardedPrefill(models, cfg.vocab_size, np).run(ids, all_logits=True)
    for x in xs[1:]:
        assert np.array_equal(x, xs[0])  # the residual stream is bitwise identical on every rank
    assert logits.shape == (len(ids), cfg.vocab_size)
    return logits


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 24).tolist()
    ref = ReferenceEngine.from_pretrained(tiny_checkpoint).forward_logits(ids)
    return cfg, load_weights(tiny_checkpoint, cfg, dtype="raw"), ids, ref


@pytest.mark.parametrize("n", [2, 4])  # 4 > 2 kv heads: replicated kv heads
def test_tiny_sharded_matches_unsharded_and_reference(tiny, n):
    cfg, t, ids, ref = tiny
    one = sharded_logits(cfg, t, 1, ids)
    got = sharded_logits(cfg, t, n, ids)
    assert rel(got, one) < FP32_TOL
    assert rel(got, ref) < REF_TOL and rel(one, ref) < REF_TOL


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_eight_way_model_with_two_kv_heads_and_ragged_vocab(n):
    """8 q heads / 2 kv heads (N=4, 8 replicate kv heads), tied head, q/k/v + o bias, qk-norm,
    a vocabulary N does not divide (padded last shard)."""
    base = preset_config("tiny")
    cfg = cfg_with(base, num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_size=128,
                   intermediate_size=256, vocab_size=1001, tie_word_embeddings=True, qkv_bias=True,
                   o_bias=True, qk_norm=True, num_hidden_layers=2)
    rng = np.random.default_rng(7)
    t = {}
    for k, s in expected_tensors(cfg).items():
        scale = 1.0 if "embed" in k or "norm" in k else (1.0 / s[-1]) ** 0.5
        w = (rng.standard_normal(s) * scale + (1.0 if "norm" in k else 0.0)).astype(np.float32)
        t[k] = to_f32(np, to_bf16_bits(np, w))  # bf16-exact, so the reference sees the kernel's weights
    ids = rng.integers(0, cfg.vocab_size, 20).tolist()
    ref = ReferenceEngine(cfg, dict(t)).forward_logits(ids)
    got = sharded_logits(cfg, t, n, ids)
    assert rel(got, sharded_logits(cfg, t, 1, ids)) < FP32_TOL
    assert rel(got, ref) < REF_TOL


@pytest.mark.parametrize("case, n", [("llama_mha_bias_tied", 4), ("qwen3_qknorm_headdim", 4),
                                     ("qwen2_bias_tied", 2), ("llama_gqa_llama3", 2)])
def test_goldens_sharded_match_transformers(case, n):
    path = GOLDENS / case
    cfg = ModelConfig.from_pretrained(path)
    golden = np.load(path / "golden.npz")
    ids = golden["logits_ids"].tolist()
    t = load_weights(path, cfg, dtype="raw")
    got = sharded_logits(cfg, t, n, ids)
    assert rel(got, sharded_logits(cfg, t, 1, ids)) < FP32_TOL
    assert rel(got, golden["logits"]) < GOLDEN_TOL


def test_engine_refuses_an_unsplittable_gpu_count_before_loading(tiny_checkpoint):
    from replicas.monokernel import MonokernelEngine

    with pytest.raises(TensorParallelError, match="3 GPUs is not supported"):
        MonokernelEngine.from_pretrained(tiny_checkpoint, devices=[0, 1, 2])
    with pytest.raises(TensorParallelError, match="do not divide num_attention_heads=4"):
        MonokernelEngine.from_pretrained(tiny_checkpoint, devices=list(range(8)))
