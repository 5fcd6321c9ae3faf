"""Layout option `fused_attn_o` (O-proj inside the attention phase, off by default) on the CPU: the
loader packs O by kv group; a numpy model of the kernel's order (split-KV partials, per-group
combine, per-(group, row) fp32 dots, int64 fixed point over groups) fed by `pack_weights` matches the
reference engine's attention + O; prefill is unchanged; tp > 1 is refused; default builds keep their
flags and shapes; the variant (alone and with fused_mlp) compiles for sm_90a where nvcc exists."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from replicas import layout_attn_o as A
from replicas.checkpoint import preset_config
from replicas.layout import KernelLayout, LayoutError
from replicas.monokernel_build import kernel_source, nvcc_command
from replicas.monokernel_weights import pack_weights
from replicas.reference import ReferenceEngine
from replicas.tp_shard import shard_config
from replicas.weights import load_weights


def layout(preset: str, num_sms: int = 132, **kw) -> KernelLayout:
    return KernelLayout.from_config(preset_config(preset), max_ctx=256, num_sms=num_sms, fused_attn_o=True, **kw)


def test_o_is_packed_by_kv_group_and_the_prefill_keeps_plain_rows(tiny_checkpoint):
    cfg = preset_config("tiny")
    lay = layout("tiny")
    raw = load_weights(tiny_checkpoint, cfg, dtype="raw")
    packed = pack_weights(np, lay, cfg, raw)
    gd, gdp = lay.group * lay.head_dim, A.group_len(lay)
    assert packed["w_o"].shape == (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size, gdp)
    for n in range(cfg.num_hidden_layers):
        o = raw[f"model.layers.{n}.self_attn.o_proj.weight"]
        for g in range(cfg.num_key_value_heads):
            np.testing.assert_array_equal(packed["w_o"][n, g, :, :gd], o[:, g * gd:(g + 1) * gd])
        assert not packed["w_o"][n, :, :, gd:].any()  # padding is zero (a unit is a whole chunk)
        np.testing.assert_array_equal(packed["w_o_prefill"][n, :, :cfg.q_dim], o)


@pytest.mark.parametrize("sms, ctx", [(132, 150), (5, 150), (132, 7)])
def test_simulated_attention_and_o_match_the_reference_engine(tiny_checkpoint, sms, ctx):
    """Every tiny layer, through pack_weights (the GPU loader's code); 1-3 KV splits per group."""
    cfg = preset_config("tiny")
    lay = KernelLayout.from_config(cfg, max_ctx=256, num_sms=sms, fused_attn_o=True)
    packed = pack_weights(np, lay, cfg, load_weights(tiny_checkpoint, cfg, dtype="raw"))
    ref = ReferenceEngine.from_pretrained(tiny_checkpoint)
    rng = np.random.default_rng(2)
    worst = 0.0
    for li, w in enumerate(ref.layers):
        q = rng.standard_normal((cfg.num_attention_heads, cfg.head_dim)).astype(np.float32) * 2
        keys = rng.standard_normal((ctx, cfg.num_key_value_heads, cfg.head_dim)).astype(np.float32) * 2
        values = rng.standard_normal((ctx, cfg.num_key_value_heads, cfg.head_dim)).astype(np.float32)
        want = ref._attention(q[None], keys, values, ctx - 1)[0] @ w.o.T
        got = A.simulate_attn_o(lay, packed["w_o"][li], q, keys, values)
        worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
    assert worst < 1e-5, worst  # fp32 reordering + 2^-32 fixed point: far below the 2e-2 budget


def test_prefill_matches_the_reference_under_both_fused_options(tiny_checkpoint):
    import types

    from replicas.monokernel_prefill import Prefill
    from replicas.monokernel_weights import rope_tables

    cfg = preset_config("tiny")
    lay = KernelLayout.from_config(cfg, max_ctx=64, num_sms=132, fused_attn_o=True, fused_mlp=True)
    m = types.SimpleNamespace(config=cfg, weights=pack_weights(np, lay, cfg, load_weights(tiny_checkpoint, cfg, dtype="raw")))
    m.rope_cos, m.rope_sin = rope_tables(cfg, 64)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, 64, cfg.head_dim)
    m.k_cache, m.v_cache = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 24).tolist()
    _, logits = Prefill(m, np).run(ids, all_logits=True)
    ref = ReferenceEngine.from_pretrained(tiny_checkpoint).forward_logits(ids)
    assert np.max(np.abs(logits - ref)) / np.max(np.abs(ref)) < 5e-3


def test_bad_combinations_are_refused_clearly():
    c = preset_config("tiny")
    with pytest.raises(LayoutError, match="fused_attn_o is single-GPU only"):
        KernelLayout.from_config(shard_config(c, 2), max_ctx=64, tp=2, vocab_total=c.vocab_size, fused_attn_o=True)
    with pytest.raises(LayoutError, match="drop qkv_flags"):
        KernelLayout.from_config(c, max_ctx=64, qkv_flags=True, fused_attn_o=True)


def test_default_builds_see_no_attn_o_flags_and_the_option_shapes():
    lay = KernelLayout.from_config(preset_config("llama-3.2-1b"), max_ctx=4096, num_sms=132)
    assert not [f for f in lay.compile_flags() if "ATTN_O" in f or "MK_AO" in f]
    assert lay.packed_shapes()["w_o"] == (16, 2048, 2048)
    on = layout("llama-3.2-1b", fused_mlp=True)
    f = dict(x[2:].split("=", 1) for x in on.compile_flags())
    assert (f["MK_ATTN_O"], f["MK_AO_GDP"], f["MK_S_O"], f["MK_FUSED_MLP"]) == ("1", "256", "1", "1")
    assert on.packed_shapes()["w_o"] == (16, 8, 2048, 256)
    assert on.buffer_sizes()["o_part"] == 2 * on.hp  # one int64 accumulator


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot check the sm_90a build")
@pytest.mark.parametrize("preset, with_mlp", [("tiny", False), ("llama-3.2-1b", True)])
def test_fused_attn_o_kernel_compiles_for_sm90a(preset, with_mlp, tmp_path):
    src = tmp_path / "mk.cu"
    src.write_text(kernel_source())
    r = subprocess.run(nvcc_command(layout(preset, fused_mlp=with_mlp), src, tmp_path / "mk.cubin"), check=False,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "spill" in r.stderr
