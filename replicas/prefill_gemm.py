"""bf16 tensor-core GEMM that runs beside a resident kernel (csrc/prefill_gemm.cu).

While a resident batch launch holds 116 of the H200's 132 SMs, a joining request's prefill runs on the
other 16. cuBLAS's bf16 / TF32 tensor-core GEMMs of some shapes wait for the resident kernel instead
(replicas/concurrency_check.py), and its fp32 SIMT ones are slow; this kernel is ordinary 128-thread
blocks with mma.sync, ldmatrix and cp.async only, and at most 36 KB of dynamic shared memory.

    g = MmaGemm(cp)
    g.gemm(a, b, out, trans_b=True, alpha=0.125)  # out[z] = alpha * a[z] @ b[z]^T
    y = g.linear(x_bits, w, k)                    # x [T, K] . w[:, :k]^T -> fp32 [T, N] (split along K
                                                  # when its grid is small: k_splits)

bf16 operands travel as uint16 bit patterns. `plan_gemm` (checks and launch arguments) needs no GPU,
so CI can test it with numpy arrays; CuPy is only ever the `cp` handed to MmaGemm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).parent.parent / "csrc" / "prefill_gemm.cu"
THREADS = 128
BN, BK = 64, 32
MIS = (1, 2, 4)  # block tile rows BM = 32 * MI


def kernel_name(mi: int, trans_b: bool, vec_a: bool, vec_b: bool) -> str:
    return f"pg_gemm_m{mi}_t{int(trans_b)}_a{int(vec_a)}_b{int(vec_b)}"


KERNELS = tuple(kernel_name(mi, t, va, vb) for mi in MIS for t in (False, True) for va in (False, True)
                for vb in (False, True))


def smem_bytes(mi: int) -> int:
    """Dynamic shared memory of a launch (csrc/prefill_gemm.cu Tile<MI>): stages x (A + B tile)."""
    stages = 3 if mi == 4 else 4
    return stages * (32 * mi * BK * 2 + BN * BK * 2)


# A linear whose grid has fewer blocks than this is split along K (the splits are batch entries of one
# launch, summed after): beside a resident kernel the 16 free SMs get a share of HBM in proportion to the
# bytes they keep in flight, and a grid of 32 blocks (down, o at T <= 32 on 1B) kept a quarter of what 128 do.
SPLIT_K_BLOCKS = 128


def pick_mi(m: int) -> int:
    """Block tile rows: the smallest of 32 / 64 / 128 that covers M (128 beyond: fewer B re-reads)."""
    return 1 if m <= 32 else 2 if m <= 64 else 4


def k_splits(m: int, n: int, k: int, target_blocks: int = SPLIT_K_BLOCKS) -> int:
    """Parts to split K of an [M, K] . [N, K]^T product into (a power of two, 1: none): doubled while the
    grid stays within target_blocks and every part is a whole number of k steps (so 16-byte aligned)."""
    blocks = -(-m // (32 * pick_mi(m))) * -(-n // BN)
    s = 1
    while blocks * 2 * s <= target_blocks and k % (2 * s * BK) == 0:
        s *= 2
    return s


def split_views(xp, x_bits, w, k: int, splits: int):
    """x_bits [T, k] and w [N, >= k] as [splits, T, k / splits] and [splits, N, k / splits] views (batch
    entry z: the z-th part of K); xp is numpy or cupy."""
    ks = k // splits
    t, n = int(x_bits.shape[0]), int(w.shape[0])
    a = xp.lib.stride_tricks.as_strided(x_bits, shape=(splits, t, ks), strides=(2 * ks, x_bits.strides[0], 2))
    b = xp.lib.stride_tricks.as_strided(w, shape=(splits, n, ks), strides=(2 * ks, w.strides[0], 2))
    return a, b


@dataclass(frozen=True)
class Plan:
    """One launch: kernel name, grid (1-D, blocks of THREADS), shared memory and the argument values
    after the three pointers (m, n, k, lda, sa, ldb, sb, ldc, sc, alpha, vec_c)."""

    name: str
    mi: int
    trans_b: bool
    vec_a: bool
    vec_b: bool
    blocks: int
    smem: int
    m: int
    n: int
    k: int
    lda: int
    sa: int
    ldb: int
    sb: int
    ldc: int
    sc: int
    alpha: float
    vec_c: bool


def data_ptr(x) -> int:
    """Device (CuPy) or host (numpy) address of an array's first element."""
    mem = getattr(x, "data", None)
    if hasattr(mem, "ptr"):
        return int(mem.ptr)
    return int(x.__array_interface__["data"][0])


def _elem_strides(name: str, x, dtype, itemsize: int) -> tuple[int, int]:
    """(batch, row) strides of a 3-d operand in elements; its last dim must be contiguous."""
    if len(x.shape) != 3:
        raise ValueError(f"{name} must be 3-d [batch, rows, cols], got shape {tuple(x.shape)}")
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {np.dtype(x.dtype).name}")
    if 0 in tuple(x.shape):
        return 0, 0  # nothing is read or written
    strides = tuple(int(s) for s in x.strides)
    if x.shape[2] > 1 and strides[2] != itemsize:
        raise ValueError(f"{name}'s last dim must be contiguous (stride {itemsize} bytes), got strides {strides}")
    for s, what in ((strides[0], "batch"), (strides[1], "row")):
        if s < 0 or s % itemsize:
            raise ValueError(f"{name}'s {what} stride must be a non-negative multiple of {itemsize} bytes, "
                             f"got strides {strides}")
    return strides[0] // itemsize, strides[1] // itemsize


def plan_gemm(a, b, out, *, trans_b: bool, alpha: float = 1.0) -> Plan | None:
    """Check the operands of out[z] = alpha * a[z] @ op(b[z]) and choose the launch; None: nothing to
    launch (an empty output, or K == 0 where the caller zero-fills)."""
    sa, lda = _elem_strides("a", a, np.uint16, 2)
    sb, ldb = _elem_strides("b", b, np.uint16, 2)
    sc, ldc = _elem_strides("out", out, np.float32, 4)
    batch, m, k = (int(d) for d in a.shape)
    if trans_b:
        nb, n, kb = (int(d) for d in b.shape)
        want = "b [batch, N, K] (trans_b: out = a @ b^T)"
    else:
        nb, kb, n = (int(d) for d in b.shape)
        want = "b [batch, K, N] (out = a @ b)"
    if nb != batch or kb != k:
        raise ValueError(f"a is [batch={batch}, M={m}, K={k}], so {want} must match it: got b {tuple(b.shape)}")
    if tuple(int(d) for d in out.shape) != (batch, m, n):
        raise ValueError(f"out must be [batch, M, N] = {(batch, m, n)}, got {tuple(out.shape)}")
    if max(m, n, k) >= 2**31:
        raise ValueError(f"dims (M, N, K) = {(m, n, k)} exceed the kernel's int indexing")
    if batch == 0 or m == 0 or n == 0 or k == 0:
        return None
    mi = pick_mi(m)
    blocks = -(-m // (32 * mi)) * -(-n // BN) * batch
    if blocks >= 2**31:
        raise ValueError(f"{blocks} blocks exceed the 1-d grid limit")
    # Strides of a batch of one never move the pointer; treat them as aligned.
    vec_a = data_ptr(a) % 16 == 0 and lda % 8 == 0 and (batch == 1 or sa % 8 == 0)
    vec_b = data_ptr(b) % 16 == 0 and ldb % 8 == 0 and (batch == 1 or sb % 8 == 0)
    vec_c = data_ptr(out) % 8 == 0 and ldc % 2 == 0 and (batch == 1 or sc % 2 == 0)
    return Plan(kernel_name(mi, trans_b, vec_a, vec_b), mi, bool(trans_b), vec_a, vec_b, blocks, smem_bytes(mi),
                m, n, k, lda, sa, ldb, sb, ldc, sc, float(alpha), vec_c)


class MmaGemm:
    """The compiled kernels (one NVRTC module) and their launches on the current CuPy stream."""

    def __init__(self, cp):
        self.cp = cp
        self.module = cp.RawModule(code=SOURCE.read_text(), options=("-std=c++17",))
        self._fns: dict = {}

    def _fn(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self.module.get_function(name)
        return fn

    def launch(self, plan: Plan, a, b, out) -> None:
        p = plan
        args = (a, b, out, np.int32(p.m), np.int32(p.n), np.int32(p.k), np.int64(p.lda), np.int64(p.sa),
                np.int64(p.ldb), np.int64(p.sb), np.int64(p.ldc), np.int64(p.sc), np.float32(p.alpha),
                np.int32(p.vec_c))
        self._fn(p.name)((p.blocks,), (THREADS,), args, shared_mem=p.smem)

    def gemm(self, a, b, out, *, trans_b: bool, alpha: float = 1.0) -> None:
        """out[z] = alpha * a[z] @ (b[z]^T if trans_b else b[z]), fp32 accumulation; a, b uint16 (bf16
        bits) [batch, rows, cols], out float32 [batch, M, N]; last dims contiguous, other strides free."""
        for name, x in (("a", a), ("b", b), ("out", out)):
            if not isinstance(x, self.cp.ndarray):
                raise ValueError(f"{name} must be a CuPy array, got {type(x).__name__}")
        plan = plan_gemm(a, b, out, trans_b=trans_b, alpha=alpha)
        if plan is None:
            if out.size:
                out.fill(0)  # K == 0: empty sums
            return
        self.launch(plan, a, b, out)

    def linear_parts(self, x_bits, w, k: int):
        """x_bits [T, k] uint16 (rows contiguous) . w[:, :k]^T -> new float32 [splits, T, N]: the product split
        along K when its grid is small (k_splits; splits = 1: the whole product), parts summed by the caller
        (in split order); w uint16 [N, ldw] with contiguous rows and ldw >= k (a view into a padded buffer)."""
        if len(x_bits.shape) != 2 or len(w.shape) != 2:
            raise ValueError(f"x_bits [T, K] and w [N, ldw] must be 2-d, got {tuple(x_bits.shape)}, {tuple(w.shape)}")
        if int(x_bits.shape[1]) != int(k) or int(w.shape[1]) < int(k):
            raise ValueError(f"x_bits has {x_bits.shape[1]} columns and w {w.shape[1]}; need x_bits [T, {k}] "
                             f"and w [N, >= {k}]")
        t, n = int(x_bits.shape[0]), int(w.shape[0])
        splits = k_splits(t, n, k) if x_bits.strides[1] == 2 and w.strides[1] == 2 else 1
        parts = self.cp.empty((splits, t, n), self.cp.float32)  # [split, T, N]
        if splits == 1:
            self.gemm(x_bits[None], w[None, :, :k], parts, trans_b=True)
        else:
            a, b = split_views(self.cp, x_bits, w, k, splits)
            self.gemm(a, b, parts, trans_b=True)
        return parts

    def linear(self, x_bits, w, k: int):
        """x_bits [T, k] uint16 (rows contiguous) . w[:, :k]^T -> float32 [T, N] (linear_parts, summed in
        split order: deterministic)."""
        parts = self.linear_parts(x_bits, w, k)
        return parts[0] if parts.shape[0] == 1 else parts.sum(axis=0)

    def warm(self) -> None:
        """Launch every kernel once on tiny operands (and wait): a kernel's first launch loads it, and
        loading waits for a running resident kernel, so call this before the first resident launch."""
        cp = self.cp
        bits = cp.zeros((1, 8, 16), cp.uint16)
        out = cp.empty((1, 8, 16), cp.float32)
        for mi in MIS:
            for t in (False, True):
                for va in (False, True):
                    for vb in (False, True):
                        self.launch(Plan(kernel_name(mi, t, va, vb), mi, t, va, vb, 1, smem_bytes(mi), 8, 8, 8,
                                         16, 0, 16, 0, 16, 0, 1.0, True), bits, bits, out)
        cp.cuda.get_current_stream().synchronize()
