"""Layout option `mma` (replicas/layout_mma.py, csrc/mk_stream.cuh run_phase under MK_MMA) on the CPU.

The packed weights pack_weights writes for an mma build are run through a numpy model of what each
warp of the kernel does with them (layout_mma.run_units: every lane's A fragment from its 16 bytes,
every slot's B fragment from the shared image act_store leaves, unit -> input chunk as run_phase
computes it) and must give the plain matrices' products with the bf16-rounded inputs — for QKV with
its k-split, O by kv group, gate/up interleaved and the padded LM head, at B = 1, 3 and 8 slots.
Also: the fused down's block slices in whole tiles, the flags, the refusals, and (where nvcc
exists) the sm_90a build.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from replicas import layout_fused, layout_mma
from replicas.checkpoint import make_checkpoint, preset_config
from replicas.layout import KernelLayout, LayoutError
from replicas.monokernel_build import kernel_source, nvcc_command
from replicas.monokernel_weights import pack_weights, to_bf16_bits, to_f32
from replicas.weights import load_weights
from tests.test_monokernel_cpu import flags

FUSED = {"fused_mlp": True, "fused_attn_o": True}
EXACT = 1e-5  # fp64 model of fp32 tensor-core sums vs fp64 products of the same bf16 values


def mma_layout(preset="tiny", batch=1, **kw):
    return KernelLayout.from_config(preset_config(preset), 512, batch=batch, mma=True, **FUSED, **kw)


@pytest.fixture(scope="module")
def packed_tiny(tmp_path_factory):
    path = make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_mma"), seed=3, dtype="bf16")
    cfg = preset_config("tiny")
    tensors = load_weights(path, cfg, dtype="raw")
    return cfg, tensors


def bf16_inputs(rng, b, k):
    """Fresh slot inputs (not zeros), rounded to bf16 as act_store rounds them."""
    x = rng.standard_normal((b, k)).astype(np.float32)
    return to_f32(np, to_bf16_bits(np, x))


def close(got, want):
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= EXACT * np.max(np.abs(want)), np.max(np.abs(got - want))


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_every_packed_phase_computes_the_plain_products(packed_tiny, batch):
    cfg, tensors = packed_tiny
    lay = mma_layout(batch=batch)
    w = pack_weights(np, lay, cfg, tensors)
    rng = np.random.default_rng(batch)
    hp, T = lay.hp, layout_mma.TILE
    n = 1  # a layer other than the first: per-layer strides matter

    # QKV: unit v = tile * S + split, input chunks from split * (Hp / S / 16)
    s = lay.splits["qkv"]
    x = bf16_inputs(rng, batch, hp)
    steps = hp // s // T
    sums = layout_mma.run_units(w["w_qkv"][n].reshape(-1), layout_mma.stage_inputs(x), batch,
                                lambda v: (v % s) * steps, lay.qkv_rows // T * s, steps)
    part = sums.reshape(lay.qkv_rows // T, s, T, batch).transpose(0, 2, 1, 3).reshape(lay.qkv_rows, s, batch)
    close(part.sum(axis=1).T, x.astype(np.float64) @ to_f32(np, w["w_qkv_prefill"][n]).T.astype(np.float64))

    # O: unit v = group * (H / 16) + tile, input chunks from group * GDp / 16 (the group's staged output)
    gdp, per_group = w["w_o"].shape[-1], cfg.hidden_size // T
    xo = bf16_inputs(rng, batch, lay.kv_heads * gdp)
    sums = layout_mma.run_units(w["w_o"][n].reshape(-1), layout_mma.stage_inputs(xo), batch,
                                lambda v: (v // per_group) * (gdp // T), lay.kv_heads * per_group, gdp // T)
    by_group = sums.reshape(lay.kv_heads, cfg.hidden_size, batch)
    o_plain = to_f32(np, w["w_o_prefill"][n]).astype(np.float64)  # [H, Qp] (columns g*G*D.. are group g's)
    gd = lay.group * lay.head_dim
    xo_cols = np.concatenate([xo[:, g * gdp:g * gdp + gd] for g in range(lay.kv_heads)], axis=1)
    close(by_group.sum(axis=0).T, xo_cols.astype(np.float64) @ o_plain[:, :lay.q_dim].T)

    # gate/up: one unit per tile, the gate chunk then the up chunk of each k-step
    xg = bf16_inputs(rng, batch, hp)
    gate, up = layout_mma.run_units(w["w_gu"][n].reshape(-1), layout_mma.stage_inputs(xg), batch,
                                    lambda v: 0, lay.inter // T, hp // T, two=True)
    gu_plain = to_f32(np, w["w_gu_prefill"][n]).astype(np.float64)  # [I, 2, Hp]
    close(gate.reshape(lay.inter, batch).T, xg.astype(np.float64) @ gu_plain[:, 0].T)
    close(up.reshape(lay.inter, batch).T, xg.astype(np.float64) @ gu_plain[:, 1].T)

    # LM head: vocabulary padded to whole tiles with zero rows
    assert w["w_lm"].shape == (layout_mma.vocab_rows(lay), hp)
    xl = bf16_inputs(rng, batch, hp)
    sums = layout_mma.run_units(w["w_lm"].reshape(-1), layout_mma.stage_inputs(xl), batch,
                                lambda v: 0, layout_mma.vocab_rows(lay) // T, hp // T)
    logits = sums.reshape(-1, batch)
    close(logits[:cfg.vocab_size].T, xl.astype(np.float64) @ to_f32(np, w["w_lm_prefill"]).T.astype(np.float64))
    assert not logits[cfg.vocab_size:].any()


def test_the_prefill_copies_are_the_plain_layout(packed_tiny):
    cfg, tensors = packed_tiny
    plain = pack_weights(np, KernelLayout.from_config(cfg, 512, **FUSED), cfg, tensors)
    mma = pack_weights(np, mma_layout(), cfg, tensors)
    assert np.array_equal(mma["w_qkv_prefill"], plain["w_qkv"])
    assert np.array_equal(mma["w_gu_prefill"], plain["w_gu"])
    assert np.array_equal(mma["w_lm_prefill"], plain["w_lm"])
    for name in ("w_dn", "w_dn_prefill", "w_o_prefill", "embed", "ln1", "lnf"):  # untouched by mma
        assert np.array_equal(mma[name], plain[name]), name
    for name in ("w_qkv", "w_gu", "w_o"):  # the same values, re-tiled
        assert mma[name].shape == plain[name].shape and not np.array_equal(mma[name], plain[name])
        assert np.array_equal(np.sort(mma[name], axis=None), np.sort(plain[name], axis=None)), name


def test_act_words_give_each_slot_lane_its_b_fragment():
    """Lane 4b + t of chunk c reads words 2(c*4B + 4b + t) and +1: slot b's k = 2t, 2t+1 and 2t+8, 2t+9."""
    for batch in (1, 2, 5, 8):
        k = 64
        idx = np.stack([layout_mma.act_word(b, np.arange(k), batch) for b in range(batch)])
        assert sorted(idx.ravel().tolist()) == list(range(batch * k))  # every element once, nothing else
        for b in range(batch):
            for c in range(k // 16):
                for t in range(4):
                    word = 2 * (c * 4 * batch + 4 * b + t)
                    want = [16 * c + 2 * t, 16 * c + 2 * t + 1, 16 * c + 2 * t + 8, 16 * c + 2 * t + 9]
                    assert [int(np.where(idx[b] == 2 * word + e)[0][0]) for e in (0, 1, 2, 3)] == want


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b", "qwen3-0.6b"])
def test_fused_down_slices_are_whole_tiles_and_still_sum_to_down(preset):
    lay = mma_layout(preset, batch=4)
    cuts = [layout_fused.block_rows(lay.inter, lay.num_sms, b, 16) for b in range(lay.num_sms)]
    assert cuts[0][0] == 0 and cuts[-1][1] == lay.inter
    assert all(a % 16 == 0 and e == b2 for (a, e), (b2, _) in zip(cuts, cuts[1:]))
    assert max(e - a for a, e in cuts) <= layout_fused.slice_floats(lay)
    if preset == "tiny":
        rng = np.random.default_rng(5)
        down = to_bf16_bits(np, rng.standard_normal((lay.hidden, lay.inter)).astype(np.float32) * 0.05)
        h = rng.standard_normal(lay.inter).astype(np.float32)
        got = layout_fused.simulate_fused_down(lay, layout_fused.pack_down_fused(np, lay, down), h)
        want = to_f32(np, down).astype(np.float64) @ h
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b"])
def test_flags_splits_and_shapes(preset):
    lay = mma_layout(preset, batch=4)
    f = flags(lay)
    assert f["MK_MMA"] == "1" and int(f["MK_VT"]) == layout_mma.vocab_rows(lay) >= lay.vocab
    assert int(f["MK_VT"]) % 16 == 0
    s = lay.splits["qkv"]
    assert lay.hp % (16 * s) == 0  # a unit is whole 16-k steps
    units = lay.qkv_rows // 16 * s
    if units >= lay.total_warps:  # enough units to balance: the most loaded warp within 10% of the mean
        assert (units / lay.total_warps) / -(-units // lay.total_warps) >= 0.9
    assert "MK_MMA" not in flags(KernelLayout.from_config(preset_config(preset), 512, batch=4, **FUSED))


def test_refusals_say_what_to_change():
    cfg = preset_config("tiny")
    with pytest.raises(LayoutError, match="mma needs the fused layout"):
        KernelLayout.from_config(cfg, 512, mma=True)
    tp2 = type("L", (), {"mma": True, "fused_mlp": True, "fused_attn_o": True, "tp": 2})()
    assert "mma is single-GPU only" in layout_mma.mma_error(tp2)
    odd = type("L", (), {"mma": True, "fused_mlp": True, "fused_attn_o": True, "tp": 1,
                         "hidden": 2048, "inter": 8200, "qkv_rows": 3072})()
    assert "intermediate=8200 is not a multiple of 16" in layout_mma.mma_error(odd)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot check the sm_90a build")
@pytest.mark.parametrize("preset,batch", [("llama-3.2-1b", 1)])  # (mma is an explicit choice, no engine's
# default; the emulation runs its batch builds; tests/test_layout_mma_mlp_cpu.py compiles the batch defaults)
def test_mma_kernel_compiles_for_sm90a(preset, batch, tmp_path):
    lay = mma_layout(preset, batch=batch)
    src = tmp_path / "mk.cu"
    src.write_text(kernel_source())
    r = subprocess.run(nvcc_command(lay, src, tmp_path / "mk.cubin"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "mk.cubin").stat().st_size > 0


def test_tile_row_gathers_each_row_of_the_accumulator_fragment():
    """The C fragment of mma.m16n8k16 (PTX ISA): lane l = 4g + t holds c0 = (row g, col 2t), c1 = (g, 2t+1),
    c2 = (g+8, 2t), c3 = (g+8, 2t+1). tile_row's source for (row r, slot b) must be exactly that element."""
    rng = np.random.default_rng(9)
    tile = rng.standard_normal((16, 8))
    regs = np.zeros((32, 4))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        regs[lane] = tile[g, 2 * t], tile[g, 2 * t + 1], tile[g + 8, 2 * t], tile[g + 8, 2 * t + 1]
    for r in range(16):
        for b in range(8):
            lane, reg = layout_mma.tile_row_source(r, b)
            assert regs[lane, reg] == tile[r, b], (r, b)


def test_the_prefill_on_an_mma_build_reads_its_plain_copies(packed_tiny):
    """replicas/monokernel_prefill.py (numpy path) on the mma build's weights: the same hidden state,
    logits and KV rows as on the plain fused layout, bit for bit (it must not read the re-tiled matrices)."""
    from replicas.monokernel_prefill import Prefill
    from tests.test_monokernel_sessions_cpu import numpy_model

    cfg, tensors = packed_tiny
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, 23).tolist()
    runs = []
    for lay in (KernelLayout.from_config(cfg, 512, **FUSED), mma_layout()):
        m = numpy_model(cfg, pack_weights(np, lay, cfg, tensors))
        x, logits = Prefill(m, np).run(ids, all_logits=True)
        runs.append((x, logits, m.k_cache.copy(), m.v_cache.copy()))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
    assert np.abs(runs[0][1]).max() > 0 and runs[0][2][:, :, :len(ids)].any()  # real values, not zeros
