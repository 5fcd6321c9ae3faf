"""Layout option ao_onepass (batch builds with ao_slots; csrc/mk_attn_o.cuh): the O stage combines every slot's
attention splits in one dependent L2 round trip, each thread loading its element's split outputs with its head's
split maxima and sums and merging them as an online softmax, instead of a round trip for the statistics, a block
barrier, the split weights in shared memory and a second round trip for the outputs. On the CPU emulation against
the same build without it and against the fp32 reference."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from replicas.layout import KernelLayout, LayoutError
from replicas.layout_tuned import TUNED_BATCH, engine_options

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulation needs g++")


@needs_gxx
@pytest.mark.parametrize("lengths", [(21,), (19, 14, 17)], ids=["one-slot-6-splits", "three-slots-2-splits"])
def test_one_pass_o_stage_decodes_as_the_two_pass_one(lengths):
    """12 blocks over 2 kv groups: 6 attention splits a group. split_pos 2 spreads a context of 12 positions over all
    6, so a slot alone merges two rounds of four splits (the running maximum rescales the first round's sums when
    the second raises it) and three slots take 2 splits each. Only the fp32 summation order differs from the
    two-pass stage; the staged O input is bf16, so a changed rounding there could move logits at the bf16 level:
    bounds 1e-2 of the largest logit from the two-pass build (measured 0: the bf16 staging absorbed the fp32 order
    on these inputs), and no further from the fp32 reference than the two-pass build. Sabotage-checked: without the rescale (`acc *= c` dropped) the one-slot case moves
    by O(1) (0.53; 0.26 for the three-slot case's first slot, alone for its last steps)."""
    from replicas.monokernel_emu import EmuModel
    from replicas.reference import ReferenceEngine
    from tests.test_monokernel_emu_cpu import rel, small_family

    cfg, bits, f32 = small_family("llama-3.2-1b")
    ref = ReferenceEngine(cfg, dict(f32))
    rng = np.random.default_rng(71 + len(lengths))
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]

    def run(onepass: bool):
        opts = {"batch": 4, **TUNED_BATCH, "split_pos": 2, "ao_onepass": onepass}
        m = EmuModel(cfg, dict(bits), layout_options=opts, num_sms=12)
        assert ("-DMK_AO_ONEPASS=1" in m.layout.compile_flags()) is onepass and m.layout.mma_o
        return m.forward_logits_slots(seqs, prefill_len=5)

    base, onepass = run(False), run(True)
    for seq, a, b in zip(seqs, onepass, base):
        assert a.shape == b.shape and a.shape[1] == cfg.vocab_size
        want = ref.forward_logits(seq)[5:]
        assert np.isfinite(a).all() and rel(a, b) <= 1e-2
        assert rel(a[5:], want) <= rel(b[5:], want) + 2e-3


def test_ao_onepass_is_refused_where_it_cannot_run():
    from replicas.checkpoint import preset_config

    cfg = preset_config("llama-3.2-1b")
    for bad in ({"batch": 1}, {"batch": 4}):  # (the single-sequence build; a batch build without ao_slots)
        with pytest.raises(LayoutError, match="ao_onepass .*needs batch > 1 and ao_slots"):
            KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**bad, "ao_onepass": True}))
    lay = KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, "batch": 4}))
    assert TUNED_BATCH["ao_onepass"] and "-DMK_AO_ONEPASS=1" in lay.compile_flags()  # (a batch default, session 16)
    plain = KernelLayout.from_config(cfg, 2048, **engine_options(cfg, {**TUNED_BATCH, "batch": 4, "ao_onepass": False}))
    assert not any("ONEPASS" in f for f in plain.compile_flags())
