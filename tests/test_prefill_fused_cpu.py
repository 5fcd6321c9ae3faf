"""The prefill's fused GPU kernels (replicas/monokernel_prefill.py _FUSED, MK_PREFILL_FUSED) on the CPU emulator.

Each fused kernel replaces a chain of passes a join's prefill used to run (beside a resident launch each kernel
pays several memory round trips). Each must write exactly what that chain wrote, bit for bit, so the test runs
both on the emulator with fresh random inputs:
- mk_rms_rows_bits = bf16 RNE of mk_rms_rows (the narrow pass's rounding);
- mk_rope_bits = mk_rope_rows on a contiguous copy, narrowed, transposed to the attention's [NKV, T, G, D];
- mk_store_kv_f32 = mk_rope_rows (keys) or nothing (values), narrowed, then mk_store_kv (rows past count unwritten);
- mk_add_parts = x + the parts summed in split order.
The rows are read through strided views (the QKV output's column slices), as forward passes them.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from replicas import monokernel_prefill as mp
from replicas.monokernel_weights import to_bf16_bits
from tests.emu_cpp import build_emulated

_WRAP = r"""
template <class F>
static int emu_launch(F body, unsigned blocks, unsigned threads) {
  struct Box { F f; } box{body};
  auto run = [](const void* q) { static_cast<const Box*>(q)->f(); };
  return mk_emu::run(run, &box, blocks, threads, 0, 64 << 10, 1ull << 40);
}
extern "C" int emu_rms(const float* x, const float* w, void* y, int n, float eps, int bits) {
  // one row (one block: the kernel's __shared__ is a static here, shared by every emulated block)
  if (bits) return emu_launch([=] { mk_rms_rows_bits(x, w, (unsigned short*)y, n, eps); }, 1, 256);
  return emu_launch([=] { mk_rms_rows(x, w, (float*)y, n, eps); }, 1, 256);
}
extern "C" int emu_rope_rows(const float* x, const float* cs, const float* sn, float* y, int heads, int d,
                             long long total, const int* dyn, int start) {
  return emu_launch([=] { mk_rope_rows(x, cs, sn, y, heads, d, total, dyn, start); }, (unsigned)((total + 63) / 64), 64);
}
extern "C" int emu_rope_bits(const float* x, long long ldx, const float* cs, const float* sn, unsigned short* y,
                             int heads, int group, int d, long long total, const int* dyn, int start) {
  return emu_launch([=] { mk_rope_bits(x, ldx, cs, sn, y, heads, group, d, total, dyn, start); },
                    (unsigned)((total + 63) / 64), 64);
}
extern "C" int emu_store_bits(const unsigned short* src, unsigned short* dst, int nkv, int d, int ctx, long long total,
                              const int* dyn, int start, int count) {
  return emu_launch([=] { mk_store_kv(src, dst, nkv, d, ctx, total, dyn, start, count); },
                    (unsigned)((total + 63) / 64), 64);
}
extern "C" int emu_store_f32(const float* x, long long ldx, const float* cs, const float* sn, unsigned short* dst,
                             int nkv, int d, int ctx, long long total, const int* dyn, int start, int count) {
  return emu_launch([=] { mk_store_kv_f32(x, ldx, cs, sn, dst, nkv, d, ctx, total, dyn, start, count); },
                    (unsigned)((total + 63) / 64), 64);
}
extern "C" int emu_add_parts(float* x, const float* parts, int splits, long long n) {
  return emu_launch([=] { mk_add_parts(x, parts, splits, n); }, (unsigned)((n + 63) / 64), 64);
}
"""

P, I, LL, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    lib = build_emulated(tmp_path_factory.mktemp("prefill_fused"), "prefill_fused",
                         "#define __shared__ static\n" + mp._FUSED + _WRAP)
    lib.emu_rms.argtypes = [P, P, P, I, F, I]
    lib.emu_rope_rows.argtypes = [P, P, P, P, I, I, LL, P, I]
    lib.emu_rope_bits.argtypes = [P, LL, P, P, P, I, I, I, LL, P, I]
    lib.emu_store_bits.argtypes = [P, P, I, I, I, LL, P, I, I]
    lib.emu_store_f32.argtypes = [P, LL, P, P, P, I, I, I, LL, P, I, I]
    lib.emu_add_parts.argtypes = [P, P, I, LL]
    return lib


def ptr(a) -> int:
    return a.__array_interface__["data"][0]


def test_rms_bits_are_the_narrowed_fp32_rows(emu):
    rng = np.random.default_rng(1)
    rows, n, eps = 3, 300, 1e-5
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    fp32, bits = np.full_like(x, np.nan), np.zeros((rows, n), np.uint16)
    for r in range(rows):
        assert emu.emu_rms(ptr(x[r]), ptr(w), ptr(fp32[r]), n, eps, 0) == 0
        assert emu.emu_rms(ptr(x[r]), ptr(w), ptr(bits[r]), n, eps, 1) == 0
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps) * w
    np.testing.assert_allclose(fp32, want, rtol=2e-6, atol=1e-6)  # fp32 sums in another order: rounding only
    assert np.array_equal(bits, to_bf16_bits(np, fp32))


def qkv_case(rng, T, nh, nkv, d, ctx):
    """A QKV output [T, (nh + 2 nkv) d] and RoPE tables [ctx, d / 2]."""
    qkv = rng.standard_normal((T, (nh + 2 * nkv) * d)).astype(np.float32)
    cos = rng.standard_normal((ctx, d // 2)).astype(np.float32)
    sin = rng.standard_normal((ctx, d // 2)).astype(np.float32)
    return qkv, cos, sin


def rope_rows(emu, x, cos, sin, start):
    """The unfused pass: mk_rope_rows on a contiguous copy of x [T, heads, d]."""
    xc = np.ascontiguousarray(x)
    y = np.full_like(xc, np.nan)
    assert emu.emu_rope_rows(ptr(xc), ptr(cos), ptr(sin), ptr(y), x.shape[1], x.shape[2], xc.size, None, start) == 0
    return y


@pytest.mark.parametrize("start,by_dyn", [(0, False), (9, False), (5, True)])
def test_rope_bits_equal_rope_narrow_and_the_attention_transpose(emu, start, by_dyn):
    rng = np.random.default_rng(10 + start)
    T, nh, nkv, d, ctx = 4, 6, 2, 8, 24
    g = nh // nkv
    qkv, cos, sin = qkv_case(rng, T, nh, nkv, d, ctx)
    q = qkv[:, :nh * d].reshape(T, nh, d)  # a strided view, as forward passes it
    want = to_bf16_bits(np, rope_rows(emu, q, cos, sin, start)).reshape(T, nkv, g, d).transpose(1, 0, 2, 3)
    got = np.zeros((nkv, T, g, d), np.uint16)
    dyn = np.array([start, T], np.int32)
    assert emu.emu_rope_bits(ptr(q), qkv.shape[1], ptr(cos), ptr(sin), ptr(got), nh, g, d, q.size,
                             ptr(dyn) if by_dyn else None, 999 if by_dyn else start) == 0
    assert np.array_equal(got, want)


@pytest.mark.parametrize("start,count,by_dyn", [(0, 4, False), (7, 3, False), (2, 4, True), (11, 1, True)])
def test_store_kv_f32_equals_rope_narrow_store(emu, start, count, by_dyn):
    rng = np.random.default_rng(20 + start + count)
    T, nh, nkv, d, ctx = 4, 6, 2, 8, 16
    qkv, cos, sin = qkv_case(rng, T, nh, nkv, d, ctx)
    k = qkv[:, nh * d:(nh + nkv) * d].reshape(T, nkv, d)
    v = qkv[:, (nh + nkv) * d:].reshape(T, nkv, d)
    dyn = np.array([start, count], np.int32)
    for src, rope in ((k, True), (v, False)):
        sentinel = rng.integers(1, 1 << 15, (nkv, ctx, d)).astype(np.uint16)
        narrowed = np.ascontiguousarray(to_bf16_bits(np, rope_rows(emu, src, cos, sin, start) if rope else src))
        want = sentinel.copy()
        assert emu.emu_store_bits(ptr(narrowed), ptr(want), nkv, d, ctx, narrowed.size, None, start, count) == 0
        got = sentinel.copy()
        assert emu.emu_store_f32(ptr(src), qkv.shape[1], ptr(cos) if rope else None, ptr(sin) if rope else None,
                                 ptr(got), nkv, d, ctx, src.size, ptr(dyn) if by_dyn else None,
                                 0 if by_dyn else start, T if by_dyn else count) == 0
        assert np.array_equal(got, want)
        assert np.array_equal(got[:, :start], sentinel[:, :start])  # other positions untouched
        assert np.array_equal(got[:, start + count:], sentinel[:, start + count:])


@pytest.mark.parametrize("splits", [2, 4])
def test_add_parts_sums_in_split_order_into_the_residual(emu, splits):
    rng = np.random.default_rng(splits)
    x = rng.standard_normal((5, 70)).astype(np.float32)
    parts = (rng.standard_normal((splits, 5, 70)) * 100).astype(np.float32)
    want = parts[0].copy()
    for z in range(1, splits):
        want = want + parts[z]
    want = x + want
    got = x.copy()
    assert emu.emu_add_parts(ptr(got), ptr(parts), splits, x.size) == 0
    assert np.array_equal(got, want)


def test_every_fused_kernel_is_loaded_by_a_no_work_launch(emu):
    """_loaded_functions launches each _FUSED kernel once so that none first loads beside a resident launch (lazy
    loading): every extern "C" kernel has no-work arguments, of its parameter count, and under them the kernel
    returns without touching memory (null pointers here: a touch would crash the emulator)."""
    import re

    names = re.findall(r'extern "C" __global__ void (\w+)\(', mp._FUSED)
    args = mp._no_work_args()
    assert sorted(names) == sorted(args)
    for name in names:
        params = re.search(name + r"\(([^)]*)\)", mp._FUSED).group(1)
        assert len(args[name]) == params.count(",") + 1, name
    assert emu.emu_add_parts(None, None, 1, 0) == 0
    assert emu.emu_store_f32(None, 0, None, None, None, 1, 1, 1, 0, None, 0, 0) == 0
    assert emu.emu_rope_bits(None, 0, None, None, None, 1, 1, 2, 0, None, 0) == 0
    assert emu.emu_rope_rows(None, None, None, None, 1, 2, 0, None, 0) == 0
    assert emu.emu_store_bits(None, None, 1, 1, 1, 0, None, 0, 0) == 0
    assert emu.emu_rms(None, None, None, 0, 1.0, 1) == 0 and emu.emu_rms(None, None, None, 0, 1.0, 0) == 0


def test_the_module_is_loaded_with_every_kernel_launched():
    """_loaded_functions on a stand-in CuPy: each kernel fetched and launched once with its no-work arguments."""
    from types import SimpleNamespace

    launched = []

    class Module:
        def __init__(self, code):
            assert code == mp._FUSED

        def get_function(self, name):
            return lambda grid, block, args: launched.append((name, grid, block, len(args)))

    mp._loaded_functions(SimpleNamespace(RawModule=Module))
    assert sorted(n for n, *_ in launched) == sorted(mp._no_work_args())
    assert all(grid == (1,) and block == (32,) for _, grid, block, _ in launched)


def test_source_compiles_for_sm90a(tmp_path):
    import shutil
    import subprocess

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    r = subprocess.run(["nvcc", "-arch=sm_90a", "-std=c++17", "-c", "-o", str(tmp_path / "x.o"), str(mp.FUSED_SOURCE)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
