"""bf16 tensor-core GEMMs for the prefill: cuBLAS `gemmEx` through CuPy's bindings.

CuPy has no bf16 dtype, but the packed weights already are bf16 bit patterns (uint16), so the
products read them in place (no widening copy) with bf16 inputs, fp32 accumulation and fp32
outputs. Row-major Y[T, N] = X[T, K] @ W[N, K]^T is the column-major product W^T-op times X.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

OP_N, OP_T = 0, 1
R_32F, R_16BF = 0, 14
COMPUTE_32F = 68
COMPUTE_32F_PEDANTIC = 69  # fp32 mode: never tensor cores (CUPY_TF32=1 would let COMPUTE_32F use TF32)
GEMM_DEFAULT = -1

_SOFTMAX = r"""
extern "C" __global__ void causal_softmax_bf16(const float* __restrict__ s, unsigned short* __restrict__ p,
                                               int rows_per_batch, int ncols, int group, int q0,
                                               const int* __restrict__ dyn_q0) {
  // One block per score row; row r of a batch is query position q0 + (r % rows_per_batch) / group, plus
  // *dyn_q0 when given (a CUDA graph of the prefill reads its start position at replay).
  const long long row = blockIdx.x;
  const int t = q0 + (dyn_q0 ? *dyn_q0 : 0) + (int)(row % rows_per_batch) / group;
  const float* src = s + row * ncols;
  unsigned short* dst = p + row * ncols;
  __shared__ float red[32];
  float mx = -3.0e38f;
  for (int k = threadIdx.x; k <= t; k += blockDim.x) mx = fmaxf(mx, src[k]);
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = -3.0e38f;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) mx = fmaxf(mx, red[w]);
  __syncthreads();
  float sum = 0.f;
  for (int k = threadIdx.x; k <= t; k += blockDim.x) sum += __expf(src[k] - mx);
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
  __syncthreads();
  sum = 0.f;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) sum += red[w];
  const float inv = 1.f / sum;
  for (int k = threadIdx.x; k < ncols; k += blockDim.x) {
    float v = k <= t ? __expf(src[k] - mx) * inv : 0.f;
    unsigned int u = __float_as_uint(v);
    dst[k] = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}
"""


def _cupy_cublas():
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # older CuPy layouts
        from cupy.cuda import cublas
    return cublas


def _loaded_libcublas() -> str | None:
    """Path of the libcublas this process loaded (CuPy loads it with its first cuBLAS handle), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {ln.split()[-1] for ln in maps if "libcublas.so" in ln and "libcublasLt" not in ln}
    except OSError:
        return None
    return min(paths) if paths else None


class CublasC:
    """The three cuBLAS calls the prefill makes, through ctypes on the loaded libcublas, with CuPy's binding
    names and argument order. CuPy's own bindings refuse to run while a stream captures a CUDA graph
    (NotImplementedError, seen on the H200 with CuPy 14.2); cuBLAS itself supports capture, and the prefill's
    graphs (replicas/prefill_graph.py) capture these calls."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        self._gemm = lib.cublasGemmEx
        self._gemm.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        self._batched = lib.cublasGemmStridedBatchedEx
        self._batched.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll, i, i, i]
        self._stream = lib.cublasSetStream_v2
        self._stream.argtypes = [vp, vp]
        for f in (self._gemm, self._batched, self._stream):
            f.restype = i

    @staticmethod
    def _check(status: int, name: str) -> None:
        if status != 0:
            raise RuntimeError(f"{name} returned cuBLAS status {status} (see cublasStatus_t)")

    def gemmEx(self, *args) -> None:
        self._check(self._gemm(*args), "cublasGemmEx")

    def gemmStridedBatchedEx(self, *args) -> None:
        self._check(self._batched(*args), "cublasGemmStridedBatchedEx")

    def setStream(self, handle, stream) -> None:
        self._check(self._stream(handle, stream), "cublasSetStream_v2")


def _cublas(cp):
    """cuBLAS for Blas: CublasC where the loaded library is found (capturable), else CuPy's bindings."""
    cp.cuda.device.get_cublas_handle()  # loads libcublas
    path = _loaded_libcublas()
    if path is not None:
        try:
            return CublasC(path)
        except (OSError, AttributeError):
            pass
    return _cupy_cublas()


# Per thread: which GEMMs the Blas calls run. A resident launch's joins need GEMMs that run beside the running
# kernel: measured on the H200 with 116 of 132 SMs held (bench/gemm_concurrency_probe.py), cuBLAS's bf16 and
# TF32 GEMMs of some prefill shapes waited for the holding kernel to end, its fp32 SIMT ones never did.
#   tensor: cuBLAS bf16 tensor cores (the default; every prefill outside a join)
#   mma:    our mma.sync GEMM (replicas/prefill_gemm.py: plain launches, no clusters), same bf16 operands
#   fp32:   cuBLAS's SIMT kernels on fp32 copies of the bf16 operands (PEDANTIC: never tensor cores)
GEMM_MODES = ("tensor", "mma", "fp32")
_MODE = threading.local()


def use_gemm_mode(mode: str) -> None:
    """Set this thread's GEMM mode (one of GEMM_MODES)."""
    if mode not in GEMM_MODES:
        raise ValueError(f"GEMM mode {mode!r}: one of {GEMM_MODES}")
    _MODE.name = mode


def gemm_mode() -> str:
    return getattr(_MODE, "name", "tensor")


def _compute() -> int:
    return COMPUTE_32F_PEDANTIC if gemm_mode() == "fp32" else COMPUTE_32F


def load_gemm_mode(cp, mode: str) -> None:
    """Load every kernel `mode` may launch (now, not during a resident launch: a first launch waits for it)."""
    if mode == "mma":
        _mma(cp).warm()


@functools.cache
def _mma(cp):
    from replicas.prefill_gemm import MmaGemm

    return MmaGemm(cp)


def set_sm_count_target(cp, sms: int) -> bool:
    """cublasSetSmCountTarget(sms) on this thread's CuPy cuBLAS handle (cuBLAS then plans its GEMMs for
    `sms` SMs: the ones a resident launch leaves free). CuPy has no binding, so ctypes on the libcublas
    this process loaded; False where it is not found."""
    h = cp.cuda.device.get_cublas_handle()
    path = _loaded_libcublas()
    try:
        return path is not None and ctypes.CDLL(path).cublasSetSmCountTarget(ctypes.c_void_p(h),
                                                                             ctypes.c_int(int(sms))) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def _softmax(cp):
    """One kernel object per process: it loads its module once per device, before a resident launch
    (monokernel_prefill._kernels says why that matters)."""
    return cp.RawKernel(_SOFTMAX, "causal_softmax_bf16")


NULL_ARG = np.uint64(0)  # a null pointer argument for a RawKernel (CuPy passes each argument by its own size)


class Blas:
    """bf16 GEMMs on the current CuPy stream."""

    def __init__(self, cp):
        self.cp = cp
        self.lib = _cublas(cp)
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)
        self._alpha = np.ones(1, np.float32)
        self.softmax = _softmax(cp)

    def _handle(self):
        h = self.cp.cuda.device.get_cublas_handle()
        self.lib.setStream(h, self.cp.cuda.get_current_stream().ptr)
        return h

    def linear(self, x_bits, w, k: int):
        """x_bits [T, K] bf16 (uint16, contiguous) @ w[:, :K]^T -> fp32 [T, N]; w is a row-major
        uint16 view [N, ldw] whose rows are contiguous (padded rows allowed)."""
        cp = self.cp
        t, n, ldw = x_bits.shape[0], w.shape[0], w.strides[0] // 2
        assert x_bits.flags.c_contiguous and w.strides[-1] == 2 and x_bits.shape[1] == k
        if gemm_mode() == "mma":
            return _mma(cp).linear(x_bits, w, k)
        y = cp.empty((t, n), cp.float32)
        (wp, wt, ldw, w_arr), (xp, xt, _, x_arr) = self._operand(w[:, :k], ldw), self._operand(x_bits, k)
        self.lib.gemmEx(self._handle(), OP_T, OP_N, n, t, k, self._one.ctypes.data, wp, wt, ldw,
                        xp, xt, k, self._zero.ctypes.data, y.data.ptr, R_32F, n, _compute(), GEMM_DEFAULT)
        del w_arr, x_arr
        return y

    def linear_parts(self, x_bits, w, k: int):
        """linear's product as [splits, T, N] fp32 parts to be summed in split order (the mma join GEMM splits
        K when its grid is small; every other mode: one part)."""
        if gemm_mode() == "mma":
            assert x_bits.flags.c_contiguous and w.strides[-1] == 2 and x_bits.shape[1] == k
            return _mma(self.cp).linear_parts(x_bits, w, k)
        return self.linear(x_bits, w, k)[None]

    def _operand(self, bits, ld: int):
        """A GEMM operand from a bf16 view: (pointer, type, leading dim, the array behind the pointer) as it
        is, or in fp32 mode a contiguous fp32 copy's (leading dim: the view's last extent). Callers hold the
        array until the call is issued (the copy is freed to CuPy's stream-ordered pool after that)."""
        if gemm_mode() != "fp32":
            return bits.data.ptr, R_16BF, ld, bits
        from replicas.monokernel_prefill import _kernels

        f = _kernels(self.cp)["widen"](bits)
        return f.data.ptr, R_32F, bits.shape[-1], f

    def causal_attention(self, q_bits, k_heads, v_heads, ctx_stride: int, group: int, scale: float,
                         q_offset: int = 0, keys: int | None = None, dyn_offset=None):
        """q_bits [KV, T, G, D] bf16 (contiguous): queries at positions q_offset..q_offset+T-1;
        k_heads/v_heads: uint16 [KV, max_ctx, D] cache views holding positions 0..q_offset+T-1.
        Returns fp32 [KV, T, G, D].

        For a CUDA graph (replicas/prefill_graph.py): `dyn_offset` (device int32, [0] = the start position,
        added to q_offset) is read when the kernels run, and every query block scores `keys` cache rows
        (>= the last query position + 1); the causal mask zeroes the rows past each query."""
        cp, lib = self.cp, self.lib
        kv, t, g, d = q_bits.shape
        fixed = keys is not None
        keys = q_offset + t if keys is None else int(keys)
        dyn = NULL_ARG if dyn_offset is None else dyn_offset
        qb = t if kv * g * t * keys * 4 <= 2**30 else max(64, 2**30 // (kv * g * keys * 4))
        if gemm_mode() == "mma":
            return self._causal_attention_mma(q_bits, k_heads, v_heads, scale, q_offset, qb, keys if fixed else None,
                                              dyn)
        out = cp.empty((kv, t, g, d), cp.float32)
        self._alpha[0] = scale
        h = self._handle()
        fp32 = gemm_mode() == "fp32"
        if fp32:  # contiguous fp32 copies of the keys / values in use: [KV, keys, D]
            k_heads, v_heads, ctx_stride = k_heads[:, :keys], v_heads[:, :keys], keys
        kp, kt, _, k_arr = self._operand(k_heads, d)
        vp, vt, _, v_arr = self._operand(v_heads, d)
        qp, qt, _, q_arr = self._operand(q_bits, d)
        esize = 4 if fp32 else 2
        for s in range(0, t, qb):
            e = min(t, s + qb)
            rows = (e - s) * g
            cols = keys if fixed else q_offset + e  # this block's queries see keys 0..q_offset+e-1
            scores = cp.empty((kv, rows, cols), cp.float32)
            lib.gemmStridedBatchedEx(h, OP_T, OP_N, cols, rows, d, self._alpha.ctypes.data,
                                     kp, kt, d, ctx_stride * d,
                                     qp + s * g * d * esize, qt, d, t * g * d,
                                     self._zero.ctypes.data, scores.data.ptr, R_32F, cols, rows * cols,
                                     kv, _compute(), GEMM_DEFAULT)
            probs = cp.empty((kv, rows, cols), cp.uint16)
            self.softmax((kv * rows,), (256,), (scores, probs, np.int32(rows), np.int32(cols), np.int32(g),
                                                np.int32(q_offset + s), dyn))
            pp, pt, _, p_arr = self._operand(probs, cols)
            lib.gemmStridedBatchedEx(h, OP_N, OP_N, d, rows, cols, self._one.ctypes.data,
                                     vp, vt, d, ctx_stride * d,
                                     pp, pt, cols, rows * cols,
                                     self._zero.ctypes.data, out.data.ptr + s * g * d * 4, R_32F, d, t * g * d,
                                     kv, _compute(), GEMM_DEFAULT)
            del p_arr
        del k_arr, v_arr, q_arr
        return out

    def _causal_attention_mma(self, q_bits, k_heads, v_heads, scale: float, q_offset: int, qb: int,
                              keys: int | None, dyn):
        """causal_attention on the mma.sync GEMM (same blocks, same softmax kernel)."""
        cp, mm = self.cp, _mma(self.cp)
        kv, t, g, d = q_bits.shape
        out = cp.empty((kv, t, g, d), cp.float32)
        q3, o3 = q_bits.reshape(kv, t * g, d), out.reshape(kv, t * g, d)
        for s in range(0, t, qb):
            e = min(t, s + qb)
            rows, cols = (e - s) * g, q_offset + e if keys is None else keys
            scores = cp.empty((kv, rows, cols), cp.float32)
            mm.gemm(q3[:, s * g:e * g], k_heads[:, :cols], scores, trans_b=True, alpha=scale)
            probs = cp.empty((kv, rows, cols), cp.uint16)
            self.softmax((kv * rows,), (256,), (scores, probs, np.int32(rows), np.int32(cols), np.int32(g),
                                                np.int32(q_offset + s), dyn))
            mm.gemm(probs, v_heads[:, :cols], o3[:, s * g:e * g], trans_b=False)
        return out
