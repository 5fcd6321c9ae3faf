"""The tensor-core packing of bench/mma_probe.py (the batch redesign's probe) against the documented
mma.m16n8k16 fragment layout: a numpy model that reads every operand through its fragment position
must reproduce x @ W^T, and the probe's kernels must compile for sm_90a where nvcc exists."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from bench.mma_probe import KERNELS, bf16_bits, mma_model, pack_mma


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_fragment_model_reproduces_the_matvec(slots):
    rng = np.random.default_rng(slots)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    x = rng.standard_normal((slots, 64)).astype(np.float32)
    got = mma_model(pack_mma(w), x)
    assert got.shape == (slots, 48)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_a_lanes_16_bytes_are_its_a_fragment():
    w = np.arange(32 * 32, dtype=np.int64).reshape(32, 32)  # element value = row * 32 + k
    p = pack_mma(w)
    assert p.shape == (2, 2, 32, 8)
    lane = 13  # group 3, thread-in-group 1
    g, t = lane >> 2, lane & 3
    rg, kg = 1, 1
    row, k = 16 * rg + g, 16 * kg + 2 * t
    want = [row * 32 + k, row * 32 + k + 1, (row + 8) * 32 + k, (row + 8) * 32 + k + 1,
            row * 32 + k + 8, row * 32 + k + 9, (row + 8) * 32 + k + 8, (row + 8) * 32 + k + 9]
    assert p[rg, kg, lane].tolist() == want


def test_shapes_that_do_not_tile_are_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        pack_mma(np.zeros((20, 32)))


def test_bf16_bits_round_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5], np.float32)
    back = (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    assert back.tolist() == [1.0, 1.0, 1.0 + 2**-6, -2.5]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("slots", [1, 8])
def test_probe_kernels_compile_for_sm90a(slots, tmp_path):
    src = tmp_path / "probe.cu"
    src.write_text(KERNELS)
    r = subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", f"-DPB={slots}", "-cubin", "-o", str(tmp_path / "p.cubin"),
                        str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
