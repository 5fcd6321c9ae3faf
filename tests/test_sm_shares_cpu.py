"""Per-block weight-stream shares (layout option sm_shares): the table, its checks, and what the packing
and the kernel's formula give each block (replicas/sm_shares.py; the emulated kernel is checked in
tests/test_monokernel_emu_cpu.py)."""

from __future__ import annotations

import numpy as np
import pytest

from replicas import layout_fused, sm_shares
from replicas.checkpoint import preset_config
from replicas.layout import KernelLayout, LayoutError
from replicas.layout_tuned import engine_options


def h200_like_times(seed: int = 0) -> np.ndarray:
    """Per-block times like the timeline probe's on the H200: 24 blocks ~25% faster, 1% noise."""
    rng = np.random.default_rng(seed)
    t = np.full(132, 111.0)
    t[[6, 7, 18, 19, 24, 25, 32, 33, 36, 37, 40, 41, 42, 43, 54, 55, 64, 65, 80, 81, 84, 85, 86, 87]] = 86.0
    return t * (1 + 0.01 * rng.standard_normal(132))


def test_two_speed_classes_become_two_weights_and_noise_does_not_move_them():
    tables = {sm_shares.weights_from_times(h200_like_times(seed)) for seed in range(20)}
    assert len(tables) == 1  # the same table from every noisy measurement: no drift between engine starts
    prefix = tables.pop()
    w = np.diff(prefix)
    assert prefix[0] == 0 and prefix[-1] == sm_shares.TOTAL
    fast = w[6] / w[0]
    assert abs(fast - 1.25) < 0.01  # 111/86 = 1.29, rounded to 1/8
    assert sorted(set(np.round(w / w[0], 2))) == [1.0, 1.25]
    # what the blocks get of llama-3.2-1b's 8192 gate/up rows: the fast ones ~1.25x, all rows dealt once
    rows = [sm_shares.block_units(8192, prefix, b) for b in range(132)]
    assert rows[0][0] == 0 and rows[-1][1] == 8192 and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    sizes = np.array([e - s for s, e in rows])
    assert set(sizes[w > w[0]]) <= {74, 75} and set(sizes[w == w[0]]) <= {59, 60}  # (equal: 62 or 63)


def test_equal_speeds_give_equal_shares():
    prefix = sm_shares.weights_from_times(np.full(132, 100.0))
    assert prefix == sm_shares.uniform(132)
    sizes = {sm_shares.block_units(8192, prefix, b)[1] - sm_shares.block_units(8192, prefix, b)[0] for b in range(132)}
    assert sizes <= {62, 63}


@pytest.mark.parametrize("bad, match", [
    ((0, 10, 20), "needs 5 entries"),
    ((0, 30000, 20000, 50000, 65536), "grow strictly"),
    ((0, 100, 200, 300, 65536), r"x the mean share"),
    ((1, 16384, 32768, 49152, 65536), "from 0 to 65536"),
])
def test_bad_tables_are_refused_with_what_is_wrong(bad, match):
    with pytest.raises(sm_shares.ShareError, match=match):
        sm_shares.check(bad, 4)
    with pytest.raises(sm_shares.ShareError, match="one positive time per block"):
        sm_shares.weights_from_times([1.0, -2.0])


def test_the_layout_takes_a_table_and_packs_the_down_by_it():
    c = preset_config("llama-3.2-1b")
    prefix = sm_shares.weights_from_times(h200_like_times())
    lay = KernelLayout.from_config(c, 2048, **engine_options(c, {"sm_shares": True, "share_prefix": prefix}))
    assert lay.shares == prefix and "-DMK_SM_SHARES=1" in lay.compile_flags()
    assert ("share_w", "const int*") in lay.param_fields()
    plain = KernelLayout.from_config(c, 2048, **engine_options(c))
    assert plain.shares == sm_shares.uniform(132) and "share_w" not in dict(plain.param_fields())
    # the h slice in shared memory holds the largest block's rows; the ring keeps its depth
    assert layout_fused.slice_floats(lay) >= max(e - s for s, e in (layout_fused.lay_rows(lay, b) for b in range(132)))
    assert lay.ring_slots == plain.ring_slots
    # the down packing follows the weighted slices: simulate the kernel's fused down on random data
    small = KernelLayout.from_config(preset_config("tiny"), 256, num_sms=6,
                                     **engine_options(preset_config("tiny"), {"sm_shares": True,
                                                      "share_prefix": sm_shares.normalised([32, 40, 32, 48, 32, 40])}))
    rng = np.random.default_rng(3)
    down = (rng.standard_normal((small.hidden, small.inter)).astype(np.float32) * 0.05)
    bits = (down.view(np.uint32) >> 16).astype(np.uint16)
    h = rng.standard_normal(small.inter).astype(np.float32)
    got = layout_fused.simulate_fused_down(small, layout_fused.pack_down_fused(np, small, bits), h)
    want = ((bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64) @ h).astype(np.float32)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_sm_shares_is_refused_where_it_does_not_apply():
    c = preset_config("llama-3.2-1b")
    with pytest.raises(LayoutError, match="sm_shares .* needs tp=1 and no mma"):
        KernelLayout.from_config(c, 2048, **engine_options(c, {"sm_shares": True, "mma": True}))
    with pytest.raises(LayoutError, match="share_prefix is the table of layout option sm_shares"):
        KernelLayout.from_config(c, 2048, share_prefix=sm_shares.uniform(132))
    with pytest.raises(LayoutError, match="needs 133 entries"):
        KernelLayout.from_config(c, 2048, sm_shares=True, share_prefix=sm_shares.uniform(4))


def test_the_kernels_recorded_times_become_a_table_and_gaps_are_reported():
    t = h200_like_times()
    rec = np.tile(t * 1e3, (sm_shares.STEPS, 1))
    rec[3, 5] *= 3  # one noisy step does not move a block: the median over the steps
    times = sm_shares.times_from_kernel(rec.astype(np.uint64).ravel(), 132)
    assert sm_shares.weights_from_times(times) == sm_shares.weights_from_times(t)
    rec[:, 7] = 0
    with pytest.raises(sm_shares.ShareError, match=r"no time for blocks \[7\]"):
        sm_shares.times_from_kernel(rec.astype(np.uint64).ravel(), 132)
