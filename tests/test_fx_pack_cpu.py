"""Layout option fx_pack (batch builds; csrc/mk_fx_pack.cuh): two slots share every int64 word of the O and fused-MLP
accumulators as 32-bit fixed-point lanes (2^-16 units), so one atomic carries two slots and a prologue reads half
the bytes. The kernel on the CPU emulation against the same build without it, and the host's lane arithmetic
(replicas/layout_fused.py) against the identity the kernel relies on."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from replicas import layout_fused
from replicas.layout import KernelLayout, LayoutError
from replicas.layout_tuned import TUNED_BATCH, engine_options

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulation needs g++")


@needs_gxx
@pytest.mark.parametrize("batch,o_bias", [(4, False), (3, True)], ids=["b4", "b3-odd-o-bias"])
def test_packed_slots_decode_as_the_int64_accumulators_do(batch, o_bias):
    """Three slots of different lengths on 5 blocks: at B = 4 pair 0 is full and pair 1 holds one live slot; at B = 3
    the last pair has no second slot at all, and an O bias is folded into every lane. The 2^-16 lanes round each
    block's partial where the int64 accumulators kept 2^-32: hidden values move by ~1e-5, enough to flip the bf16
    rounding of some matvec inputs, so the logits move at the bf16 level (measured 2-6e-3 of the largest logit
    from the int64 build; with 22 fraction bits most rows are equal, so it is rounding, not a lost lane). Bounds:
    1e-2 from the int64 build, and both as close to the fp32 reference as the batch gpu tests ask (2e-2; measured
    7.7e-3..1.5e-2 for both). Sabotage-checked: unpacking the lanes swapped moves the logits by O(1)
    (1.14); the carry's undoing is worth one 2^-16 step, which the host-lane test below checks exactly."""
    from replicas.model import ModelConfig
    from replicas.monokernel_emu import EmuModel
    from tests.test_monokernel_emu_cpu import rel, small_family

    from replicas.reference import ReferenceEngine

    cfg, bits, f32 = small_family("llama-3.2-1b", intermediate_size=768)
    if o_bias:
        cfg = ModelConfig(**{**cfg.model_dump(), "o_bias": True})
        for layer in range(cfg.num_hidden_layers):
            bits[f"model.layers.{layer}.self_attn.o_proj.bias"] = (0x3e00 + np.arange(cfg.hidden_size) % 97).astype(np.uint16)
            f32[f"model.layers.{layer}.self_attn.o_proj.bias"] = (bits[f"model.layers.{layer}.self_attn.o_proj.bias"]
                                                                 .astype(np.uint32) << 16).view(np.float32)
    ref = ReferenceEngine(cfg, dict(f32))
    rng = np.random.default_rng(61)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (23, 17, 20)]

    def run(fx_pack: bool):
        m = EmuModel(cfg, dict(bits), layout_options={"batch": batch, **TUNED_BATCH, "fx_pack": fx_pack}, num_sms=5)
        assert ("-DMK_FX_PACK=1" in m.layout.compile_flags()) is fx_pack
        return m.forward_logits_slots(seqs, prefill_len=5)

    base, packed = run(False), run(True)
    for seq, a, b in zip(seqs, packed, base):
        assert a.shape == b.shape and a.shape[1] == cfg.vocab_size
        want = ref.forward_logits(seq)[5:]
        assert np.isfinite(a).all() and rel(a, b) <= 1e-2
        assert rel(a[5:], want) <= 2e-2 and rel(b[5:], want) <= 2e-2


def test_host_lanes_sum_as_the_kernel_unpacks_them():
    """The identity behind fx_pack: adding packed words (int64, wrapping) adds each lane, however often the partial
    sums carry out of the low lane, as long as each lane's total fits in 32 bits. Fresh random partials, 300 of them
    per element (a grid's worth of blocks), the running sums leaving the 32-bit range on the way."""
    from types import SimpleNamespace

    lay = SimpleNamespace(fx_pack=True)
    rng = np.random.default_rng(7)
    n, parts = 64, 300

    def partials():  # int32 partials whose running sum leaves the 32-bit range (~1e10) and comes back
        first = rng.integers(-2**30, 2**30, (parts // 2, n))
        return np.concatenate([first, -first + rng.integers(-2**22, 2**22, (parts // 2, n))])

    lo_parts, hi_parts = partials(), partials()
    assert np.abs(lo_parts[:parts // 2].sum(0)).max() > 2**32 and np.abs(lo_parts.sum(0)).max() < 2**31
    with np.errstate(over="ignore"):
        acc = np.zeros((1, n), np.int64)
        for lo, hi in zip(lo_parts, hi_parts):
            word = np.zeros((1, n), np.int64)
            layout_fused.set_slot_fixed(np, lay, word, 0, lo, n)
            layout_fused.set_slot_fixed(np, lay, word, 1, hi, n)
            acc += word
    assert np.array_equal(layout_fused.slot_fixed(np, lay, acc, 0, n), lo_parts.sum(0))
    assert np.array_equal(layout_fused.slot_fixed(np, lay, acc, 1, n), hi_parts.sum(0))
    # setting one slot keeps its pair's other slot
    layout_fused.set_slot_fixed(np, lay, acc, 1, -5, n)
    assert np.array_equal(layout_fused.slot_fixed(np, lay, acc, 0, n), lo_parts.sum(0))
    assert (layout_fused.slot_fixed(np, lay, acc, 1, n) == -5).all()


def test_fx_pack_needs_the_folded_tensor_core_accumulators():
    from replicas.checkpoint import preset_config

    cfg = preset_config("llama-3.2-1b")
    for bad in ({"fold_x": False}, {"mma_o": False}, {"mma_mlp": False}):
        with pytest.raises(LayoutError, match="fx_pack .* needs batch > 1, fold_x, mma_mlp and mma_o"):
            KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, "batch": 4, "fx_pack": True, **bad}))
    lay = KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, "batch": 5, "fx_pack": True}))
    plain = KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, "batch": 5, "fx_pack": False}))
    assert TUNED_BATCH["fx_pack"]  # (a batch default since session 14)
    # three accumulator rows (pairs) instead of five, per turn
    assert lay.buffer_sizes()["dn_part"] == 4 * 3 * lay.hp and plain.buffer_sizes()["dn_part"] == 4 * 5 * plain.hp
    assert f"-DMK_FX_PACK_SHIFT={layout_fused.FX_PACK_SHIFT}" in lay.compile_flags()
