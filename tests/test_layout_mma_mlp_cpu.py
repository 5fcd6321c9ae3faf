"""Layout option `mma_mlp` (replicas/layout_mma_mlp.py, csrc/mk_mlp_mma.cuh) on the CPU.

1. The packing and the warp shares: every packed gate/up and down element is streamed by exactly one
   warp, and a numpy model of what the warps compute from the packed buffers (layout_mma_mlp.simulate_mlp)
   gives the MLP of the plain matrices with the kernel's bf16 roundings (x and h), on uneven block slices.
2. The kernel itself on the CPU emulation: a B = 4 mma_mlp build decoding 3 sequences gives each the
   single-sequence kernel's logits within bf16-input distance, and the reference engine's within the
   transformers tolerance; the batched engine's scheduler (joins, handovers to the B = 1 build, which
   keeps the CUDA-core MLP on its own packing) keeps every request's greedy tokens.
3. Refusals, flags, shared memory and the sm_90a build (where nvcc exists).
4. The other batch options of the same work: norm_once (the prologue loads every slot once: bit-identical),
   mma_lm (the LM head on tensor cores: layout_mma's tiles, bf16 input), mma_qkv and mma_o (QKV and the O-proj
   block-tiled on tensor cores like the gate/up, csrc/mk_block_mma.cuh; not yet run on a GPU, so off by default).
"""

from __future__ import annotations

import platform
import shutil
import subprocess

import numpy as np
import pytest

from replicas import layout_fused, layout_mma_mlp as M
from replicas.checkpoint import preset_config
from replicas.layout import KernelLayout, LayoutError
from replicas.layout_tuned import TUNED_BATCH, engine_options
from replicas.monokernel_build import kernel_source, nvcc_command
from replicas.monokernel_weights import pack_weights, to_bf16_bits, to_f32

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None or platform.machine() not in ("x86_64", "AMD64"),
                               reason="the CPU emulation needs g++ on x86-64")


def mlp_layout(preset="tiny", batch=4, num_sms=5, **kw):
    cfg = preset_config(preset)
    return KernelLayout.from_config(cfg, 512, num_sms=num_sms,
                                    **engine_options(cfg, {"batch": batch, "mma_mlp": True, **kw}))


def small_tensors(cfg, seed=4):
    from replicas.weights import expected_tensors
    rng = np.random.default_rng(seed)
    return {k: to_bf16_bits(np, (1.0 if k.endswith("norm.weight") else 0.0)
                            + (0.1 if k.endswith("norm.weight") else 0.08) * rng.standard_normal(s).astype(np.float32))
            for k, s in expected_tensors(cfg).items()}


@pytest.mark.parametrize("preset,num_sms,pair_dn", [("tiny", 5, False), ("tiny", 4, False), ("llama-3.2-1b", 116, False),
                                                    ("llama-3.1-8b", 132, False), ("tiny", 4, True), ("tiny", 6, True),
                                                    ("llama-3.2-1b", 116, True), ("llama-3.1-8b", 132, True)])
def test_every_packed_element_is_streamed_by_exactly_one_warp(preset, num_sms, pair_dn):
    lay = mlp_layout(preset, num_sms=num_sms, pair_dn=pair_dn)
    W, ks = lay.warps_per_block, M.k_steps(lay)
    gu, dn = np.zeros(lay.inter * 2 * lay.hp // 256, np.int32), np.zeros(lay.inter * lay.hidden // 256, np.int32)
    for b in range(lay.num_sms):
        for w in range(W):
            t0, q0, q1 = M.gu_share(lay, b, w)
            gu[2 * (t0 * ks + q0):2 * (t0 * ks + q1)] += 1  # chunks of the warp's gate/up run
            js, nt, o0, o1 = M.dn_share(lay, b, w)
            start = (js * lay.hidden + o0 * nt * 256) // 256
            dn[start:start + (o1 - o0) * nt] += 1
    assert (gu == 1).all() and (dn == 1).all()
    assert M.max_block_tiles(lay) * 16 <= layout_fused.slice_floats(lay)
    # pair_dn: each block of a pair downs half the output rows over both blocks' h rows, which fit its h region
    for b in range(lay.num_sms):
        js, nt, a, e = M.dn_block(lay, b)
        assert nt * 16 <= layout_fused.slice_floats(lay) * (2 if pair_dn else 1)
        assert (e - a) == (lay.hidden // 16 // 2 if pair_dn else lay.hidden // 16) or (pair_dn and e - a == -(-lay.hidden // 32))


@pytest.mark.parametrize("num_sms,live,pair_dn", [(5, (0, 1, 2, 3), False), (3, (0, 2), False), (4, (0, 1, 2, 3), True),
                                                  (6, (1, 3), True)])
def test_the_warps_compute_the_plain_mlp_with_bf16_inputs(num_sms, live, pair_dn):
    lay = mlp_layout(num_sms=num_sms, pair_dn=pair_dn)
    cfg = preset_config("tiny")
    tensors = small_tensors(cfg)
    w = pack_weights(np, lay, cfg, tensors)
    rng = np.random.default_rng(num_sms)
    x = np.zeros((4, lay.hp), np.float32)
    x[:, :lay.hidden] = rng.standard_normal((4, lay.hidden))
    got = M.simulate_mlp(lay, w["w_gu"][0].reshape(-1), w["w_dn"][0].reshape(-1), x, live=live)
    gate = to_f32(np, tensors["model.layers.0.mlp.gate_proj.weight"]).astype(np.float64)
    up = to_f32(np, tensors["model.layers.0.mlp.up_proj.weight"]).astype(np.float64)
    down = to_f32(np, tensors["model.layers.0.mlp.down_proj.weight"]).astype(np.float64)
    xb = M.round_bf16(x[:, :lay.hidden]).astype(np.float64)
    g, u = xb @ gate.T, xb @ up.T
    h = M.round_bf16(g / (1 + np.exp(-g)) * u).astype(np.float64)
    want = h @ down.T
    for b in range(4):
        if b in live:  # (an h element's bf16 rounding may flip on fp32 vs fp64 sums: 2^-8 of one term)
            assert np.max(np.abs(got[b] - want[b])) <= 2e-3 * np.max(np.abs(want[b])), b
        else:
            assert not got[b].any()  # finished slots add nothing
    # the plain copies stay for the prefill and the single-sequence build
    plain = pack_weights(np, KernelLayout.from_config(cfg, 512, num_sms=num_sms, **engine_options(cfg, {"batch": 4})),
                         cfg, tensors)
    assert np.array_equal(w["w_gu_prefill"], plain["w_gu"]) and np.array_equal(w["w_dn_prefill"], plain["w_dn_prefill"])


def test_the_single_build_gets_the_plain_gate_up_and_its_own_down():
    from replicas.monokernel_batch import BATCH_ONLY_OPTIONS, regrid_weights
    cfg = preset_config("tiny")
    tensors = small_tensors(cfg)
    single = KernelLayout.from_config(cfg, 512, num_sms=6, **engine_options(cfg, {}))
    want = pack_weights(np, single, cfg, tensors)
    for extra in ({"mma_qkv": False, "mma_o": False, "fx_pack": False}, {}):  # (every tensor-core option re-tiles its matrix)
        lay = mlp_layout(num_sms=4, **{**TUNED_BATCH, **extra})
        assert all(k in BATCH_ONLY_OPTIONS for k in {**TUNED_BATCH, **extra})
        packed = pack_weights(np, lay, cfg, tensors)
        got = regrid_weights(np, packed, lay, single, cfg)
        for name in ("w_gu", "w_dn", "w_qkv", "w_o", "w_lm"):
            assert np.array_equal(got[name], want[name]), name
            if name in ("w_gu", "w_dn", "w_lm") or lay.mma_qkv:
                assert not np.array_equal(packed[name], want[name]), name  # (the batch build's own tiles)


def test_flags_and_shared_memory():
    for preset in ("llama-3.2-1b", "llama-3.1-8b"):
        for b in (2, 4, 8):
            lay = mlp_layout(preset, batch=b, num_sms=116, ao_slots=True, resident=True)
            f = dict(x[2:].split("=", 1) for x in lay.compile_flags())
            assert f["MK_MMA_MLP"] == "1" and int(f["MK_MMLP_PIECES"]) == M.pieces(lay) == 16 + M.max_block_tiles(lay) - 1
            assert M.piece_floats(lay) == M.pieces(lay) * 2 * 16 * ((b + 1) // 2 * 2)
            assert "MK_GU_IL" not in f and lay.ring_slots >= 8
    cfg = preset_config("llama-3.2-1b")
    assert "MK_MMA_MLP" not in " ".join(KernelLayout.from_config(cfg, 512, **engine_options(cfg, {"batch": 4})).compile_flags())


def test_refusals_say_what_to_change():
    cfg = preset_config("tiny")
    for bad, msg in (({"batch": 1}, "batch-build option"), ({"batch": 4, "gu_il": True}, "drop mma and gu_il"),
                     ({"batch": 4, "l2_budget": 1 << 20}, "l2_budget=0")):
        with pytest.raises(LayoutError, match=msg):
            KernelLayout.from_config(cfg, 512, **engine_options(cfg, {"mma_mlp": True, **bad}))
    odd = type("L", (), {"mma_mlp": True, "batch": 4, "mma": False, "gu_il": False, "tp": 1, "fused_mlp": True,
                         "l2_budget": 0, "hidden": 2048, "inter": 8200})()
    assert "intermediate=8200 is not a multiple of 16" in M.mma_mlp_error(odd)


@needs_gxx
@pytest.mark.parametrize("dims,num_sms", [({}, 4), ({"hidden_size": 512, "intermediate_size": 768,
                                                      "num_attention_heads": 8}, 5)], ids=["tiny-dims", "wide"])
def test_batch_slots_match_the_single_kernel_and_the_reference(dims, num_sms):
    """Emulated B = 4 mma_mlp build, 3 sequences of different lengths (one finishing first, one slot empty).
    Bounds: vs the single-sequence kernel (fp32 MLP inputs) 3e-2 of the largest logit, as act_bf16's bf16
    inputs (measured 3.8-6.5e-3 on the wide model) and not bit-equal (1e-5: the bf16 path really runs); vs the
    fp32 reference engine 2e-2 (the GPU tests' transformers bound; the single kernel itself is 1.8e-2 away)."""
    from replicas.monokernel_emu import EmuModel
    from replicas.reference import ReferenceEngine
    from tests.test_monokernel_emu_cpu import rel, small_family

    cfg, bits, f32 = small_family("llama-3.2-1b", **dims)
    rng = np.random.default_rng(23)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (28, 19, 24)]
    many = EmuModel(cfg, dict(bits), layout_options={"batch": 4, "mma_mlp": True}, num_sms=num_sms)
    assert "-DMK_MMA_MLP=1" in many.layout.compile_flags()
    one = EmuModel(cfg, dict(bits), num_sms=num_sms)
    ref = ReferenceEngine(cfg, dict(f32))
    for s, got in zip(seqs, many.forward_logits_slots(seqs)):
        want = one.forward_logits(s)
        assert got.shape == want.shape
        assert 1e-5 < rel(got, want) <= 3e-2
        assert rel(got[16:], ref.forward_logits(s)[16:]) <= 2e-2


@pytest.mark.parametrize("preset,num_sms", [("tiny", 3), ("tiny", 4), ("llama-3.2-1b", 116), ("llama-3.2-1b", 132),
                                             ("llama-3.1-8b", 116)])
def test_mma_qkv_units_cover_the_matrix_once_and_balance_the_blocks(preset, num_sms):
    cfg = preset_config(preset)
    lay = KernelLayout.from_config(cfg, 512, num_sms=num_sms, **engine_options(cfg, {"batch": 4, "mma_qkv": True}))
    units, steps = M.qkv_units(lay)
    s = lay.splits["qkv"]
    assert units == lay.qkv_rows // 16 * s and steps * s == lay.hp // 16
    per_block = [b - a for a, b in (M.block_units(units, num_sms, k) for k in range(num_sms))]
    assert max(per_block) <= -(-units // num_sms) and (units / num_sms) / max(per_block) >= 0.8
    seen = np.zeros(units * steps, np.int32)  # chunks of the packed matrix
    for b in range(num_sms):
        for w in range(lay.warps_per_block):
            v0, q0, q1 = M.tile_share(lay, units, steps, b, w)
            seen[v0 * steps + q0:v0 * steps + q1] += 1
    assert (seen == 1).all()
    assert "-DMK_MMA_QKV=1" in lay.compile_flags() and M.pieces(lay) >= lay.warps_per_block


@pytest.mark.parametrize("preset,num_sms", [("tiny", 3), ("tiny", 5), ("llama-3.2-1b", 116), ("llama-3.1-8b", 132)])
def test_mma_o_tiles_cover_each_groups_o_once_on_its_own_blocks(preset, num_sms):
    cfg = preset_config(preset)
    lay = KernelLayout.from_config(cfg, 512, num_sms=num_sms, **engine_options(cfg, {**TUNED_BATCH, "batch": 4,
                                                                                     "mma_o": True}))
    tiles, steps = lay.hidden // 16, M.layout_attn_o.group_len(lay) // 16
    seen = np.zeros(lay.kv_heads * tiles * steps, np.int32)
    for b in range(num_sms):
        v0, v1 = M.o_block_units(lay, b)
        assert v1 > v0 and v0 // tiles == (v1 - 1) // tiles  # every block has tiles, all of one kv group
        for w in range(lay.warps_per_block):
            u0, q0, q1 = M.o_share(lay, b, w)
            seen[u0 * steps + q0:u0 * steps + q1] += 1
    assert (seen == 1).all() and "-DMK_MMA_O=1" in lay.compile_flags()


@needs_gxx
def test_mma_qkv_and_mma_o_slots_match_the_single_kernel():
    """mma_qkv and mma_o on top of the batched engine's defaults, on tiny dims at 6 blocks (QKV k-split S = 2: two
    partials per row; O: 3 blocks per kv group) and the wide model at 5 (S = 1; blocks 2 / 3 per group): each slot
    within 3e-2 of the single kernel (bf16 QKV and O inputs; measured 6.2e-3-1.6e-2, the all-bf16 mma build being
    1.65e-2 away on the wide model), and mma_o alone (on the defaults) within 3e-2 too (measured 4.8-6.4e-3)."""
    from replicas.monokernel_emu import EmuModel
    from tests.test_monokernel_emu_cpu import rel, small_family

    for dims, sms, split in (({"hidden_size": 128, "intermediate_size": 384}, 6, 2),
                             ({"hidden_size": 512, "intermediate_size": 768, "num_attention_heads": 8}, 5, 1)):
        cfg, bits, _ = small_family("llama-3.2-1b", **dims)
        rng = np.random.default_rng(31)
        seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (26, 17, 21)]
        one = EmuModel(cfg, dict(bits), num_sms=sms)
        want = [one.forward_logits(s) for s in seqs]
        for extra in ({"mma_qkv": True, "mma_o": True},) + (({"mma_o": True},) if sms == 5 else ()):
            many = EmuModel(cfg, dict(bits), layout_options={"batch": 4, **TUNED_BATCH, **extra}, num_sms=sms)
            assert many.layout.splits["qkv"] == (split if "mma_qkv" in extra else many.layout.splits["qkv"])
            for got, w in zip(many.forward_logits_slots(seqs), want):
                assert 1e-5 < rel(got, w) <= 3e-2, extra
    with pytest.raises(LayoutError, match="mma_qkv puts a batch build's QKV on tensor cores"):
        KernelLayout.from_config(cfg, 256, **engine_options(cfg, {"mma_qkv": True}))
    with pytest.raises(LayoutError, match="mma_o puts a batch build's O-proj on tensor cores"):
        KernelLayout.from_config(cfg, 256, **engine_options(cfg, {"batch": 4, "mma_o": True}))


@needs_gxx
def test_half_vec_moves_only_offsets_and_gives_the_ring_the_rest():
    """half_vec: with every matvec input on tensor cores (the batch defaults) the staged slot vectors are bf16, so they
    take half the shared memory and the weight ring the rest; only offsets move, so the logits are the defaults'
    bit for bit (CPU emulation, 5 blocks, three slots). On the real shapes the ring deepens (8B B = 8: 9 -> 17)."""
    from replicas.layout_tuned import TUNED_BATCH
    from replicas.monokernel_emu import EmuModel
    from tests.test_monokernel_emu_cpu import small_family

    cfg, bits, _ = small_family("llama-3.2-1b", intermediate_size=768)
    rng = np.random.default_rng(47)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (23, 17, 20)]
    run = lambda **o: EmuModel(cfg, dict(bits), layout_options={"batch": 4, **TUNED_BATCH, **o},
                               num_sms=5).forward_logits_slots(seqs)
    assert all(np.array_equal(a, b) for a, b in zip(run(), run(half_vec=True)))
    for preset, b, before, after in (("llama-3.1-8b", 8, 9, 17), ("llama-3.2-1b", 8, 17, 21), ("llama-3.2-1b", 4, 23, 25)):
        c = preset_config(preset)
        lays = [KernelLayout.from_config(c, 2048, **engine_options(c, {**TUNED_BATCH, "batch": b, **o}))
                for o in ({}, {"half_vec": True})]
        assert [lay.ring_slots for lay in lays] == [before, after], preset
        assert "-DMK_HALF_VEC=1" in lays[1].compile_flags() and "-DMK_HALF_VEC=1" not in lays[0].compile_flags()
    with pytest.raises(LayoutError, match="half_vec .* needs mma_qkv, mma_o, mma_mlp and mma_lm"):
        KernelLayout.from_config(cfg, 256, **engine_options(cfg, {"batch": 4, **TUNED_BATCH, "mma_o": False,
                                                                  "half_vec": True}))


@needs_gxx
@pytest.mark.parametrize("o_bias", [False, True], ids=["plain", "o-bias"])
def test_fold_x_keeps_the_residual_in_the_accumulators(o_bias):
    """fold_x: the O and fused-MLP accumulators start from the residual (the O bias folded in) instead of zero, and
    the prologues read them alone. The residual is then summed exactly in fixed point instead of in fp32, so each
    slot's logits move at the fp32 level from the defaults' (bound 1e-4, the batch-vs-single bound; one bf16 ulp of a
    cached K/V value can flip), on 5 blocks, three slots of different lengths."""
    from replicas.layout_tuned import TUNED_BATCH
    from replicas.model import ModelConfig
    from replicas.monokernel_emu import EmuModel
    from tests.test_monokernel_emu_cpu import rel, small_family

    cfg, bits, _ = small_family("llama-3.2-1b", intermediate_size=768)
    if o_bias:
        cfg = ModelConfig(**{**cfg.model_dump(), "o_bias": True})
        for layer in range(cfg.num_hidden_layers):  # (0.125 + a little per element: an O bias that matters)
            bits[f"model.layers.{layer}.self_attn.o_proj.bias"] = (0x3e00 + np.arange(cfg.hidden_size) % 97).astype(np.uint16)
    rng = np.random.default_rng(53)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (24, 16, 19)]

    def run(fold_x):
        m = EmuModel(cfg, dict(bits), layout_options={"batch": 4, **TUNED_BATCH, "fold_x": fold_x, "fx_pack": False},
                     num_sms=5)  # (int64 words of one slot: fx_pack's lanes are tests/test_fx_pack_cpu.py's)
        assert ("-DMK_FOLD_X=1" in m.layout.compile_flags()) is fold_x
        return m.forward_logits_slots(seqs)

    assert TUNED_BATCH["fold_x"]  # (a batch default since session 12)
    base, folded = run(False), run(True)
    for a, b in zip(folded, base):  # (measured: equal; bf16 matvec inputs absorb the residual's last-ulp moves)
        assert a.shape == b.shape and rel(a, b) <= 1e-4
    with pytest.raises(LayoutError, match="fold_x .* needs batch > 1"):
        KernelLayout.from_config(cfg, 256, **engine_options(cfg, {"fold_x": True}))


@needs_gxx
def test_norm_once_is_bit_identical_and_mma_lm_within_bf16_distance():
    """norm_once only reorders the batch prologue's loads: the same logits bit for bit. mma_lm rounds the LM head's
    input to bf16 (measured 1.5-1.8e-3 from the single kernel; bound 1e-2, half the transformers
    bound); with mma_mlp and norm_once on top, the act_bf16-like 3e-2 of test_batch_slots_match_..."""
    from replicas.monokernel_emu import EmuModel
    from tests.test_monokernel_emu_cpu import rel, small_family

    cfg, bits, _ = small_family("llama-3.2-1b", intermediate_size=768)
    rng = np.random.default_rng(29)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (27, 18, 22)]
    run = lambda **o: EmuModel(cfg, dict(bits), layout_options={"batch": 4, **o}, num_sms=5).forward_logits_slots(seqs)
    base = run()
    assert all(np.array_equal(a, b) for a, b in zip(base, run(norm_once=True)))
    one = EmuModel(cfg, dict(bits), num_sms=5)
    singles = [one.forward_logits(s) for s in seqs]
    for got, want in zip(run(mma_lm=True), singles):
        assert 1e-5 < rel(got, want) <= 1e-2
    for got, want in zip(run(mma_lm=True, mma_mlp=True, norm_once=True), singles):
        assert rel(got, want) <= 3e-2
    for bad in ({"batch": 1}, {"batch": 4, "mma": True}):
        with pytest.raises(LayoutError, match="mma_lm puts a batch build's LM head on tensor cores"):
            KernelLayout.from_config(cfg, 256, **engine_options(cfg, {"mma_lm": True, **bad}))
    with pytest.raises(LayoutError, match="norm_once .* needs batch > 1"):
        KernelLayout.from_config(cfg, 256, **engine_options(cfg, {"norm_once": True}))


@needs_gxx
@pytest.mark.parametrize("preset,dims", [("qwen3-0.6b", {"head_dim": 32}), ("qwen2.5-1.5b", {})],
                         ids=["qwen3-qknorm", "qwen2-qkv-bias-tied"])
def test_the_batch_defaults_serve_the_other_families(preset, dims):
    """The batched engine's defaults (layout_tuned.TUNED_BATCH) on Qwen3 (q/k norm) and Qwen2 (q/k/v bias, tied
    head) shapes: slots within 3e-2 of the single kernel (measured 2.9-4.8e-3) and within the transformers bound
    2e-2 of the fp32 reference engine (measured 3.3-8.6e-3)."""
    from replicas.layout_tuned import TUNED_BATCH
    from replicas.monokernel_emu import EmuModel
    from replicas.reference import ReferenceEngine
    from tests.test_monokernel_emu_cpu import rel, small_family

    cfg, bits, f32 = small_family(preset, **dims)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (24, 18)]
    ref = ReferenceEngine(cfg, dict(f32))
    many = EmuModel(cfg, dict(bits), layout_options={"batch": 4, **TUNED_BATCH}, num_sms=4)
    one = EmuModel(cfg, dict(bits), num_sms=4)
    for s, got in zip(seqs, many.forward_logits_slots(seqs)):
        assert rel(got, one.forward_logits(s)) <= 3e-2
        assert rel(got[16:], ref.forward_logits(s)[16:]) <= 2e-2


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot check the sm_90a build")
@pytest.mark.parametrize("preset,batch", [("llama-3.2-1b", 4), ("llama-3.1-8b", 8)])
def test_mma_mlp_kernel_compiles_for_sm90a(preset, batch, tmp_path):
    """What the batched engines build on an H200 (resident: 116 SMs): their defaults, layout_tuned.batch_options
    (the kernel in clusters of two for pair_dn; 8B with pair_norm too)."""
    from replicas.layout_tuned import batch_options

    c = preset_config(preset)
    lay = KernelLayout.from_config(c, 2048, **engine_options(c, {**batch_options(c, grid_sms=116), "batch": batch,
                                                                 "num_sms": 116, "resident": True}))
    assert lay.mma_mlp and lay.fold_x and lay.pair_dn and lay.pair_norm == (c.hidden_size >= 4096)
    src = tmp_path / "mk.cu"
    src.write_text(kernel_source())
    r = subprocess.run(nvcc_command(lay, src, tmp_path / "mk.cubin"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "mk.cubin").stat().st_size > 0
