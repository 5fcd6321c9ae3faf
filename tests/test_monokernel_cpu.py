"""CPU-side pieces of the monokernel engine: layout/compile flags, weight re-layout, prefill math,
source assembly, and (where nvcc exists) that the kernel compiles for sm_90a."""

from __future__ import annotations

import shutil
import subprocess
import types

import ml_dtypes
import numpy as np
import pytest

from replicas import layout as L
from replicas.checkpoint import preset_config
from replicas.layout import KernelLayout, LayoutError, choose_split, params_header
from replicas.model import ModelConfig
from replicas.monokernel_build import kernel_source, nvcc_command
from replicas.monokernel_weights import pack_weights, rope_tables, to_bf16_bits, to_f32
from replicas.weights import load_weights


def flags(lay: KernelLayout) -> dict[str, str]:
    return dict(f[2:].split("=", 1) for f in lay.compile_flags())


def test_llama_1b_flags_and_balance():
    lay = KernelLayout.from_config(preset_config("llama-3.2-1b"), max_ctx=4096, num_sms=132, control_warp=False)
    f = flags(lay)
    assert (f["MK_H"], f["MK_I"], f["MK_NH"], f["MK_NKV"], f["MK_D"], f["MK_V"]) == \
        ("2048", "8192", "32", "8", "64", "128256")
    assert f["MK_MAX_CTX"] == "4096" and f["MK_THREADS"] == str(L.THREADS)
    # 3072 QKV rows over 2112 warps balance badly unsplit (1.45 vs 2 rows); halves balance.
    assert lay.splits == {"qkv": 2, "o": 1, "dn": 1}
    assert lay.smem_bytes <= L.SMEM_LIMIT and lay.ring_slots >= 16
    # Unpadded shapes: the stream is exactly the weight bytes a decode step must read (no norms).
    assert abs(lay.stream_bytes_per_token() - preset_config("llama-3.2-1b").decode_bytes_per_token()) < 1e6


def test_every_phase_is_balanced_across_warps():
    for preset in ("llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b"):
        lay = KernelLayout.from_config(preset_config(preset), max_ctx=4096, num_sms=132, control_warp=False)
        for rows, name in ((lay.qkv_rows, "qkv"), (lay.hidden, "o"), (lay.hidden, "dn")):
            units = rows * lay.splits[name]
            assert (units / lay.total_warps) / -(-units // lay.total_warps) >= 0.9, (preset, name)


def test_split_choice_balances_warps():
    assert choose_split(3072, 2048, 2112) == 2
    assert choose_split(4096, 4096, 2112) == 1  # 1.94 of 2 rows per warp: good enough
    assert choose_split(100, 256, 2112) == 1  # cannot split below one 256-element chunk


def test_tiny_is_padded_to_whole_chunks():
    lay = KernelLayout.from_config(preset_config("tiny"), max_ctx=64, num_sms=132)
    assert (lay.hp, lay.qp, lay.ip) == (256, 256, 512)
    assert lay.packed_shapes()["w_gu"] == (4, 384, 2, 256)


def test_unsupported_shapes_are_refused_clearly():
    raw = dict(preset_config("tiny").model_dump())
    raw["head_dim"] = 48
    with pytest.raises(LayoutError, match="head_dim=48"):
        KernelLayout.from_config(ModelConfig(**raw), max_ctx=64)
    with pytest.raises(LayoutError, match="max_ctx"):
        KernelLayout.from_config(preset_config("tiny"), max_ctx=1)


def test_params_header_mirrors_fields():
    h = params_header()
    for name, ctype in L.PARAM_FIELDS:
        assert f"  {ctype} {name};" in h
    assert f"sizeof(MkParams) == {8 * len(L.PARAM_FIELDS)}" in h


def test_bf16_rounding_matches_ml_dtypes():
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 10
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(to_bf16_bits(np, x), want)
    assert np.array_equal(to_f32(np, want), want.view(ml_dtypes.bfloat16).astype(np.float32))


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    return tiny_checkpoint, cfg, load_weights(tiny_checkpoint, cfg, dtype="raw")


def test_pack_weights_places_every_row(tiny):
    _, cfg, t = tiny
    lay = KernelLayout.from_config(cfg, max_ctx=64)
    w = pack_weights(np, lay, cfg, t)
    H, Q, KV = cfg.hidden_size, cfg.q_dim, cfg.kv_dim
    a = "model.layers.2.self_attn."
    assert np.array_equal(w["w_qkv"][2, :Q, :H], t[a + "q_proj.weight"])
    assert np.array_equal(w["w_qkv"][2, Q + KV:, :H], t[a + "v_proj.weight"])
    assert not w["w_qkv"][:, :, H:].any()  # padding is zero
    assert np.array_equal(w["w_gu"][1, 7, 0, :H], t["model.layers.1.mlp.gate_proj.weight"][7])
    assert np.array_equal(w["w_gu"][1, 7, 1, :H], t["model.layers.1.mlp.up_proj.weight"][7])
    assert np.array_equal(w["w_dn"][3, :, :cfg.intermediate_size], t["model.layers.3.mlp.down_proj.weight"])
    assert np.array_equal(w["w_lm"][:, :H], t["lm_head.weight"])
    assert w["ln1"].dtype == np.float32 and np.array_equal(w["ln1"][0], to_f32(np, t["model.layers.0.input_layernorm.weight"]))
    for name, shape in lay.packed_shapes().items():
        assert w[name].shape == shape and w[name].dtype == np.uint16


def test_prefill_math_matches_reference(tiny):
    """The prefill's structure (packed views, GQA, RoPE, bf16 KV) on numpy vs the reference engine."""
    from replicas.monokernel_prefill import Prefill
    from replicas.reference import ReferenceEngine

    path, cfg, t = tiny
    lay = KernelLayout.from_config(cfg, max_ctx=64)
    m = types.SimpleNamespace(config=cfg, weights=pack_weights(np, lay, cfg, t))
    m.rope_cos, m.rope_sin = rope_tables(cfg, 64)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, 64, cfg.head_dim)
    m.k_cache, m.v_cache = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 24).tolist()
    x_last, logits = Prefill(m, np).run(ids, all_logits=True)
    ref = ReferenceEngine.from_pretrained(path).forward_logits(ids)
    assert np.max(np.abs(logits - ref)) / np.max(np.abs(ref)) < 5e-3
    assert m.k_cache[:, :, :24].any() and not m.k_cache[:, :, 24:].any()
    assert x_last.shape == (cfg.hidden_size,)


def test_kernel_source_is_self_contained():
    src = kernel_source()
    assert '#include "' not in src and "struct __align__(8) MkParams" in src
    assert "extern \"C\" __global__ void MK_CLUSTER_DIMS __launch_bounds__" in src  # (MK_CLUSTER_DIMS: pair_norm)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot check the sm_90a build")
@pytest.mark.parametrize("preset", ["tiny", "qwen3-0.6b"])
def test_kernel_compiles_for_sm90a(preset, tmp_path):
    lay = KernelLayout.from_config(preset_config(preset), max_ctx=2048)
    src = tmp_path / "mk.cu"
    src.write_text(kernel_source())
    r = subprocess.run(nvcc_command(lay, src, tmp_path / "mk.cubin"), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "spill" in r.stderr  # ptxas -v resource report was produced


def test_engine_without_cupy_says_how_to_fix(tiny_checkpoint):
    pytest.importorskip("numpy")
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    from replicas.monokernel import MonokernelEngine, MonokernelUnavailable

    with pytest.raises(MonokernelUnavailable, match="CuPy"):
        MonokernelEngine.from_pretrained(tiny_checkpoint)
