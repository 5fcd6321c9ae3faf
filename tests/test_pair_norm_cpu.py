"""Layout option pair_norm (batch builds; csrc/mk_batch.cuh): the kernel runs in clusters of two blocks, each block
loads half of every slot's residual in a prologue and stores its half of the normed vector into both blocks'
shared memory (DSMEM), with cluster barriers in between. On the CPU emulation (clusters, DSMEM and the cluster
barrier emulated in csrc/emu/cuda_on_cpu.h) against the same build without it."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from replicas.layout import KernelLayout, LayoutError
from replicas.layout_tuned import TUNED_BATCH, engine_options

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulation needs g++")


@needs_gxx
def test_pair_norm_stages_what_one_block_stages():
    """hidden 1,024 over 512 threads: two strides per prologue, one per block of a pair, so both halves and both
    DSMEM directions are used; 6 blocks (3 pairs), three slots of different lengths, most positions decoded by
    the kernel. The pair adds its two halves' sums of squares where one block added 16 warp sums: fp32-level
    differences at most, so the bound is the batch-vs-single one (1e-4; measured: equal). Sabotage-checked:
    dropping the peer's half of the staged vector, or the peer's half sum, moves the logits by O(1)."""
    from replicas.monokernel_emu import EmuModel
    from tests.test_monokernel_emu_cpu import rel, small_family

    cfg, bits, _ = small_family("llama-3.2-1b", hidden_size=1024, intermediate_size=768, num_attention_heads=8,
                                num_key_value_heads=2)
    rng = np.random.default_rng(57)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (24, 18, 21)]

    def run(pair_norm: bool):
        m = EmuModel(cfg, dict(bits), layout_options={"batch": 4, **TUNED_BATCH, "pair_norm": pair_norm}, num_sms=6)
        assert ("-DMK_CLUSTER=2" in m.layout.compile_flags()) is pair_norm
        return m.forward_logits_slots(seqs, prefill_len=6)

    base, paired = run(False), run(True)
    for a, b in zip(paired, base):
        assert a.shape == b.shape and a.shape[1] == cfg.vocab_size
        assert np.isfinite(a).all() and rel(a, b) <= 1e-4


def test_pair_norm_is_refused_where_it_cannot_run():
    from replicas.checkpoint import preset_config

    cfg = preset_config("llama-3.2-1b")
    for bad, why in (({"batch": 4, "num_sms": 131}, "even grid"), ({"batch": 1}, "batch > 1")):
        with pytest.raises(LayoutError, match=f"pair_norm .*{why}"):
            KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, **bad, "pair_norm": True}
                                                                if bad["batch"] > 1 else {**bad, "pair_norm": True}))
    lay = KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, "batch": 8, "pair_norm": True}))
    plain = KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, "batch": 8}))
    assert lay.red_floats == (16 + 3) * 8 and plain.red_floats == (16 + 1) * 8  # (+ both halves' sums per slot)
    assert "-DMK_PAIR_NORM=1" in lay.compile_flags() and "-DMK_PAIR_NORM=1" not in plain.compile_flags()
