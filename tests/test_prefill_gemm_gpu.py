"""The prefill GEMM (replicas/prefill_gemm.py) on a GPU: llama-3.2-1b prefill shapes against a float64
numpy product of the same bf16 values, and the premise it exists for: it runs beside a kernel holding
all but 16 SMs (replicas/concurrency_check.runs_beside).

Tolerance: tests/test_prefill_gemm_cpu.tol(K) on max |got - ref| / max |ref| (exact bf16 products, fp32
accumulation: ~2 ulps of the running sum per k16 mma; 3.1e-5 at K = 2048, 7e-7 at K = 37 keys).
Marked `gpu` (CI deselects it; the CPU side, with the kernel on the CPU emulator, is
tests/test_prefill_gemm_cpu.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_prefill_gemm_cpu import as_f64, rand_bits, tol

pytestmark = pytest.mark.gpu

MAX_CTX, HEAD, KV_HEADS, GROUP = 512, 64, 8, 4


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def gemm(cp):
    from replicas.prefill_gemm import MmaGemm

    g = MmaGemm(cp)
    g.warm()
    return g


def rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("t,x_offset", [(1, 0), (7, 0), (7, 1), (40, 0), (300, 0)])
def test_linear_matches_float64(cp, gemm, t, x_offset):
    """x [T, 2048] . w[:, :2048]^T with weight rows padded to 2056 (x_offset 1: x two bytes off 16-byte
    alignment, the 2-byte load path)."""
    rng = np.random.default_rng(100 + t + x_offset)
    n, k, ldw = 3072, 2048, 2056
    w = rand_bits(rng, (n, ldw))
    x_buf = rand_bits(rng, (t, k + 8))
    x = x_buf[:, x_offset:x_offset + k]
    dx = cp.asarray(x_buf)[:, x_offset:x_offset + k]
    if x_offset == 0:
        dx = cp.ascontiguousarray(dx)
    y = gemm.linear(dx, cp.asarray(w), k)
    assert y.shape == (t, n) and y.dtype == cp.float32
    ref = as_f64(x) @ as_f64(w[:, :k]).T
    err = rel_err(cp.asnumpy(y), ref)
    assert err <= tol(k), f"{err:.3g} > {tol(k):.3g}"


@pytest.mark.parametrize("t,keys", [(1, 37), (10, 37), (10, 301), (128, 301)])
def test_attention_scores_qk(cp, gemm, t, keys):
    """Batched over kv heads: S[h] = 0.125 * Q[h] [T * group, 64] . K[h, :keys]^T, K a view into a
    [8, MAX_CTX, 64] cache, S a view into a [8, T * group, MAX_CTX] scores buffer (non-contiguous out)."""
    rng = np.random.default_rng(200 + t + keys)
    m = t * GROUP
    q = rand_bits(rng, (KV_HEADS, m, HEAD))
    kc = rand_bits(rng, (KV_HEADS, MAX_CTX, HEAD))
    scores = cp.full((KV_HEADS, m, MAX_CTX), cp.nan, cp.float32)
    out = scores[:, :, :keys]
    gemm.gemm(cp.asarray(q), cp.asarray(kc)[:, :keys], out, trans_b=True, alpha=0.125)
    ref = 0.125 * np.einsum("hmd,hkd->hmk", as_f64(q), as_f64(kc[:, :keys]))
    got = cp.asnumpy(scores)
    assert rel_err(got[:, :, :keys], ref) <= tol(HEAD)
    assert np.isnan(got[:, :, keys:]).all(), "wrote past N"


@pytest.mark.parametrize("t,keys,p_view", [(1, 37, False), (10, 37, True), (10, 301, False), (128, 301, True)])
def test_attention_values_pv(cp, gemm, t, keys, p_view):
    """O[h] = P[h] [T * group, keys] . V[h, :keys] (B as [K, N], K = keys unaligned); P contiguous (row
    stride = keys: 2-byte loads) or a view into a [8, M, MAX_CTX] buffer; O a [T * group, 8, 64] buffer
    seen as [8, T * group, 64] (batch stride 64, row stride 512)."""
    rng = np.random.default_rng(300 + t + keys + p_view)
    m = t * GROUP
    p_buf = rand_bits(rng, (KV_HEADS, m, MAX_CTX if p_view else keys))
    p = p_buf[:, :, :keys]
    vc = rand_bits(rng, (KV_HEADS, MAX_CTX, HEAD))
    o_buf = cp.full((m, KV_HEADS, HEAD), cp.nan, cp.float32)
    out = o_buf.transpose(1, 0, 2)
    gemm.gemm(cp.asarray(p_buf)[:, :, :keys], cp.asarray(vc)[:, :keys], out, trans_b=False)
    ref = np.einsum("hmk,hkd->hmd", as_f64(p), as_f64(vc[:, :keys]))
    err = rel_err(cp.asnumpy(out), ref)
    assert err <= tol(keys), f"{err:.3g} > {tol(keys):.3g}"


def test_results_are_deterministic(cp, gemm):
    rng = np.random.default_rng(5)
    x, w = cp.asarray(rand_bits(rng, (40, 8192))), cp.asarray(rand_bits(rng, (2048, 8192)))
    a, b = gemm.linear(x, w, 8192), gemm.linear(x, w, 8192)
    assert bool((a == b).all())
    ref = as_f64(cp.asnumpy(x)) @ as_f64(cp.asnumpy(w)).T
    assert rel_err(cp.asnumpy(a), ref) <= tol(8192)


@pytest.mark.parametrize("t,n,k", [(1, 2048, 8192), (32, 2048, 2048), (16, 3072, 2048)])
def test_split_k_linear_matches_float64(cp, gemm, t, n, k):
    """Join-sized linears whose grid is split along K (down, o, qkv of llama-3.2-1b), weight rows padded."""
    from replicas.prefill_gemm import k_splits

    assert k_splits(t, n, k) > 1
    rng = np.random.default_rng(t + n + k)
    w = rand_bits(rng, (n, k + 8))
    x = rand_bits(rng, (t, k))
    y = gemm.linear(cp.asarray(x), cp.asarray(w)[:, :k + 8], k)
    assert y.shape == (t, n) and y.dtype == cp.float32
    err = rel_err(cp.asnumpy(y), as_f64(x) @ as_f64(w[:, :k]).T)
    assert err <= tol(k), f"{err:.3g} > {tol(k):.3g}"


def test_runs_beside_a_kernel_holding_all_but_16_sms(cp, gemm):
    from replicas.concurrency_check import runs_beside

    sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    if sms < 32:
        pytest.skip(f"{sms} SMs: too few to hold all but 16")
    rng = np.random.default_rng(9)
    x = cp.asarray(rand_bits(rng, (40, 8192)))
    ws = [cp.asarray(rand_bits(rng, (n, k))) for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))]
    q, kc = cp.asarray(rand_bits(rng, (KV_HEADS, 160, HEAD))), cp.asarray(rand_bits(rng, (KV_HEADS, MAX_CTX, HEAD)))
    scores = cp.empty((KV_HEADS, 160, 40), cp.float32)
    pv = cp.empty((KV_HEADS, 160, HEAD), cp.float32)
    p_bits = cp.asarray(rand_bits(rng, (KV_HEADS, 160, 40)))
    busy, stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)

    def work():
        for w in ws:
            gemm.linear(x[:, :w.shape[1]], w, w.shape[1])
        gemm.gemm(q, kc[:, :40], scores, trans_b=True, alpha=0.125)
        gemm.gemm(p_bits, kc[:, :40], pv, trans_b=False)
        stream.synchronize()

    with stream:
        work()  # loads everything once (allocations included) before the hold
        beside, secs = runs_beside(cp, sms - 16, busy, work)
    assert beside, f"the GEMMs waited for a kernel on {sms - 16} SMs ({secs * 1e3:.1f} ms)"
