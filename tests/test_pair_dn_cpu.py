"""Layout option pair_dn (batch builds; csrc/mk_mlp_mma.cuh): the kernel runs in clusters of two blocks, each block
writes its slice of h = SiLU(gate)·up into both blocks' shared memory (DSMEM), and after a cluster barrier each downs
half the output rows over the pair's h rows, so every block adds half as many fixed-point partials to the MLP
accumulator. On the CPU emulation (clusters, DSMEM and the cluster barrier in csrc/emu/cuda_on_cpu.h) against the same
build without it and against the fp32 reference; the packing's coverage and the numpy model of the warps are in
tests/test_layout_mma_mlp_cpu.py (pair_dn cases)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from replicas.layout import KernelLayout, LayoutError
from replicas.layout_tuned import TUNED_BATCH, engine_options

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulation needs g++")


@needs_gxx
def test_paired_down_decodes_as_the_unpaired_one():
    """hidden 1,024 (64 output tiles: 32 per rank, 2 per warp), intermediate 784 (49 gate/up tiles over 6 blocks, so
    the last pair's blocks own 8 and 9: rank 1's h lands after its peer's 8 tiles), three slots of different lengths
    with most positions decoded by the kernel. The pair sums a tile over both blocks' h rows in one fp32 accumulator
    where two blocks each rounded a partial to 2^-16: hidden values move by ~1e-5, which flips the bf16 rounding of
    some matvec inputs, so logits move at the bf16 level (measured 1.4-2.4e-3 of the largest logit; fx_pack's own
    test measured 2-6e-3 for the same kind of change). Bounds: 1e-2 from the unpaired build, and no further from the
    fp32 reference than the unpaired build (measured equal to within 4e-4). Sabotage-checked: rank 1 writing its
    h over rank 0's (no offset) moves the logits by O(1) (1.1-1.5)."""
    from replicas.monokernel_emu import EmuModel
    from replicas.reference import ReferenceEngine
    from tests.test_monokernel_emu_cpu import rel, small_family

    cfg, bits, f32 = small_family("llama-3.2-1b", hidden_size=1024, intermediate_size=784, num_attention_heads=8,
                                  num_key_value_heads=2)
    ref = ReferenceEngine(cfg, dict(f32))
    rng = np.random.default_rng(67)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (22, 17, 20)]

    def run(pair_dn: bool):
        m = EmuModel(cfg, dict(bits), layout_options={"batch": 4, **TUNED_BATCH, "pair_dn": pair_dn}, num_sms=6)
        assert ("-DMK_CLUSTER=2" in m.layout.compile_flags()) is pair_dn and m.layout.fx_pack
        return m.forward_logits_slots(seqs, prefill_len=5)

    base, paired = run(False), run(True)
    for seq, a, b in zip(seqs, paired, base):
        assert a.shape == b.shape and a.shape[1] == cfg.vocab_size
        want = ref.forward_logits(seq)[5:]
        assert np.isfinite(a).all() and 0 < rel(a, b) <= 1e-2
        assert rel(a[5:], want) <= rel(b[5:], want) + 2e-3


def test_pair_dn_is_refused_where_it_cannot_run():
    from replicas.checkpoint import preset_config

    cfg = preset_config("llama-3.2-1b")
    for bad in ({"batch": 4, "num_sms": 131}, {"batch": 4, "mma_mlp": False}):
        with pytest.raises(LayoutError, match="pair_dn .*needs batch > 1, tp=1, mma_mlp and an even grid"):
            KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, **bad, "pair_dn": True}))
    with pytest.raises(LayoutError, match="pair_dn"):
        KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {"pair_dn": True}))
    lay = KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, "batch": 4, "pair_dn": True}))
    plain = KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, "batch": 4}))
    assert lay.cluster == 2 and plain.cluster == 1
    assert "-DMK_PAIR_DN=1" in lay.compile_flags() and "-DMK_CLUSTER=2" in lay.compile_flags()
    assert not any("PAIR_DN" in f or "CLUSTER" in f for f in plain.compile_flags())
    assert lay.act_floats > plain.act_floats  # (the pair's h slices: twice the bf16 h region)
